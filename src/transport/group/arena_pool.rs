//! Arenas for the groups of one host's ranks, leased without a message
//! (issue #31: groups share the host's memory as they share its links).
//!
//! A host's arena (arena.rs) is followed, in the same memfd, by a pool: a
//! slot per rank of the host, a table of leases and `regions` regions, each
//! large enough for an arena of every rank of the host. Every rank of the
//! host maps it with the host's arena, at init. A group whose members all
//! run on one host leases its arena here by a key every member computes
//! alike (its channel's number and its members): the first member to come
//! claims an entry for the key and a free region (or none, if every region
//! is taken: then the group runs over the rings, and so does every member,
//! which finds the entry saying so), and writes the region's header; the
//! others find the entry. An entry records its group's members as ranks of
//! the host, and which of them have found it and given it back. It is freed
//! once every member has found it, if it holds no region (its verdict is
//! read; before, such entries were never freed, and the table filled); and
//! once every member has given it back, if it holds one (its memory goes
//! back to the system). So a group costs no message, no descriptor and no
//! memory until it uses its arena. A table full of groups that members have
//! yet to find (one rank far ahead of the others) makes the next group wait
//! for them, until its deadline: a full table has no room to say "no arena",
//! which the others would need to follow it onto the rings.
//!
//! **Dead members.** Each rank of the host holds its slot's lock for as
//! long as its process maps the pool: a robust, process-shared mutex locked
//! by a thread of its own (`Keeper`), which the kernel releases when the
//! process dies (its robust list), whichever pid namespace it ran in, and
//! which a stopped process (SIGSTOP, a debugger) still holds. Where the
//! table or the regions are full, the pool counts every member whose slot's
//! lock is free as having found and given back every lease it was in
//! (`reclaim`): a SIGKILLed rank's leases come back while its host's other
//! ranks go on, and no region is ever freed under a live member's view.
//!
//! **The table's lock.** The table is changed under a lock in the shared
//! memory, held for a few loads and stores (and, freeing a region, one
//! madvise): a robust, process-shared pthread mutex too. Only its holder can
//! release it, a waiter sleeps in the kernel (a futex) until it is released
//! or the deadline passes, and a holder that dies holding it (a SIGKILL at
//! the wrong instant) has it released by the kernel: the next holder finds
//! that out (EOWNERDEAD) and goes on with the table as the dead one left it
//! (every edit writes `used` last). A live holder is never taken over,
//! however long it is stopped. Before, the lock word was the holder's pid,
//! taken over from a pid that looked dead, which a holder in another pid
//! namespace does, and released by a plain store: two processes could hold
//! it. Lock order: the table's lock is taken last; nothing else is locked
//! while it is held (a slot's lock is only tried, never waited for).
//!
//! Every value another process wrote here is checked before it is used as
//! an index.

// The header, the slots, the table and the regions are memory other
// processes write: every unsafe block says why its access is in bounds and
// race-free.
#![deny(clippy::undocumented_unsafe_blocks)]

use crate::error::{Error, Result};
use crate::transport::group::arena::Arena;
use crate::transport::links::shared_mem::Mapping;
use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How many arenas a host's pool holds at most: groups of its ranks that
/// hold one at once. Memory is taken only as a group's ops touch it.
const REGIONS: usize = 64;
/// The most address space a pool takes in each process that maps it (where
/// `ulimit -v` is set, every byte mapped counts): fewer regions where an
/// arena of every rank of the host is large.
const MAX_BYTES: usize = 4 << 30;
/// How many groups of a host's ranks may hold an entry at once: a region,
/// or a verdict of none that some member has yet to find.
const ENTRIES: usize = 1024;
/// The most ranks a host may have for its groups to lease arenas (an entry
/// records its members as a set of them); a host with more has no pool, and
/// its groups run over the rings.
pub const MAX_SLOTS: usize = 256;
const WORDS: usize = MAX_SLOTS / 64;
const MAGIC: u64 = 0x5243_3130_504f_4c32; // "RC10POL2"
const HEADER_BYTES: usize = 4096;
const NO_REGION: u32 = u32::MAX;
/// The longest a group waits between two looks at a full table.
const FULL_TABLE_PAUSE: Duration = Duration::from_millis(20);
/// How long giving a lease back waits for the table's lock.
const GIVE_BACK_WAIT: Duration = Duration::from_secs(2);

/// A set of the host's ranks, a bit each.
type Ranks = [u64; WORDS];

fn ranks_of(slots: &[usize]) -> Ranks {
    let mut set = [0; WORDS];
    slots.iter().for_each(|&s| set[s / 64] |= 1 << (s % 64));
    set
}

fn count(set: &Ranks) -> usize {
    set.iter().map(|w| w.count_ones() as usize).sum()
}

