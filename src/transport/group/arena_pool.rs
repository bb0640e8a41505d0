//! Arenas for the groups of one host's ranks, leased without a message
//! (issue #31: groups share the host's memory as they share its links).
//!
//! A host's arena (arena.rs) is followed, in the same memfd, by a pool: a
//! table of leases and `regions` regions, each large enough for an arena of
//! every rank of the host. Every rank of the host maps it with the host's
//! arena, at init. A group whose members all run on one host leases its
//! arena here by a key every member computes alike (its channel's number
//! and its members): the first member to come claims an entry for the key
//! and a free region (or none, if every region is taken: then the group
//! runs over the rings, and so does every member, which finds the entry
//! saying so), and writes the region's header; the others find the entry.
//! Each member gives its lease back when its view of the arena is dropped;
//! the last of them frees the entry and the region (and its memory, which
//! goes back to the system). So a group costs no message, no descriptor and
//! no memory until it uses its arena.
//!
//! The table is changed under a lock in the shared memory, held for a few
//! loads and stores (and, freeing a region, one madvise): the word holds
//! the holder's pid, so that a holder that died there (a SIGKILL at the
//! wrong instant) is found out and its lock taken over. Lock order: the
//! table's lock is taken last; nothing else is locked while it is held.
//! Every value another process wrote here is checked before it is used as
//! an index.

// The header, the table and the regions are memory other processes write:
// every unsafe block says why its access is in bounds and race-free.
#![deny(clippy::undocumented_unsafe_blocks)]

use crate::error::{Error, Result};
use crate::transport::arena::Arena;
use crate::transport::shared_mem::Mapping;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How many arenas a host's pool holds at most: groups of its ranks that
/// hold one at once. Memory is taken only as a group's ops touch it.
const REGIONS: usize = 64;
/// The most address space a pool takes in each process that maps it (where
/// `ulimit -v` is set, every byte mapped counts): fewer regions where an
/// arena of every rank of the host is large.
const MAX_BYTES: usize = 4 << 30;
/// How many groups of a host's ranks may be alive at once (leases, with a
/// region or without).
const ENTRIES: usize = 1024;
const MAGIC: u64 = 0x5243_3130_504f_4f4c; // "RC10POOL"
const HEADER_BYTES: usize = 4096;
const NO_REGION: u32 = u32::MAX;
/// A lock held this long by a process that no longer exists is taken over.
const STALE_LOCK: Duration = Duration::from_secs(1);

#[repr(C)]
struct Header {
    magic: AtomicU64,
    max_world: AtomicU64,
    slot_bytes: AtomicU64,
    regions: AtomicU64,
    /// The pid of the process that holds the table's lock; 0: free.
    lock: AtomicU32,
}

/// A group's lease: its key, its members, how many gave it back, its region.
#[repr(C)]
struct Entry {
    key: AtomicU64,
    /// 1 while the entry is leased.
    used: AtomicU32,
    members: AtomicU32,
    returned: AtomicU32,
    region: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);
const _: () = assert!(std::mem::size_of::<Entry>() == 24);

/// A host's pool of arenas, as this process maps it.
pub struct ArenaPool {
    map: Arc<Mapping>,
    /// Where the pool starts in the mapping (a page).
    offset: usize,
    /// The most ranks an arena of the pool holds (the host's).
    max_world: usize,
    slot_bytes: usize,
    regions: usize,
}

impl ArenaPool {
    fn table_bytes() -> usize {
        (ENTRIES * std::mem::size_of::<Entry>()).div_ceil(4096) * 4096
    }

    fn region_bytes(max_world: usize, slot_bytes: usize) -> Option<usize> {
        Arena::bytes_for(max_world, slot_bytes)?.checked_next_multiple_of(4096)
    }

    /// How many regions a pool for arenas of up to `max_world` ranks with
    /// slots of `slot_bytes` holds: as many as fit `MAX_BYTES`, one at least,
    /// `REGIONS` at most.
    pub fn regions_for(max_world: usize, slot_bytes: usize) -> usize {
        let region = Self::region_bytes(max_world, slot_bytes).unwrap_or(usize::MAX);
        (MAX_BYTES / region).clamp(1, REGIONS)
    }

    /// The bytes of a pool of `regions` arenas of up to `max_world` ranks.
    pub fn bytes_for(max_world: usize, slot_bytes: usize, regions: usize) -> Option<usize> {
        Self::region_bytes(max_world, slot_bytes)?.checked_mul(regions)?.checked_add(HEADER_BYTES + Self::table_bytes())
    }

