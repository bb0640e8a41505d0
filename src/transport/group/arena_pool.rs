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
//! loads and stores (and, freeing a region, one madvise): a robust,
//! process-shared pthread mutex. Only its holder can release it, a waiter
//! sleeps in the kernel (a futex) until it is released or the deadline
//! passes, and a holder that dies holding it (a SIGKILL at the wrong
//! instant) has it released by the kernel (the robust list), whichever pid
//! namespace it ran in: the next holder finds that out (EOWNERDEAD) and
//! goes on with the table as the dead one left it (every edit writes
//! `used` last). A live holder is never taken over, however long it is
//! stopped (a debugger, SIGSTOP). Before, the lock word was the holder's
//! pid, taken over from a pid that looked dead, which a holder in another
//! pid namespace does, and released by a plain store: two processes could
//! hold it. Lock order: the table's lock is taken last; nothing else is
//! locked while it is held.
//! Every value another process wrote here is checked before it is used as
//! an index.

// The header, the table and the regions are memory other processes write:
// every unsafe block says why its access is in bounds and race-free.
#![deny(clippy::undocumented_unsafe_blocks)]

use crate::error::{Error, Result};
use crate::transport::arena::Arena;
use crate::transport::shared_mem::Mapping;
use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
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
/// How long giving a lease back waits for the table's lock.
const GIVE_BACK_WAIT: Duration = Duration::from_secs(2);

#[repr(C)]
struct Header {
    magic: AtomicU64,
    max_world: AtomicU64,
    slot_bytes: AtomicU64,
    regions: AtomicU64,
    /// The pid of the process that holds the table's lock (as its own pid
    /// namespace numbers it), for messages only; 0: none.
    holder: AtomicU32,
    /// The table's lock (see the module's doc).
    lock: UnsafeCell<libc::pthread_mutex_t>,
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
    ) -> Result<ArenaPool> {
        let pool = ArenaPool { map, offset, max_world, slot_bytes, regions };
        let h = pool.header();
        init_robust_mutex(h.lock.get())?;
        h.max_world.store(max_world as u64, Ordering::Relaxed);
        h.slot_bytes.store(slot_bytes as u64, Ordering::Relaxed);
        h.regions.store(regions as u64, Ordering::Relaxed);
        // Published last: a peer that sees the magic sees the mutex made.
        h.magic.store(MAGIC, Ordering::Release);
        Ok(pool)
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

    /// Hold the table's lock until the guard drops (on this thread): wait
    /// for it, asleep, until `deadline`.
    fn lock(&self, deadline: Instant) -> Result<Locked<'_>> {
        let h = self.header();
        let until = realtime(deadline);
        // SAFETY: the mutex lies in the header, mapped while `self` lives,
        // and was made robust and process-shared (`init`) before the magic
        // a peer's `open` checks was published; `until` is a live local.
        let rc = unsafe { libc::pthread_mutex_timedlock(h.lock.get(), &until) };
        match rc {
            0 => {}
            libc::EOWNERDEAD => {
                // SAFETY: this thread holds the mutex (EOWNERDEAD locks it), as
                // pthread_mutex_consistent requires.
                unsafe { libc::pthread_mutex_consistent(h.lock.get()) };
                tracing::warn!(
                    "rustc10d: process {} died holding the lock of its host's arenas: released by the kernel",
                    h.holder.load(Ordering::Relaxed)
                );
            }
            libc::ETIMEDOUT => {
                return Err(Error::timeout(format!(
                    "rustc10d: process {} held the lock of this host's arenas past the deadline",
                    h.holder.load(Ordering::Relaxed)
                )));
            }
            e => {
                return Err(Error::io(format!(
                    "rustc10d: the lock of this host's arenas failed: {}",
                    std::io::Error::from_raw_os_error(e)
                )));
            }
        }
        h.holder.store(std::process::id(), Ordering::Relaxed);
        Ok(Locked { header: h })
    }

    /// Give back the lease of entry `i` for `key`: the last member frees it.
    fn give_back(&self, i: usize, key: u64) {
        let Ok(_locked) = self.lock(Instant::now() + GIVE_BACK_WAIT) else {
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

/// Make the mutex at `mutex` (zeroes, in shared memory no one else uses
/// yet) robust and process-shared.
fn init_robust_mutex(mutex: *mut libc::pthread_mutex_t) -> Result<()> {
    let failed =
        |what: &str, rc: i32| Error::io(format!("rustc10d: {what} failed: {}", std::io::Error::from_raw_os_error(rc)));
    let mut attr = MaybeUninit::<libc::pthread_mutexattr_t>::uninit();
    // SAFETY: `attr` is a live local, initialised by pthread_mutexattr_init
    // before the setters use it and destroyed once, after the mutex is made;
    // `mutex` points at a pthread_mutex_t in a live mapping (the caller's
    // header), which nothing else uses until the magic is published.
    unsafe {
        let rc = libc::pthread_mutexattr_init(attr.as_mut_ptr());
        if rc != 0 {
            return Err(failed("pthread_mutexattr_init", rc));
        }
        let mut rc = libc::pthread_mutexattr_setpshared(attr.as_mut_ptr(), libc::PTHREAD_PROCESS_SHARED);
        if rc == 0 {
            rc = libc::pthread_mutexattr_setrobust(attr.as_mut_ptr(), libc::PTHREAD_MUTEX_ROBUST);
        }
        if rc == 0 {
            rc = libc::pthread_mutex_init(mutex, attr.as_ptr());
        }
        libc::pthread_mutexattr_destroy(attr.as_mut_ptr());
        if rc != 0 {
            return Err(failed("making the arenas' lock", rc));
        }
    }
    Ok(())
}

/// `deadline` on CLOCK_REALTIME, as pthread_mutex_timedlock takes it.
fn realtime(deadline: Instant) -> libc::timespec {
    let left = deadline.saturating_duration_since(Instant::now());
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into `now`, a live local.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) };
    let nanos = now.tv_nsec as u64 + u64::from(left.subsec_nanos());
    libc::timespec {
        tv_sec: now.tv_sec.saturating_add(left.as_secs().min(i64::MAX as u64 / 2) as libc::time_t)
            + (nanos / 1_000_000_000) as libc::time_t,
        tv_nsec: (nanos % 1_000_000_000) as libc::c_long,
    }
}