fn has(set: &Ranks, s: usize) -> bool {
    set[s / 64] & 1 << (s % 64) != 0
}

fn union(a: &Ranks, b: &Ranks) -> Ranks {
    std::array::from_fn(|w| a[w] | b[w])
}

fn meet(a: &Ranks, b: &Ranks) -> Ranks {
    std::array::from_fn(|w| a[w] & b[w])
}

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

/// One rank of the host, as the pool knows it.
#[repr(C)]
struct Slot {
    /// Held by the rank's keeper thread while its process maps the pool.
    alive: UnsafeCell<libc::pthread_mutex_t>,
    /// 1 once the rank holds `alive`: before, it is counted as alive.
    claimed: AtomicU32,
}

/// A group's lease: its key, its members, who found it and gave it back,
/// its region.
#[repr(C)]
struct Entry {
    key: AtomicU64,
    /// 1 while the entry is leased.
    used: AtomicU32,
    region: AtomicU32,
    members: [AtomicU64; WORDS],
    arrived: [AtomicU64; WORDS],
    returned: [AtomicU64; WORDS],
}

impl Entry {
    fn load(words: &[AtomicU64; WORDS]) -> Ranks {
        std::array::from_fn(|w| words[w].load(Ordering::Relaxed))
    }

    fn store(words: &[AtomicU64; WORDS], set: &Ranks) {
        words.iter().zip(set).for_each(|(w, &v)| w.store(v, Ordering::Relaxed));
    }
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);
const ENTRY_BYTES: usize = std::mem::size_of::<Entry>();
const _: () = assert!(ENTRY_BYTES == 16 + 24 * WORDS && ENTRY_BYTES.is_multiple_of(8));
const SLOT_BYTES: usize = std::mem::size_of::<Slot>();
const _: () = assert!(SLOT_BYTES.is_multiple_of(8));

/// A host's pool of arenas, as this process maps it.
pub struct ArenaPool {
    map: Arc<Mapping>,
    /// Where the pool starts in the mapping (a page).
    offset: usize,
    /// The most ranks an arena of the pool holds (the host's).
    max_world: usize,
    slot_bytes: usize,
    regions: usize,
    /// This process's slot (its rank of the host).
    slot: usize,
    /// Holds the slot's lock while the pool is mapped here.
    _keeper: Option<Keeper>,
}

impl ArenaPool {
    fn slots_bytes(max_world: usize) -> usize {
        (max_world * SLOT_BYTES).div_ceil(4096) * 4096
    }

    fn table_bytes() -> usize {
        (ENTRIES * ENTRY_BYTES).div_ceil(4096) * 4096
    }

    fn region_bytes(max_world: usize, slot_bytes: usize) -> Option<usize> {
        Arena::bytes_for(max_world, slot_bytes)?.checked_next_multiple_of(4096)
    }

    /// How many regions a pool for arenas of up to `max_world` ranks with
    /// slots of `slot_bytes` holds: as many as fit `MAX_BYTES`, one at least,
    /// `REGIONS` at most; none (no pool) for a host of more than MAX_SLOTS.
    pub fn regions_for(max_world: usize, slot_bytes: usize) -> usize {
        if max_world > MAX_SLOTS {
            return 0;
        }
        let region = Self::region_bytes(max_world, slot_bytes).unwrap_or(usize::MAX);
        (MAX_BYTES / region).clamp(1, REGIONS)
    }

    /// The bytes of a pool of `regions` arenas of up to `max_world` ranks.
    pub fn bytes_for(max_world: usize, slot_bytes: usize, regions: usize) -> Option<usize> {
        if max_world > MAX_SLOTS {
            return None;
        }
        Self::region_bytes(max_world, slot_bytes)?
            .checked_mul(regions)?
            .checked_add(HEADER_BYTES + Self::slots_bytes(max_world) + Self::table_bytes())
    }

    /// Write a new pool at `offset` of `map` (zeroes, `bytes_for` long), as
    /// rank `slot` of the host maps it.
    pub(in crate::transport) fn init(
        map: Arc<Mapping>,
        offset: usize,
        max_world: usize,
        slot_bytes: usize,
        regions: usize,
        slot: usize,
    ) -> Result<ArenaPool> {
        if slot >= max_world || max_world > MAX_SLOTS || regions > REGIONS {
            return Err(Error::invalid(format!(
                "rustc10d: no pool of {regions} arenas for rank {slot} of {max_world}"
            )));
        }
        let pool = ArenaPool { map, offset, max_world, slot_bytes, regions, slot, _keeper: None };
        let h = pool.header();
        init_robust_mutex(h.lock.get())?;
        for s in 0..max_world {
            init_robust_mutex(pool.slot_of(s).alive.get())?;
        }
        h.max_world.store(max_world as u64, Ordering::Relaxed);
        h.slot_bytes.store(slot_bytes as u64, Ordering::Relaxed);
        h.regions.store(regions as u64, Ordering::Relaxed);
        // Published last: a peer that sees the magic sees the mutexes made.
        h.magic.store(MAGIC, Ordering::Release);
        pool.kept()
    }