    /// Write a new pool at `offset` of `map` (zeroes, `bytes_for` long).
    pub(in crate::transport) fn init(
        map: Arc<Mapping>,
        offset: usize,
        max_world: usize,
        slot_bytes: usize,
        regions: usize,
    ) -> ArenaPool {
        let pool = ArenaPool { map, offset, max_world, slot_bytes, regions };
        let h = pool.header();
        h.max_world.store(max_world as u64, Ordering::Relaxed);
        h.slot_bytes.store(slot_bytes as u64, Ordering::Relaxed);
        h.regions.store(regions as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        pool
    }

    /// The pool a peer made at `offset` of `map`, after checking it is one
    /// for arenas of `max_world` with slots of `slot_bytes`, filling the
    /// rest of the mapping.
    pub(in crate::transport) fn open(
        map: Arc<Mapping>,
        offset: usize,
        max_world: usize,
        slot_bytes: usize,
    ) -> Result<ArenaPool> {
        let malformed = || Error::io("rustc10d: malformed pool of arenas from a peer");
        if !offset.is_multiple_of(4096) || offset.checked_add(HEADER_BYTES).is_none_or(|end| end > map.len) {
            return Err(malformed());
        }
        let pool = ArenaPool { map, offset, max_world, slot_bytes, regions: 0 };
        let h = pool.header();
        let regions = h.regions.load(Ordering::Relaxed);
        let fits = usize::try_from(regions)
            .ok()
            .and_then(|r| Some((r, Self::bytes_for(max_world, slot_bytes, r)?.checked_add(offset)?)));
        match fits {
            Some((regions, len))
                if h.magic.load(Ordering::Acquire) == MAGIC
                    && h.max_world.load(Ordering::Relaxed) == max_world as u64
                    && h.slot_bytes.load(Ordering::Relaxed) == slot_bytes as u64
                    && regions > 0
                    && len == pool.map.len =>
            {
                Ok(ArenaPool { regions, ..pool })
            }
            _ => Err(malformed()),
        }
    }

    fn header(&self) -> &Header {
        // SAFETY: the header is at `offset`, a page of the mapping (aligned
        // for Header), with HEADER_BYTES >= size_of::<Header>() mapped after
        // it (checked in `open`; made so by `Arena::create`), which `self.map`
        // keeps alive as long as the borrow. Every field is an atomic, valid
        // as zeroes, so the reference may alias other processes' writes.
        unsafe { &*(self.map.base.add(self.offset) as *const Header) }
    }

    fn entry(&self, i: usize) -> &Entry {
        assert!(i < ENTRIES);
        // SAFETY: the table is the `table_bytes()` after the header, inside
        // the mapping (its length was checked against `bytes_for`); entry i
        // < ENTRIES is in it, aligned (a page plus multiples of 24 bytes, of
        // fields of 8 bytes at most, 8 first). Every field is an atomic,
        // valid as zeroes; `self.map` keeps it mapped as long as the borrow.
        unsafe { &*(self.map.base.add(self.offset + HEADER_BYTES + i * 24) as *const Entry) }
    }

    /// Where region `r` (< regions) starts in the mapping.
    fn region_at(&self, r: usize) -> usize {
        assert!(r < self.regions);
        let bytes = Self::region_bytes(self.max_world, self.slot_bytes).expect("checked in open");
        self.offset + HEADER_BYTES + Self::table_bytes() + r * bytes
    }

    /// Rank `rank`'s view of the arena of the group of `world` ranks that
    /// `key` names (the same on every member, and on no other group of this
    /// host's ranks), leased until the view is dropped; None if the pool
    /// had no region free when the group's first member came (then none
    /// of them has one). Every member must lease it once.
    pub(in crate::transport) fn lease(
        self: &Arc<Self>,
        key: u64,
        world: usize,
        rank: usize,
        deadline: Instant,
    ) -> Result<Option<Arena>> {
        if world > self.max_world || rank >= world {
            return Err(Error::invalid(format!(
                "rustc10d: rank {rank} of a group of {world} cannot lease an arena of a host of {}",
                self.max_world
            )));
        }
        let locked = self.lock(deadline)?;
        let found = (0..ENTRIES).find(|&i| {
            let e = self.entry(i);
            e.used.load(Ordering::Relaxed) == 1 && e.key.load(Ordering::Relaxed) == key
        });
        let i = match found {
            Some(i) => i,
            None => {
                let Some(free) = (0..ENTRIES).find(|&i| self.entry(i).used.load(Ordering::Relaxed) == 0) else {
                    return Err(Error::invalid(format!(
                        "rustc10d: more than {ENTRIES} groups of this host's ranks are alive at once \
                         (RUSTC10D_ARENA_SLOT_BYTES=0 gives groups no arena)"
                    )));
                };
                let taken: Vec<usize> = (0..ENTRIES)
                    .map(|i| self.entry(i))
                    .filter(|e| e.used.load(Ordering::Relaxed) == 1)
                    .map(|e| e.region.load(Ordering::Relaxed) as usize)
                    .collect();
                let region = (0..self.regions).find(|r| !taken.contains(r));
                if let Some(r) = region {
                    Arena::init(&self.map, self.region_at(r), world, self.slot_bytes);
                }
                let e = self.entry(free);
                e.key.store(key, Ordering::Relaxed);
                e.members.store(world as u32, Ordering::Relaxed);
                e.returned.store(0, Ordering::Relaxed);
                e.region.store(region.map_or(NO_REGION, |r| r as u32), Ordering::Relaxed);
                e.used.store(1, Ordering::Relaxed);
                free
            }
        };
        let e = self.entry(i);
        if e.members.load(Ordering::Relaxed) as usize != world {
            return Err(Error::invalid(format!(
                "rustc10d: another group of this host's ranks leased the arena of key {key:#x}: give the group another name"
            )));
        }
        let region = e.region.load(Ordering::Relaxed) as usize;
        drop(locked);
        if region >= self.regions {
            return Ok(None);
        }
        let view = Arena::view(self.map.clone(), self.region_at(region), rank, world, self.slot_bytes);
        Ok(Some(view.leased(Lease { pool: self.clone(), entry: i, key })))
    }

    /// Hold the table's lock until the guard drops: wait for it (taking it
    /// over from a process that died holding it) until `deadline`.
    fn lock(&self, deadline: Instant) -> Result<Locked<'_>> {
        let word = &self.header().lock;
        let me = std::process::id();
        let mut since = (0, Instant::now());
        loop {
            let holder = match word.compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Ok(Locked { word }),
                Err(holder) => holder,
            };
            let now = Instant::now();
            if holder != since.0 {
                since = (holder, now);
            } else if now - since.1 > STALE_LOCK
                && !alive(holder)
                && word.compare_exchange(holder, me, Ordering::Acquire, Ordering::Relaxed).is_ok()
            {
                tracing::warn!("rustc10d: process {holder} died holding the lock of its host's arenas: taken over");
                return Ok(Locked { word });
            }
            if now >= deadline {
                return Err(Error::timeout(format!(
                    "rustc10d: process {holder} held the lock of this host's arenas past the deadline"
                )));
            }
            std::thread::yield_now();
        }
    }

    /// Give back the lease of entry `i` for `key`: the last member frees it.
    fn give_back(&self, i: usize, key: u64) {
        let Ok(_locked) = self.lock(Instant::now() + 2 * STALE_LOCK) else {
            return tracing::warn!("rustc10d: could not give back an arena of this host: it stays taken");
        };
        let e = self.entry(i);
        if e.used.load(Ordering::Relaxed) != 1 || e.key.load(Ordering::Relaxed) != key {
            return;
        }
        let returned = e.returned.load(Ordering::Relaxed) + 1;
        e.returned.store(returned, Ordering::Relaxed);
        if returned < e.members.load(Ordering::Relaxed) {
            return;
        }
        let region = e.region.load(Ordering::Relaxed) as usize;
        if region < self.regions {
            // Its memory goes back to the system now, not when the host's
            // ranks exit; done before the region is free, so that no new
            // group's header is lost to it.
            let bytes = Self::region_bytes(self.max_world, self.slot_bytes).expect("checked in open");
            // SAFETY: the region is inside the mapping (`region_at`), page
            // aligned and `bytes` long; MADV_REMOVE drops its pages (they read
            // as zeroes after), and no arena view of it is left: every member
            // gave its lease back, and a lease outlives its view.
            unsafe { libc::madvise(self.map.base.add(self.region_at(region)).cast(), bytes, libc::MADV_REMOVE) };
        }
        e.used.store(0, Ordering::Relaxed);
    }
}