/// The table's lock, held by this thread until dropped (a robust mutex
/// must be unlocked by the thread that locked it: `&Header` is not `Send`).
struct Locked<'a> {
    header: &'a Header,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.header.holder.store(0, Ordering::Relaxed);
        // SAFETY: this thread locked the mutex (`lock`) and holds it until now;
        // the header stays mapped for the guard's lifetime.
        let rc = unsafe { libc::pthread_mutex_unlock(self.header.lock.get()) };
        debug_assert_eq!(rc, 0, "the arenas' lock released by its holder");
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

    /// Run `hold` in a child process (fork: it must not allocate, as other
    /// threads of the test may hold the allocator's locks), which ends with
    /// `_exit(0)`; its pid.
    fn child(hold: impl FnOnce()) -> libc::pid_t {
        // SAFETY: fork has no preconditions; the child runs `hold`, which
        // only locks, stores to shared memory and writes to a pipe, then exits
        // without running anything of the parent's (no destructors, no atexit).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            hold();
            // SAFETY: _exit ends the child at once; it has no preconditions.
            unsafe { libc::_exit(0) };
        }
        pid
    }

    fn waited(pid: libc::pid_t) {
        let mut status = 0;
        // SAFETY: waits for our own child; `status` is a live local.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    }

    /// A process that dies holding the lock (SIGKILL at the wrong instant,
    /// here an exit without unlocking) has it released by the kernel: the
    /// next lease takes it at once, whatever that process's pid now names.
    #[test]
    fn a_lock_left_by_a_dead_process_is_released_by_the_kernel() {
        let (a, _b) = host(2, 1);
        let pool = a.pool().unwrap();
        let mutex = pool.header().lock.get();
        // SAFETY: the child locks the pool's mutex, mapped (shared) in it too.
        waited(child(|| unsafe {
            libc::pthread_mutex_lock(mutex);
        }));
        let started = Instant::now();
        assert!(pool.lease(3, 2, 0, far()).unwrap().is_some());
        assert!(started.elapsed() < Duration::from_millis(500), "{:?}", started.elapsed());
        // And it is an ordinary lock after that.
        assert!(pool.lease(4, 2, 0, far()).unwrap().is_none(), "the one region is leased");
    }

    /// A holder that stops (SIGSTOP, a debugger) well past the second after
    /// which a pid-word lock took over is waited for, asleep, however long;
    /// once it resumes and releases, the waiter leases, and by the table's
    /// values no region serves two groups. A waiter whose deadline passes
    /// first fails naming the holder.
    #[test]
    fn a_stopped_holder_is_waited_for_never_taken_over() {
        let (a, _b) = host(2, 2);
        let pool = a.pool().unwrap().clone();
        let (h, e0) = (pool.header(), pool.entry(0));
        let mut fds = [0; 2];
        // SAFETY: pipe writes two descriptors into `fds`, a live local.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let holder = child(|| {
            // SAFETY: the pool's mutex and table are mapped (shared) in the
            // child; the byte written is a live local.
            unsafe {
                libc::pthread_mutex_lock(h.lock.get());
                h.holder.store(libc::getpid() as u32, Ordering::Relaxed);
                libc::write(fds[1], [1u8].as_ptr().cast(), 1);
                // Stopped here by the parent; then it leases region 0 for key 0xA, as `lease` does.
                libc::usleep(100_000);
                e0.key.store(0xA, Ordering::Relaxed);
                e0.members.store(2, Ordering::Relaxed);
                e0.returned.store(0, Ordering::Relaxed);
                e0.region.store(0, Ordering::Relaxed);
                e0.used.store(1, Ordering::Relaxed);
                h.holder.store(0, Ordering::Relaxed);
                libc::pthread_mutex_unlock(h.lock.get());
            }
        });
        let mut byte = [0u8; 1];
        // SAFETY: reads one byte into a live local from the pipe's read end.
        assert_eq!(unsafe { libc::read(fds[0], byte.as_mut_ptr().cast(), 1) }, 1, "the child holds the lock");
        // SAFETY: stops our own child.
        unsafe { libc::kill(holder, libc::SIGSTOP) };
        let err = pool.lease(0xB, 2, 0, Instant::now() + Duration::from_millis(100)).err().unwrap();
        assert!(err.message.contains(&format!("process {holder} held the lock")), "{}", err.message);
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.lease(0xB, 2, 0, far()).map(|a| a.map(|a| a.offset())))
        };
        std::thread::sleep(Duration::from_millis(2500));
        assert!(!waiter.is_finished(), "a stopped holder's lock was taken over");
        // SAFETY: resumes our own child.
        unsafe { libc::kill(holder, libc::SIGCONT) };
        let offset = waiter.join().unwrap().unwrap().expect("region 1 is free");
        waited(holder);
        assert_eq!((e0.key.load(Ordering::Relaxed), e0.region.load(Ordering::Relaxed)), (0xA, 0));
        assert_eq!(offset, pool.region_at(1), "key 0xB got the region key 0xA did not take");
        // SAFETY: closes the pipe's two descriptors, used no more.
        unsafe { (libc::close(fds[0]), libc::close(fds[1])) };
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