    /// The pool a peer made at `offset` of `map`, after checking it is one
    /// for arenas of `max_world` with slots of `slot_bytes`, filling the
    /// rest of the mapping, as rank `slot` of the host maps it.
    pub(in crate::transport) fn open(
        map: Arc<Mapping>,
        offset: usize,
        max_world: usize,
        slot_bytes: usize,
        slot: usize,
    ) -> Result<ArenaPool> {
        let malformed = || Error::io("rustc10d: malformed pool of arenas from a peer");
        if !offset.is_multiple_of(4096) || offset.checked_add(HEADER_BYTES).is_none_or(|end| end > map.len) {
            return Err(malformed());
        }
        let pool = ArenaPool { map, offset, max_world, slot_bytes, regions: 0, slot, _keeper: None };
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
                    && (1..=REGIONS).contains(&regions)
                    && slot < max_world
                    && len == pool.map.len =>
            {
                ArenaPool { regions, ..pool }.kept()
            }
            _ => Err(malformed()),
        }
    }

    /// This pool, its slot held by a keeper from now on.
    fn kept(self) -> Result<ArenaPool> {
        let keeper = Keeper::start(self.map.clone(), self.slot_offset(self.slot), self.slot)?;
        Ok(ArenaPool { _keeper: Some(keeper), ..self })
    }

    fn header(&self) -> &Header {
        // SAFETY: the header is at `offset`, a page of the mapping (aligned
        // for Header), with HEADER_BYTES >= size_of::<Header>() mapped after
        // it (checked in `open`; made so by `Arena::create`), which `self.map`
        // keeps alive as long as the borrow. Every field is an atomic, valid
        // as zeroes, so the reference may alias other processes' writes.
        unsafe { &*(self.map.base.add(self.offset) as *const Header) }
    }

    /// Where slot `s` (< max_world) lies in the mapping.
    fn slot_offset(&self, s: usize) -> usize {
        assert!(s < self.max_world);
        self.offset + HEADER_BYTES + s * SLOT_BYTES
    }

    fn slot_of(&self, s: usize) -> &Slot {
        // SAFETY: the slots are the `slots_bytes(max_world)` after the header,
        // inside the mapping (its length was checked against `bytes_for`);
        // slot s < max_world (asserted by `slot_offset`) is in them, aligned
        // (a page plus multiples of SLOT_BYTES, itself a multiple of 8). Its
        // fields are a process-shared mutex and an atomic, made to be shared;
        // `self.map` keeps it mapped as long as the borrow.
        unsafe { &*(self.map.base.add(self.slot_offset(s)) as *const Slot) }
    }

    fn entry(&self, i: usize) -> &Entry {
        assert!(i < ENTRIES);
        let at = self.offset + HEADER_BYTES + Self::slots_bytes(self.max_world) + i * ENTRY_BYTES;
        // SAFETY: the table is the `table_bytes()` after the slots, inside the
        // mapping (its length was checked against `bytes_for`); entry i <
        // ENTRIES is in it, aligned (pages plus multiples of ENTRY_BYTES, a
        // multiple of 8, of fields of 8 bytes at most, 8 first). Every field
        // is an atomic, valid as zeroes; `self.map` keeps it mapped as long
        // as the borrow.
        unsafe { &*(self.map.base.add(at) as *const Entry) }
    }

    /// Where region `r` (< regions) starts in the mapping.
    fn region_at(&self, r: usize) -> usize {
        assert!(r < self.regions);
        let bytes = Self::region_bytes(self.max_world, self.slot_bytes).expect("checked in open");
        self.offset + HEADER_BYTES + Self::slots_bytes(self.max_world) + Self::table_bytes() + r * bytes
    }

    /// The view of member `me` of the arena of the group whose member i is
    /// rank `slots[i]` of the host, named by `key` (the same on every
    /// member, and on no other group of this host's ranks), leased until the
    /// view is dropped; None if the pool had no region free when the
    /// group's first member came (then none of them has one). Every member
    /// must lease it once, as itself (`slots[me]` is this process's slot).
    pub(in crate::transport) fn lease(
        self: &Arc<Self>,
        key: u64,
        slots: &[usize],
        me: usize,
        deadline: Instant,
    ) -> Result<Option<Arena>> {
        let members = ranks_of(slots);
        let distinct = count(&members) == slots.len();
        if slots.iter().any(|&s| s >= self.max_world) || !distinct || slots.get(me) != Some(&self.slot) {
            return Err(Error::invalid(format!(
                "rustc10d: member {me} of the group of this host's ranks {slots:?} cannot lease an arena of \
                 a host of {} as its rank {}",
                self.max_world, self.slot
            )));
        }
        let mut pause = Duration::from_millis(1);
        let (i, region) = loop {
            let locked = self.lock(deadline)?;
            let taken = self.take(key, &members, self.slot)?;
            drop(locked);
            match taken {
                Some(taken) => break taken,
                // Every entry is a group of this host's ranks that some
                // member has yet to find, or that holds a region: they free
                // theirs as they come (or die), so this group waits for them
                // rather than fail, while its deadline lets it.
                None if Instant::now() + pause < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(FULL_TABLE_PAUSE);
                }
                None => {
                    return Err(Error::timeout(format!(
                        "rustc10d: more than {ENTRIES} groups of this host's ranks were being made at once, or held \
                         an arena, until the group's timeout: their other members did not come to them \
                         (RUSTC10D_ARENA_SLOT_BYTES=0 gives groups no arena)"
                    )))
                }
            }
        };
        if region as usize >= self.regions {
            return Ok(None);
        }
        let view = Arena::view(self.map.clone(), self.region_at(region as usize), me, slots.len(), self.slot_bytes);
        Ok(Some(view.leased(Lease { pool: self.clone(), entry: i, key })))
    }

    /// Find (or, the group's first, make) the entry of `key` for the group
    /// of `members` as member `mine` of the host: its index and region
    /// (NO_REGION: none); None where the table is full. With the table's
    /// lock held; allocates nothing (a test runs it in a forked child).
    fn take(&self, key: u64, members: &Ranks, mine: usize) -> Result<Option<(usize, u32)>> {
        let found = (0..ENTRIES).find(|&i| {
            let e = self.entry(i);
            e.used.load(Ordering::Relaxed) == 1 && e.key.load(Ordering::Relaxed) == key
        });
        if let Some(i) = found {
            let e = self.entry(i);
            let arrived = Entry::load(&e.arrived);
            if Entry::load(&e.members) != *members || has(&arrived, mine) {
                return Err(Error::invalid(format!(
                    "rustc10d: another group of this host's ranks leased the arena of key {key:#x}: give the group \
                     another name"
                )));
            }
            Entry::store(&e.arrived, &union(&arrived, &ranks_of(&[mine])));
            let region = e.region.load(Ordering::Relaxed);
            self.settle(i);
            return Ok(Some((i, region)));
        }
        let free_entry = || (0..ENTRIES).find(|&i| self.entry(i).used.load(Ordering::Relaxed) == 0);
        let Some(free) = free_entry().or_else(|| self.reclaim().then(free_entry).flatten()) else {
            return Ok(None);
        };
        let region = self.free_region().or_else(|| self.reclaim().then(|| self.free_region()).flatten());
        if let Some(r) = region {
            Arena::init(&self.map, self.region_at(r), count(members), self.slot_bytes);
        }
        let e = self.entry(free);
        e.key.store(key, Ordering::Relaxed);
        Entry::store(&e.members, members);
        Entry::store(&e.arrived, &ranks_of(&[mine]));
        Entry::store(&e.returned, &[0; WORDS]);
        let region = region.map_or(NO_REGION, |r| r as u32);
        e.region.store(region, Ordering::Relaxed);
        e.used.store(1, Ordering::Relaxed);
        self.settle(free);
        Ok(Some((free, region)))
    }

    /// A region no entry holds, if any. With the table's lock held.
    fn free_region(&self) -> Option<usize> {
        let mut taken = [false; REGIONS];
        // `regions` is at most REGIONS (checked in `init` and `open`).
        for i in 0..ENTRIES {
            let e = self.entry(i);
            let r = e.region.load(Ordering::Relaxed) as usize;
            if e.used.load(Ordering::Relaxed) == 1 && r < self.regions {
                taken[r] = true;
            }
        }
        (0..self.regions).find(|&r| !taken[r])
    }

    /// Free entry `i` if it is done with: every member gave it back, or it
    /// holds no region and every member found it. With the table's lock held.
    fn settle(&self, i: usize) {
        let e = self.entry(i);
        let members = Entry::load(&e.members);
        let region = e.region.load(Ordering::Relaxed) as usize;
        let done = if region < self.regions {
            Entry::load(&e.returned) == members
        } else {
            Entry::load(&e.arrived) == members
        };
        if !done {
            return;
        }
        if region < self.regions {
            // Its memory goes back to the system now, not when the host's
            // ranks exit; done before the region is free, so that no new
            // group's header is lost to it.
            let bytes = Self::region_bytes(self.max_world, self.slot_bytes).expect("checked in open");
            // SAFETY: the region is inside the mapping (`region_at`), page
            // aligned and `bytes` long; MADV_REMOVE drops its pages (they read
            // as zeroes after), and no arena view of it is left: every member
            // gave its lease back (a lease outlives its view) or is dead.
            unsafe { libc::madvise(self.map.base.add(self.region_at(region)).cast(), bytes, libc::MADV_REMOVE) };
        }
        e.used.store(0, Ordering::Relaxed);
    }

    /// The host's ranks whose process has ended (or unmapped the pool):
    /// their slot's lock was claimed and is free now. A slot whose lock is
    /// held (a live process, stopped or not) or never claimed counts as alive.
    fn dead(&self) -> Ranks {
        let mut dead = [0; WORDS];
        for s in 0..self.max_world {
            let slot = self.slot_of(s);
            if slot.claimed.load(Ordering::Acquire) == 0 {
                continue;
            }
            // SAFETY: the mutex lies in slot s, mapped while `self` lives, and
            // was made robust and process-shared before the magic was published.
            let rc = unsafe { libc::pthread_mutex_trylock(slot.alive.get()) };
            match rc {
                0 => {}
                libc::EOWNERDEAD => {
                    // SAFETY: this thread holds the mutex (EOWNERDEAD locks it).
                    unsafe { libc::pthread_mutex_consistent(slot.alive.get()) };
                }
                _ => continue,
            }
            // SAFETY: this thread locked it just now (0 or EOWNERDEAD).
            unsafe { libc::pthread_mutex_unlock(slot.alive.get()) };
            dead[s / 64] |= 1 << (s % 64);
        }
        dead
    }

    /// Count every dead member of every entry as having found it and given
    /// it back, freeing the entries that are then done with; whether any
    /// member was dead. With the table's lock held.
    fn reclaim(&self) -> bool {
        let dead = self.dead();
        if dead == [0; WORDS] {
            return false;
        }
        let mut freed = 0;
        for i in 0..ENTRIES {
            let e = self.entry(i);
            if e.used.load(Ordering::Relaxed) != 1 {
                continue;
            }
            let gone = meet(&Entry::load(&e.members), &dead);
            if gone == [0; WORDS] {
                continue;
            }
            Entry::store(&e.arrived, &union(&Entry::load(&e.arrived), &gone));
            Entry::store(&e.returned, &union(&Entry::load(&e.returned), &gone));
            self.settle(i);
            freed += usize::from(e.used.load(Ordering::Relaxed) == 0);
        }
        if freed > 0 {
            tracing::info!("rustc10d: {freed} leases of this host's arenas held by ended processes taken back");
        }
        true
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

    /// Give back this process's lease of entry `i` for `key`: the last
    /// member frees it.
    fn give_back(&self, i: usize, key: u64) {
        let Ok(_locked) = self.lock(Instant::now() + GIVE_BACK_WAIT) else {
            return tracing::warn!("rustc10d: could not give back an arena of this host: it stays taken");
        };
        let e = self.entry(i);
        if e.used.load(Ordering::Relaxed) != 1 || e.key.load(Ordering::Relaxed) != key {
            return;
        }
        Entry::store(&e.returned, &union(&Entry::load(&e.returned), &ranks_of(&[self.slot])));
        self.settle(i);
    }
}