/// Whether process `pid` exists (or may exist: one this process may not signal).
fn alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only checks the pid.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

struct Locked<'a> {
    word: &'a AtomicU32,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.word.store(0, Ordering::Release);
    }
}

/// One member's lease of its group's arena, given back when dropped (with
/// the arena view that holds it).
pub struct Lease {
    pool: Arc<ArenaPool>,
    entry: usize,
    key: u64,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool.give_back(self.entry, self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Cost;

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    /// A host's arena of `world` ranks with a pool of `regions`, as rank 0 made
    /// it and rank 1 opened it from its descriptor.
    fn host(world: usize, regions: usize) -> (Arena, Arena) {
        let made = Arena::create(world, 4096, 0, regions).unwrap();
        let opened = Arena::open(made.fd().unwrap(), 1, world).unwrap();
        (made, opened)
    }

    #[test]
    fn members_lease_one_region_by_key_and_the_last_frees_it() {
        let (a, b) = host(4, 2);
        let (pa, pb) = (a.pool().unwrap(), b.pool().unwrap());
        let x0 = pa.lease(7, 2, 0, far()).unwrap().unwrap();
        let x1 = pb.lease(7, 2, 1, far()).unwrap().unwrap();
        let y0 = pa.lease(8, 3, 0, far()).unwrap().unwrap();
        // Both regions taken: a third group gets none, on every member.
        assert!(pa.lease(9, 2, 0, far()).unwrap().is_none());
        assert!(pb.lease(9, 2, 1, far()).unwrap().is_none());
        // The two members of key 7 share its region: a round passes between them.
        std::thread::scope(|s| {
            s.spawn(|| x1.round(&[1; 56]).unwrap().stage(far(), Duration::ZERO, &Cost::default()).unwrap());
            x0.round(&[1; 56]).unwrap().stage(far(), Duration::ZERO, &Cost::default()).unwrap();
        });
        assert_eq!(x0.offset(), x1.offset());
        assert_ne!(x0.offset(), y0.offset());
        // A group whose members have not all given it back keeps its region.
        drop(x0);
        assert!(pa.lease(10, 2, 0, far()).unwrap().is_none());
        drop(x1);
        // Key 10's members follow its first, which found no region free.
        assert!(pb.lease(10, 2, 1, far()).unwrap().is_none());
        // Freed: a new group gets it, its header written anew.
        let z0 = pa.lease(11, 2, 0, far()).unwrap().unwrap();
        assert!(z0.aborted().is_none());
        assert_eq!(z0.round(&[2; 56]).unwrap().late(), None, "no stage arrived at yet");
        drop((y0, z0));
    }

    #[test]
    fn an_aborted_region_starts_over_for_the_next_group() {
        let (a, _b) = host(2, 1);
        let pool = a.pool().unwrap();
        let x = pool.lease(1, 1, 0, far()).unwrap().unwrap();
        x.abort("gone");
        drop(x);
        let y = pool.lease(2, 1, 0, far()).unwrap().unwrap();
        assert!(y.aborted().is_none(), "a new group's arena is not aborted");
    }

    #[test]
    fn a_key_leased_for_another_size_is_refused() {
        let (a, _b) = host(4, 2);
        let pool = a.pool().unwrap();
        let _x = pool.lease(5, 2, 0, far()).unwrap();
        assert!(pool.lease(5, 3, 0, far()).is_err());
        assert!(pool.lease(6, 5, 0, far()).is_err(), "larger than the host");
    }

    #[test]
    fn a_lock_left_by_a_dead_process_is_taken_over() {
        let (a, _b) = host(2, 1);
        let pool = a.pool().unwrap();
        // A pid that no process has (above the kernel's pid_max of 2^22).
        pool.header().lock.store(1 << 30, Ordering::SeqCst);
        let started = Instant::now();
        assert!(pool.lease(3, 2, 0, far()).unwrap().is_some());
        assert!(started.elapsed() >= STALE_LOCK);
        // A live holder is waited for until the deadline.
        pool.header().lock.store(1, Ordering::SeqCst);
        let err = pool.lease(4, 2, 0, Instant::now() + Duration::from_millis(50)).err().unwrap();
        assert!(err.message.contains("process 1 held the lock"), "{}", err.message);
        pool.header().lock.store(0, Ordering::SeqCst);
    }

    #[test]
    fn a_pool_keeps_to_its_address_space() {
        assert_eq!(ArenaPool::regions_for(4, 1 << 20), REGIONS);
        let big = ArenaPool::regions_for(256, 1 << 20);
        assert!(big < REGIONS && big * ArenaPool::region_bytes(256, 1 << 20).unwrap() <= MAX_BYTES, "{big}");
        assert_eq!(ArenaPool::regions_for(4096, 1 << 20), 1);
    }

    #[test]
    fn a_pool_that_does_not_add_up_is_refused() {
        let (a, _b) = host(2, 2);
        a.pool().unwrap().header().regions.store(3, Ordering::SeqCst);
        assert!(Arena::open(a.fd().unwrap(), 1, 2).is_err(), "three regions in the room of two");
        a.pool().unwrap().header().regions.store(u64::MAX, Ordering::SeqCst);
        assert!(Arena::open(a.fd().unwrap(), 1, 2).is_err());
        a.pool().unwrap().header().regions.store(2, Ordering::SeqCst);
        assert!(Arena::open(a.fd().unwrap(), 1, 2).unwrap().pool().is_some());
    }
}