/// The thread that holds a slot's lock while this process maps the pool:
/// a robust mutex belongs to a thread, and no other thread of ours is sure
/// to live as long. Dropped, it releases the lock and ends.
struct Keeper {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    /// The process that started it: a forked child has no such thread.
    pid: u32,
}

impl Keeper {
    /// Hold the lock of the slot at `offset` of `map` (rank `slot` of the host).
    fn start(map: Arc<Mapping>, offset: usize, slot: usize) -> Result<Keeper> {
        let (stop, stopped) = mpsc::channel::<()>();
        let (ready, held) = mpsc::channel::<i32>();
        let keep = move || {
            // SAFETY: `offset` is slot `slot`'s place in the mapping (`slot_offset`,
            // in bounds and aligned), which `map`, moved here, keeps mapped
            // until the thread ends; its fields are made to be shared.
            let s = unsafe { &*(map.base.add(offset) as *const Slot) };
            // Tried, never waited for: another live process holding it means
            // two processes claim one rank of the host.
            // SAFETY: a robust process-shared mutex made before the magic was published.
            let mut rc = unsafe { libc::pthread_mutex_trylock(s.alive.get()) };
            if rc == libc::EOWNERDEAD {
                // SAFETY: this thread holds it (EOWNERDEAD locks it).
                rc = unsafe { libc::pthread_mutex_consistent(s.alive.get()) };
            }
            let _ = ready.send(rc);
            if rc != 0 {
                return;
            }
            s.claimed.store(1, Ordering::Release);
            // Until the pool is dropped (the sender with it).
            let _ = stopped.recv();
            // SAFETY: this thread locked it above and holds it until now.
            unsafe { libc::pthread_mutex_unlock(s.alive.get()) };
        };
        let thread = std::thread::Builder::new()
            .name("rustc10d-alive".into())
            .stack_size(64 * 1024)
            .spawn(keep)
            .map_err(|e| Error::io(format!("rustc10d: could not start the arenas' keeper thread: {e}")))?;
        match held.recv() {
            Ok(0) => Ok(Keeper { stop: Some(stop), thread: Some(thread), pid: std::process::id() }),
            rc => {
                let _ = thread.join();
                Err(Error::io(format!(
                    "rustc10d: rank {slot} of this host's arenas is held by another live process ({})",
                    rc.map_or_else(|_| "its keeper ended".into(), |e| std::io::Error::from_raw_os_error(e).to_string())
                )))
            }
        }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        drop(self.stop.take());
        let Some(t) = self.thread.take() else { return };
        if std::process::id() == self.pid {
            let _ = t.join();
        } else {
            // A forked child's copy: the thread is its parent's, which joining
            // (or detaching) here would wait on or free as if it were ours.
            std::mem::forget(t);
        }
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
    // header or slot), which nothing else uses until the magic is published.
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
    use crate::transport::group::arena::Shape;

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
        let x0 = pa.lease(7, &[0, 1], 0, far()).unwrap().unwrap();
        let x1 = pb.lease(7, &[0, 1], 1, far()).unwrap().unwrap();
        let y0 = pa.lease(8, &[0, 1, 2], 0, far()).unwrap().unwrap();
        // Both regions taken: a third group gets none, on every member.
        assert!(pa.lease(9, &[0, 1], 0, far()).unwrap().is_none());
        assert!(pb.lease(9, &[0, 1], 1, far()).unwrap().is_none());
        // The two members of key 7 share its region: a round passes between them.
        std::thread::scope(|s| {
            s.spawn(|| {
                x1.round(&[1; 56], Shape::Gather).unwrap().stage(far(), Duration::ZERO, &Cost::default()).unwrap()
            });
            x0.round(&[1; 56], Shape::Gather).unwrap().stage(far(), Duration::ZERO, &Cost::default()).unwrap();
        });
        assert_eq!(x0.offset(), x1.offset());
        assert_ne!(x0.offset(), y0.offset());
        // A group whose members have not all given it back keeps its region.
        drop(x0);
        assert!(pa.lease(10, &[0, 1], 0, far()).unwrap().is_none());
        drop(x1);
        // Key 10's members follow its first, which found no region free.
        assert!(pb.lease(10, &[0, 1], 1, far()).unwrap().is_none());
        // Freed: a new group gets it, its header written anew.
        let z0 = pa.lease(11, &[0, 1], 0, far()).unwrap().unwrap();
        assert!(z0.aborted().is_none());
        assert_eq!(z0.round(&[2; 56], Shape::Gather).unwrap().late(), None, "no stage arrived at yet");
        drop((y0, z0));
    }

    #[test]
    fn an_aborted_region_starts_over_for_the_next_group() {
        let (a, _b) = host(2, 1);
        let pool = a.pool().unwrap();
        let x = pool.lease(1, &[0], 0, far()).unwrap().unwrap();
        x.abort("gone");
        drop(x);
        let y = pool.lease(2, &[0], 0, far()).unwrap().unwrap();
        assert!(y.aborted().is_none(), "a new group's arena is not aborted");
    }

    #[test]
    fn a_key_leased_for_another_size_is_refused() {
        let (a, _b) = host(4, 2);
        let pool = a.pool().unwrap();
        let _x = pool.lease(5, &[0, 1], 0, far()).unwrap();
        assert!(pool.lease(5, &[0, 1, 2], 0, far()).is_err());
        assert!(pool.lease(6, &[0, 4], 0, far()).is_err(), "a rank the host does not have");
        assert!(pool.lease(6, &[0, 0], 0, far()).is_err(), "a rank twice");
        assert!(pool.lease(6, &[1, 0], 0, far()).is_err(), "as another rank of the host");
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
        assert!(pool.lease(3, &[0, 1], 0, far()).unwrap().is_some());
        assert!(started.elapsed() < Duration::from_millis(500), "{:?}", started.elapsed());
        // And it is an ordinary lock after that.
        assert!(pool.lease(4, &[0, 1], 0, far()).unwrap().is_none(), "the one region is leased");
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
                Entry::store(&e0.members, &ranks_of(&[0, 1]));
                Entry::store(&e0.arrived, &ranks_of(&[1]));
                Entry::store(&e0.returned, &[0; WORDS]);
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
        let err = pool.lease(0xB, &[0, 1], 0, Instant::now() + Duration::from_millis(100)).err().unwrap();
        assert!(err.message.contains(&format!("process {holder} held the lock")), "{}", err.message);
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.lease(0xB, &[0, 1], 0, far()).map(|a| a.map(|a| a.offset())))
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

    /// Groups that find no region free hold an entry only until every
    /// member has found it: before, each kept one for good, and after
    /// ENTRIES of them no group of the host could be made.
    #[test]
    fn entries_of_groups_without_a_region_are_freed_once_every_member_found_them() {
        let (a, b) = host(2, 1);
        let (pa, pb) = (a.pool().unwrap(), b.pool().unwrap());
        let x0 = pa.lease(1, &[0, 1], 0, far()).unwrap().unwrap();
        for key in 2..2 + 3 * ENTRIES as u64 {
            assert!(pa.lease(key, &[0, 1], 0, far()).unwrap().is_none());
            assert!(pb.lease(key, &[0, 1], 1, far()).unwrap().is_none());
        }
        let used = (0..ENTRIES).filter(|&i| pa.entry(i).used.load(Ordering::Relaxed) == 1).count();
        assert_eq!(used, 1, "only the group with the region holds an entry");
        drop(x0);
        drop(pb.lease(1, &[0, 1], 1, far()).unwrap().expect("rank 1 finds key 1's region, kept for it"));
        let used = (0..ENTRIES).filter(|&i| pa.entry(i).used.load(Ordering::Relaxed) == 1).count();
        assert_eq!(used, 0, "given back by both");
    }

    /// Rank 0 far ahead of rank 1: every entry is a group rank 1 has yet to
    /// find. Rank 0's next group waits for rank 1 to come to one (before, it
    /// failed at once), and fails at its deadline if nobody comes.
    #[test]
    fn a_full_table_makes_the_next_group_wait_for_members_still_to_come() {
        let (a, b) = host(2, 1);
        let (pa, pb) = (a.pool().unwrap(), b.pool().unwrap());
        let x0 = pa.lease(0, &[0, 1], 0, far()).unwrap().expect("the one region");
        for key in 1..ENTRIES as u64 {
            assert!(pa.lease(key, &[0, 1], 0, far()).unwrap().is_none());
        }
        let next = ENTRIES as u64;
        let t0 = Instant::now();
        let alone = pa.lease(next, &[0, 1], 0, t0 + Duration::from_millis(100));
        let e = alone.err().expect("nobody came: an error at the deadline");
        assert_eq!(e.kind, crate::error::ErrorKind::Timeout, "{}", e.message);
        assert!(t0.elapsed() >= Duration::from_millis(90) && e.message.contains("did not come"), "{}", e.message);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| pa.lease(next, &[0, 1], 0, far()));
            std::thread::sleep(Duration::from_millis(50));
            assert!(!waiting.is_finished(), "waits while the table is full");
            assert!(pb.lease(1, &[0, 1], 1, far()).unwrap().is_none(), "rank 1 finds key 1, whose entry is freed");
            assert!(waiting.join().unwrap().unwrap().is_none(), "then rank 0's next group has an entry");
        });
        drop(x0);
    }

    /// As rank `slot` of the host in a forked child: hold the slot's lock
    /// (on the child's one thread, as its keeper would) and, with `key`,
    /// lease as member of `members`. Allocates nothing.
    fn as_rank(pool: &ArenaPool, slot: usize, lease: Option<(u64, &Ranks)>) {
        let s = pool.slot_of(slot);
        // SAFETY: the slot's mutex is mapped (shared) in the child too.
        assert_eq!(unsafe { libc::pthread_mutex_trylock(s.alive.get()) }, 0);
        s.claimed.store(1, Ordering::Release);
        if let Some((key, members)) = lease {
            let locked = pool.lock(far()).unwrap();
            pool.take(key, members, slot).unwrap().expect("room in the table");
            drop(locked);
        }
    }

    /// A rank of the host SIGKILLed while in a group (or before it came)
    /// has its part of the lease counted as given back once the pool needs
    /// the room: the region serves the next group while the host's other
    /// ranks go on.
    #[test]
    fn a_dead_members_leases_are_taken_back() {
        let made = Arena::create(3, 4096, 0, 1).unwrap();
        let pool = made.pool().unwrap();
        let two = ranks_of(&[0, 1]);
        // Rank 1 leases key 7 and dies holding it.
        waited(child(|| as_rank(pool, 1, Some((7, &two)))));
        let x = pool.lease(7, &[0, 1], 0, far()).unwrap().expect("the one region");
        drop(x);
        let y = pool.lease(8, &[0, 1], 0, far()).unwrap().expect("taken back from dead rank 1");
        assert_eq!(y.offset(), pool.region_at(0));
        // Rank 1 never comes to key 8 (it is dead): taken back too.
        drop(y);
        let w = pool.lease(9, &[0, 1], 0, far()).unwrap().expect("key 8's region, taken back");
        assert!(pool.lease(10, &[0, 2], 0, far()).unwrap().is_none(), "rank 0 holds key 9's region");
        drop(w);
        assert!(pool.lease(11, &[0, 2], 0, far()).unwrap().is_some(), "key 9's, taken back");
        // Rank 2 never claimed its slot: counted as alive, so key 10's
        // verdict is kept for it to find.
        let kept = (0..ENTRIES).any(|i| {
            let e = pool.entry(i);
            e.used.load(Ordering::Relaxed) == 1 && e.key.load(Ordering::Relaxed) == 10
        });
        assert!(kept);
    }

    /// A member that is stopped (SIGSTOP, a debugger) keeps its lease
    /// however long; killed, it is taken back.
    #[test]
    fn a_stopped_members_lease_is_kept_until_it_dies() {
        let made = Arena::create(2, 4096, 0, 1).unwrap();
        let pool = made.pool().unwrap();
        let two = ranks_of(&[0, 1]);
        let mut fds = [0; 2];
        // SAFETY: pipe writes two descriptors into `fds`, a live local.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let member = child(|| {
            as_rank(pool, 1, Some((7, &two)));
            // SAFETY: writes one byte from a live local, then stops this child.
            unsafe {
                libc::write(fds[1], [1u8].as_ptr().cast(), 1);
                libc::raise(libc::SIGSTOP);
                loop {
                    libc::pause();
                }
            }
        });
        let mut byte = [0u8; 1];
        // SAFETY: reads one byte into a live local from the pipe's read end.
        assert_eq!(unsafe { libc::read(fds[0], byte.as_mut_ptr().cast(), 1) }, 1, "the member leased");
        drop(pool.lease(7, &[0, 1], 0, far()).unwrap().expect("the one region"));
        std::thread::sleep(Duration::from_millis(200));
        assert!(pool.lease(8, &[0, 1], 0, far()).unwrap().is_none(), "a stopped member keeps its region");
        // SAFETY: kills our own child.
        unsafe { libc::kill(member, libc::SIGKILL) };
        waited(member);
        assert!(pool.lease(9, &[0, 1], 0, far()).unwrap().is_some(), "a dead member's region is taken back");
        // SAFETY: closes the pipe's two descriptors, used no more.
        unsafe { (libc::close(fds[0]), libc::close(fds[1])) };
    }

    /// A rank's slot is held for as long as its pool is mapped, and free
    /// once it is dropped; two live processes cannot claim one rank.
    #[test]
    fn a_ranks_slot_is_held_while_its_pool_lives() {
        let (a, b) = host(2, 1);
        let pool = a.pool().unwrap();
        assert_eq!(pool.dead(), [0; WORDS]);
        assert!(Arena::open(a.fd().unwrap(), 1, 2).is_err(), "rank 1 is claimed already");
        drop(b);
        assert_eq!(pool.dead(), ranks_of(&[1]));
    }

    #[test]
    fn a_pool_keeps_to_its_address_space() {
        assert_eq!(ArenaPool::regions_for(4, 1 << 20), REGIONS);
        let big = ArenaPool::regions_for(256, 1 << 20);
        assert!(big < REGIONS && big * ArenaPool::region_bytes(256, 1 << 20).unwrap() <= MAX_BYTES, "{big}");
        assert_eq!(ArenaPool::regions_for(MAX_SLOTS, 1 << 12), REGIONS);
        assert_eq!(ArenaPool::regions_for(MAX_SLOTS + 1, 1 << 12), 0, "a host too large for a pool");
    }

    #[test]
    fn a_pool_that_does_not_add_up_is_refused() {
        let (a, b) = host(2, 2);
        drop(b);
        a.pool().unwrap().header().regions.store(3, Ordering::SeqCst);
        assert!(Arena::open(a.fd().unwrap(), 1, 2).is_err(), "three regions in the room of two");
        a.pool().unwrap().header().regions.store(u64::MAX, Ordering::SeqCst);
        assert!(Arena::open(a.fd().unwrap(), 1, 2).is_err());
        a.pool().unwrap().header().regions.store(2, Ordering::SeqCst);
        assert!(Arena::open(a.fd().unwrap(), 1, 2).unwrap().pool().is_some());
    }
}
