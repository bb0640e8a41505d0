//! The shared arena of ranks that share a host (a whole group's, or one
//! host's ranks' in a group on several): one sealed memfd that each of them
//! maps, made by the lowest of them and handed to the others over their
//! shared-memory connections with it, after the token handshake, as the
//! rings are. It holds, for each rank, two slots of bytes
//! and a control line, and for the group a count of its sleeping waiters and
//! the reason it was aborted, if it was.
//!
//! Ranks use it in rounds, each round in the other of a rank's two slots
//! (and tags) than the round before. A round has one or more stages; a
//! stage is a barrier: a rank arrives once it has written what the others
//! will read, then waits until every rank has arrived. Since no rank starts
//! round k + 1 before every rank arrived at round k's first stage, which
//! each does only after it finished round k - 1, a rank may fill its slot of
//! round k + 1 while the others still read its slot of round k, and never
//! the one of round k - 1: double buffering instead of a second barrier.
//!
//! A rank arrives by storing its count of stages in its own line (one line
//! per parity, beside that round's tag), and waits by reading the other
//! ranks' lines: each line has one writer, so arriving is a plain store and
//! a line moves between cores once per stage and reader, however many ranks
//! arrive at once (a count that every rank adds to is one line that every
//! arrival takes from every reader, which on a many-core host costs more
//! than the op). A rank that is not the last to arrive polls for `spin` (at
//! first without yielding the core, unless the arena's ranks outnumber the
//! cores), then sleeps on a futex that an arrival which completes the stage
//! wakes if anyone sleeps. A rank that loses a peer, fails an op or shuts the
//! group down aborts the arena: every rank waiting in it wakes and fails
//! with the reason, and so does every later round. A rank that never
//! arrives leaves the others waiting until their deadline, and then they
//! know whom they waited for.
//!
//! It knows nothing of collectives: algorithms write tags (what each rank
//! was called to do, compared once the first stage is passed) and bytes.
//!
//! Other processes write this memory while this one reads it, so every
//! field of the header and the lines is an atomic: a peer that breaks the
//! protocol (a bug, a crash half-way through a write) leaves wrong values,
//! never a data race, and every value read here is checked before it is
//! used as a length or an index. The slots are the data path and are
//! plain bytes: see `Round::slot` for what makes touching them sound.

// The header, the lines and the slots are memory other processes write:
// every unsafe block says why its access is in bounds and race-free.
#![deny(clippy::undocumented_unsafe_blocks)]

use crate::error::{Error, Result};
use crate::locks::{level, Mutex, MutexGuard};
use crate::status::Cost;
use crate::transport::group::arena_pool::{ArenaPool, Lease};
use crate::transport::links::shared_mem::{sealed_len, sealed_memfd, Mapping};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Every slot starts at a multiple of this many bytes (the header and the
/// lines are whole pages, the slots a multiple of it long): algorithms may
/// keep u64 there.
pub const SLOT_ALIGN: usize = 8;
/// Bytes of the tag a rank writes for each round (it shares a cache line
/// with the rank's count of stages).
pub const TAG_BYTES: usize = 56;
/// The tag is kept as this many words (atomics: other ranks read it).
const TAG_WORDS: usize = TAG_BYTES / 8;
const _: () = assert!(TAG_BYTES.is_multiple_of(8));

const MAGIC: u64 = 0x5243_3130_4152_4e32; // "RC10ARN2": lines of one writer each
const HEADER_BYTES: usize = 4096;
const LINE_BYTES: usize = 256;
const REASON_MAX: usize = 2048;
/// A sleeping waiter looks at the clock at least this often.
const TICK: Duration = Duration::from_secs(1);
/// A busy waiter's polls of the arrivals between two looks at the clock.
const POLLS: u32 = 64;

/// Aborted: not yet, the reason being written, written.
const OPEN: u32 = 0;
const WRITING: u32 = 1;
const ABORTED: u32 = 2;

/// Bytes that keep fields on cache lines of their own. Never read or
/// written here; atomics all the same, so that a `&Header` or `&Line` claims
/// nothing about memory that other processes may write.
type Pad<const N: usize> = [AtomicU8; N];

#[repr(C)]
struct Header {
    magic: AtomicU64,
    world: AtomicU64,
    slot_bytes: AtomicU64,
    _p0: Pad<{ 64 - 24 }>,
    /// The futex word sleepers wait on: bumped by an arrival that completes
    /// a stage while anyone sleeps, and by an abort.
    wake: AtomicU32,
    _p1: Pad<{ 64 - 4 }>,
    /// Ranks asleep waiting for a stage.
    sleepers: AtomicU32,
    aborted: AtomicU32,
    /// Who aborted, and the length of the reason that follows: written
    /// before `aborted` becomes ABORTED, read after it is.
    aborted_by: AtomicU32,
    reason_len: AtomicU32,
    _p2: Pad<{ 64 - 16 }>,
    reason: [AtomicU8; REASON_MAX],
}

/// A rank's control line: one cache line for each parity of round.
#[repr(C)]
struct Line {
    stamps: [Stamp; 2],
}

/// What a rank wrote in its rounds of one parity: one cache line, written
/// by that rank alone, which every waiter reads.
#[repr(C, align(64))]
struct Stamp {
    /// The stages this rank has arrived at (wrapping), as of its last
    /// arrival in a round of this parity.
    arrived: AtomicU32,
    _p: AtomicU32,
    /// The tag of the round, in native byte order. Written (Relaxed) before
    /// the round's first stage, read (Relaxed) after it: the stage's arrival
    /// (a store of `arrived`) and wait (loads of it) order them.
    tag: [AtomicU64; TAG_WORDS],
}

impl Stamp {
    fn set_tag(&self, tag: &[u8; TAG_BYTES]) {
        for (word, bytes) in self.tag.iter().zip(tag.chunks_exact(8)) {
            word.store(u64::from_ne_bytes(bytes.try_into().unwrap()), Ordering::Relaxed);
        }
    }

    fn tag(&self) -> [u8; TAG_BYTES] {
        let mut tag = [0u8; TAG_BYTES];
        for (bytes, word) in tag.chunks_exact_mut(8).zip(&self.tag) {
            bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes());
        }
        tag
    }
}

const _: () = assert!(std::mem::size_of::<Stamp>() == 64);

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);
const _: () = assert!(std::mem::size_of::<Line>() <= LINE_BYTES);
// The mapping starts on a page: a line at any multiple of LINE_BYTES after
// the header is aligned for its atomics.
const _: () = assert!(HEADER_BYTES.is_multiple_of(std::mem::align_of::<Line>()));
const _: () = assert!(LINE_BYTES.is_multiple_of(std::mem::align_of::<Line>()));
const _: () = assert!(std::mem::align_of::<Header>() <= 4096);

/// Why a stage did not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stuck {
    /// The deadline passed; these ranks had not arrived.
    TimedOut { missing: Vec<usize> },
    /// Rank `by` aborted the arena, for `reason`.
    Aborted { by: usize, reason: String },
}

/// One rank's view of its group's arena.
pub struct Arena {
    map: Arc<Mapping>,
    /// Where in the mapping the arena starts (a page): 0, or its region of a pool.
    offset: usize,
    rank: usize,
    world: usize,
    slot_bytes: usize,
    /// More ranks share the arena than this process may run on cores at
    /// once: a waiter that polls without yielding may hold the core of the
    /// rank it waits for.
    crowded: bool,
    local: Mutex<level::ArenaLocal, Local>,
    /// The descriptor, kept by the rank that hands it out.
    fd: Option<OwnedFd>,
    /// The pool of arenas that follows a host's arena in its memory, for
    /// groups of its ranks to lease (arena_pool.rs).
    pool: Option<Arc<ArenaPool>>,
    /// The region of a pool this arena is, given back when it is dropped.
    _lease: Option<Lease>,
}

/// What only this rank counts.
#[derive(Default)]
struct Local {
    stages: u32,
    rounds: u64,
}

impl Arena {
    pub(in crate::transport) fn bytes_for(world: usize, slot_bytes: usize) -> Option<usize> {
        let lines = (world * LINE_BYTES).div_ceil(4096) * 4096;
        world.checked_mul(2)?.checked_mul(slot_bytes)?.checked_add(HEADER_BYTES + lines)
    }

    /// Where a pool starts after an arena of `world` with slots of
    /// `slot_bytes` (the next page).
    fn pool_offset(world: usize, slot_bytes: usize) -> Option<usize> {
        Self::bytes_for(world, slot_bytes)?.checked_next_multiple_of(4096)
    }

    /// A new arena for `world` ranks with slots of `slot_bytes`, as `rank`
    /// sees it, followed by a pool of `pool_regions` arenas for groups of
    /// up to `world` of its ranks (none: 0); it keeps the descriptor to
    /// hand out (`fd`).
    pub fn create(world: usize, slot_bytes: usize, rank: usize, pool_regions: usize) -> Result<Arena> {
        assert!(slot_bytes.is_multiple_of(SLOT_ALIGN), "slots of {slot_bytes} bytes");
        let too_large = || Error::invalid("rustc10d: arena too large");
        let mut len = Self::bytes_for(world, slot_bytes).ok_or_else(too_large)?;
        let at = Self::pool_offset(world, slot_bytes).ok_or_else(too_large)?;
        if pool_regions > 0 {
            let pool = ArenaPool::bytes_for(world, slot_bytes, pool_regions);
            len = pool.and_then(|p| at.checked_add(p)).ok_or_else(too_large)?;
        }
        let fd = sealed_memfd(len)?;
        let map = Arc::new(Mapping::of(fd.as_raw_fd(), len)?);
        Self::init(&map, 0, world, slot_bytes);
        let pool = (pool_regions > 0)
            .then(|| ArenaPool::init(map.clone(), at, world, slot_bytes, pool_regions, rank).map(Arc::new))
            .transpose()?;
        Ok(Arena { fd: Some(fd), pool, ..Arena::view(map, 0, rank, world, slot_bytes) })
    }

    /// Map the arena a peer sent, after checking it is one, made for `world`
    /// ranks (with the pool that follows it, if one does).
    pub fn open(fd: &OwnedFd, rank: usize, world: usize) -> Result<Arena> {
        let len = sealed_len(fd, "shared arena")?;
        let malformed = || Error::io("rustc10d: malformed shared arena from a peer");
        if len < HEADER_BYTES {
            return Err(malformed());
        }
        let map = Arc::new(Mapping::of(fd.as_raw_fd(), len)?);
        let h = header_at(&map, 0);
        let (magic, theirs, slot_bytes) = (
            h.magic.load(Ordering::Acquire),
            h.world.load(Ordering::Relaxed) as usize,
            h.slot_bytes.load(Ordering::Relaxed) as usize,
        );
        // Slots of another size than SLOT_ALIGN's multiples (none is made) would be misaligned.
        let aligned = slot_bytes.is_multiple_of(SLOT_ALIGN);
        let own = Self::bytes_for(world, slot_bytes).filter(|&own| own <= len);
        if magic != MAGIC || theirs != world || !aligned || own.is_none() {
            return Err(malformed());
        }
        let pool = match Self::pool_offset(world, slot_bytes) {
            _ if own == Some(len) => None,
            Some(at) if at < len => Some(Arc::new(ArenaPool::open(map.clone(), at, world, slot_bytes, rank)?)),
            _ => return Err(malformed()),
        };
        Ok(Arena { pool, ..Arena::view(map, 0, rank, world, slot_bytes) })
    }

    /// The views of every rank of an arena in this process's memory (tests:
    /// threads as ranks).
    pub fn in_memory(world: usize, slot_bytes: usize) -> Result<Vec<Arena>> {
        assert!(slot_bytes.is_multiple_of(SLOT_ALIGN), "slots of {slot_bytes} bytes");
        let len = Self::bytes_for(world, slot_bytes).ok_or_else(|| Error::invalid("rustc10d: arena too large"))?;
        let map = Arc::new(Mapping::anonymous(len)?);
        Self::init(&map, 0, world, slot_bytes);
        Ok((0..world).map(|rank| Arena::view(map.clone(), 0, rank, world, slot_bytes)).collect())
    }

    /// Write the header of an arena at `offset` of `map`. A pool's region is
    /// used again: every field of its header and its first `world` lines
    /// starts over (its slots need not: every round writes before it reads).
    pub(in crate::transport) fn init(map: &Mapping, offset: usize, world: usize, slot_bytes: usize) {
        let h = header_at(map, offset);
        for word in [&h.wake, &h.sleepers, &h.aborted, &h.aborted_by, &h.reason_len] {
            word.store(0, Ordering::Relaxed);
        }
        for rank in 0..world {
            for stamp in &line_at(map, offset, world, rank).stamps {
                stamp.arrived.store(0, Ordering::Relaxed);
                stamp.set_tag(&[0; TAG_BYTES]);
            }
        }
        h.world.store(world as u64, Ordering::Relaxed);
        h.slot_bytes.store(slot_bytes as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
    }

    /// Rank `rank`'s view of the arena of `world` at `offset` of `map`, which
    /// `init` wrote.
    pub(in crate::transport) fn view(
        map: Arc<Mapping>,
        offset: usize,
        rank: usize,
        world: usize,
        slot_bytes: usize,
    ) -> Arena {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let crowded = world > cores;
        Arena {
            map,
            offset,
            rank,
            world,
            slot_bytes,
            crowded,
            local: Mutex::default(),
            fd: None,
            pool: None,
            _lease: None,
        }
    }

    /// This view, holding `lease` until it is dropped.
    pub(in crate::transport) fn leased(self, lease: Lease) -> Arena {
        Arena { _lease: Some(lease), ..self }
    }

    /// Where the arena starts in its mapping (tests: which region of a pool).
    #[cfg(test)]
    pub(in crate::transport) fn offset(&self) -> usize {
        self.offset
    }

    /// The pool of arenas that follows this host's arena, if one does.
    pub(in crate::transport) fn pool(&self) -> Option<&Arc<ArenaPool>> {
        self.pool.as_ref()
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The bytes of each slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The descriptor to hand to the group's other ranks (on the rank that made it).
    pub fn fd(&self) -> Option<&OwnedFd> {
        self.fd.as_ref()
    }

    /// Close the descriptor once every rank has the arena: the mapping stays.
    pub fn close_fd(&mut self) {
        self.fd = None;
    }

    fn header(&self) -> &Header {
        header_at(&self.map, self.offset)
    }

    /// The control line of `rank` (< world).
    fn line(&self, rank: usize) -> &Line {
        line_at(&self.map, self.offset, self.world, rank)
    }

    /// What `rank` wrote in its rounds of `parity`.
    fn stamp(&self, rank: usize, parity: usize) -> &Stamp {
        &self.line(rank).stamps[parity]
    }

    /// The first byte of the slot of `rank` (< world) of `parity` (< 2).
    fn slot_ptr(&self, rank: usize, parity: usize) -> *mut u8 {
        assert!(rank < self.world && parity < 2, "slot {parity} of rank {rank} of an arena of {}", self.world);
        let lines = (self.world * LINE_BYTES).div_ceil(4096) * 4096;
        let at = self.offset + HEADER_BYTES + lines + (rank * 2 + parity) * self.slot_bytes;
        assert!(at + self.slot_bytes <= self.map.len);
        // SAFETY: the arena at `offset` is `bytes_for(world, slot_bytes)`
        // long (made so, or checked in `open` and `ArenaPool::open`): the
        // header, the lines rounded up to pages, then 2 * world slots, so
        // this slot (2 rank + parity) and the slot_bytes after it are inside
        // the one mapping `self.map` keeps alive (asserted above too).
        unsafe { self.map.base.add(at) }
    }

    /// Start this rank's next round, with what it was called to do (`tag`),
    /// its slots touched as `shape` says.
    /// Fails at once if the arena was aborted.
    pub fn round(&self, tag: &[u8; TAG_BYTES], shape: Shape) -> std::result::Result<Round<'_>, Stuck> {
        if let Some(stuck) = self.aborted() {
            return Err(stuck);
        }
        let mut local = self.local.lock().unwrap();
        let parity = (local.rounds % 2) as usize;
        local.rounds += 1;
        // Nobody reads this tag any more: everyone has finished the round before last.
        self.stamp(self.rank, parity).set_tag(tag);
        Ok(Round { arena: self, local, parity, shape, stages: 0, passed: 0, from: 0 })
    }

    /// Wake every rank waiting in the arena and fail every later round,
    /// with `reason` (the first abort's reason stays).
    pub fn abort(&self, reason: &str) {
        let h = self.header();
        if h.aborted.compare_exchange(OPEN, WRITING, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            let bytes = &reason.as_bytes()[..reason.len().min(REASON_MAX)];
            for (cell, &b) in h.reason.iter().zip(bytes) {
                cell.store(b, Ordering::Relaxed);
            }
            // Published by the SeqCst (so Release) store of ABORTED below.
            h.reason_len.store(bytes.len() as u32, Ordering::Relaxed);
            h.aborted_by.store(self.rank as u32, Ordering::Relaxed);
            h.aborted.store(ABORTED, Ordering::SeqCst);
        }
        h.wake.fetch_add(1, Ordering::SeqCst);
        futex_wake(&h.wake);
    }

    /// Who aborted the arena and why, once it is.
    pub fn aborted(&self) -> Option<Stuck> {
        let h = self.header();
        let mut state = h.aborted.load(Ordering::SeqCst);
        if state == WRITING {
            // The first aborter is writing its reason: a moment.
            let until = Instant::now() + Duration::from_millis(100);
            while state == WRITING && Instant::now() < until {
                std::thread::yield_now();
                state = h.aborted.load(Ordering::SeqCst);
            }
        }
        match state {
            OPEN => None,
            ABORTED => {
                // Written by whichever process aborted: the length is bounded
                // here, the bytes may be anything (lossy), and `by` may name
                // no rank at all (users check it before naming a peer).
                let len = (h.reason_len.load(Ordering::Relaxed) as usize).min(REASON_MAX);
                let bytes: Vec<u8> = h.reason[..len].iter().map(|b| b.load(Ordering::Relaxed)).collect();
                let reason = String::from_utf8_lossy(&bytes).into_owned();
                Some(Stuck::Aborted { by: h.aborted_by.load(Ordering::Relaxed) as usize, reason })
            }
            _ => Some(Stuck::Aborted { by: usize::MAX, reason: "(no reason given in time)".into() }),
        }
    }
}

/// The header of the arena at `offset` (a page) of `map`.
fn header_at(map: &Mapping, offset: usize) -> &Header {
    assert!(offset.is_multiple_of(4096) && offset + HEADER_BYTES <= map.len);
    // SAFETY: the header is at a page of the mapping (aligned for Header),
    // and HEADER_BYTES >= size_of::<Header>() bytes from there are mapped
    // (asserted), as long as `map` is borrowed. Every field of Header is an
    // atomic, valid as zeroes (a new memfd or anonymous mapping), so this
    // reference may alias other processes' writes.
    unsafe { &*(map.base.add(offset) as *const Header) }
}

/// The control line of `rank` (< world) of the arena of `world` at `offset` of `map`.
fn line_at(map: &Mapping, offset: usize, world: usize, rank: usize) -> &Line {
    assert!(rank < world, "rank {rank} of an arena of {world}");
    let at = offset + HEADER_BYTES + rank * LINE_BYTES;
    assert!(at + LINE_BYTES <= map.len);
    // SAFETY: the line is inside the mapping (asserted), which `map` keeps
    // alive as long as the borrow, and aligned (a page plus multiples of
    // LINE_BYTES: the const assertions above). Every field of a Line is an
    // atomic, valid as zeroes (a memfd starts zeroed), so sharing it with
    // other processes' writes is sound.
    unsafe { &*(map.base.add(at) as *const Line) }
}

/// Who touches which slot of a round, and when: the discipline that makes
/// the round's slices (`Round::own`, `others_mut`, `columns`, `slot`)
/// sound. Every rank of a round takes the same shape for it (the same
/// algorithm, which the round's tag says: a rank called otherwise fails at
/// the first stage, having only written its own slots).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Before the first stage each rank writes its own slot (`own`); after
    /// it, every slot is only read (`slot`).
    Gather,
    /// Before the first stage `root` writes every other rank's slot
    /// (`others_mut`) and no rank its own; after it, every slot is only read.
    Scatter { root: usize },
    /// As `Gather`, with a second stage: between the two, rank p writes
    /// column p of its own slot and reads column p of the others' (`columns`),
    /// where the first `len` bytes, `elem`-byte elements, are cut into one
    /// column per rank (`column`); after the second, every slot is only read.
    Columns { len: usize, elem: usize },
}

impl Shape {
    /// The stages after which the slots are only read.
    fn writes(&self) -> u32 {
        match self {
            Shape::Columns { .. } => 2,
            _ => 1,
        }
    }
}

/// Column `p` of `len` bytes of `elem`-byte elements cut into one per rank
/// of `world` (whole elements; sizes differ by one element at most): its
/// byte range.
pub fn column(len: usize, elem: usize, world: usize, p: usize) -> std::ops::Range<usize> {
    let m = len / elem;
    p * m / world * elem..(p + 1) * m / world * elem
}

/// One round of this rank in the arena; no other round starts until it ends.
pub struct Round<'a> {
    arena: &'a Arena,
    local: MutexGuard<'a, level::ArenaLocal, Local>,
    parity: usize,
    shape: Shape,
    /// The stages this rank has arrived at in this round.
    stages: u32,
    /// The stages that have passed (every rank arrived), as this rank saw.
    passed: u32,
    /// The ranks below this one had arrived at the stage waited for.
    from: usize,
}

impl<'a> Round<'a> {
    /// This round's slot of `rank` (< world; `Arena::slot_bytes` long).
    ///
    /// The slices the methods below make of it are sound under the round's
    /// `Shape`, which they check: between two stages a slot (or a column of
    /// it) is written by one rank and touched by no other, or read by any
    /// and written by none; a stage's Release arrival and Acquire wait order
    /// the writes before the reads, and double buffering keeps the next
    /// round's writes off this round's slots. A slice borrows the `Round`,
    /// which arriving at the next stage takes mutably: none outlives the
    /// stage that ends its access. The bytes are plain data that other
    /// processes write: nothing read from them is trusted as a length, an
    /// index or a pointer, so a peer that breaks the protocol (writes out of
    /// turn) can make the results wrong, but cannot make this process touch
    /// memory outside its mappings.
    fn slot_ptr(&self, rank: usize) -> *mut u8 {
        self.arena.slot_ptr(rank, self.parity)
    }

    /// The whole slot of `rank` as a slice, for `'r`.
    ///
    /// # Safety
    /// The round's shape gives this rank the access asked for (`mutable`:
    /// writing) to that slot for as long as `'r`, and no other slice of this
    /// process covers it meanwhile.
    unsafe fn slice<'r>(&self, rank: usize) -> &'r mut [u8] {
        // SAFETY: the slot is `slot_bytes` long inside the mapping, which the
        // arena keeps alive as long as it (`slot_ptr`); access as the caller says.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(rank), self.arena.slot_bytes) }
    }

    /// This rank's own slot, to write before the first stage (`Gather`, `Columns`).
    pub fn own(&mut self) -> &mut [u8] {
        assert!(self.stages == 0 && !matches!(self.shape, Shape::Scatter { .. }), "{:?}: own slot", self.shape);
        // SAFETY: before this rank's first arrival no rank reads its slot, and
        // in these shapes no other writes it; the slice borrows the round mutably.
        unsafe { self.slice(self.arena.rank) }
    }

    /// Every other rank's slot (None at this rank), to write before the first
    /// stage, at the root of a `Scatter`.
    pub fn others_mut(&mut self) -> Vec<Option<&mut [u8]>> {
        let me = self.arena.rank;
        assert!(self.stages == 0 && self.shape == Shape::Scatter { root: me }, "{:?}: others' slots", self.shape);
        // SAFETY: before the root's first arrival no rank reads any slot, and
        // the root alone writes them (not its own); the slices are of different
        // slots and borrow the round mutably.
        (0..self.arena.world).map(|p| (p != me).then(|| unsafe { self.slice(p) })).collect()
    }

    /// Between a `Columns` round's two stages: this rank's column of its own
    /// slot, to write, and the others' slots' columns of this rank, to read
    /// (empty at this rank).
    pub fn columns(&mut self) -> (&mut [u8], Vec<&[u8]>) {
        let Shape::Columns { len, elem } = self.shape else { panic!("{:?}: columns", self.shape) };
        assert!(self.stages == 1 && self.passed == 1, "columns between the first stage and the second");
        let (me, world) = (self.arena.rank, self.arena.world);
        assert!(len <= self.arena.slot_bytes, "{len} bytes of a slot of {}", self.arena.slot_bytes);
        let range = column(len, elem.max(1), world, me);
        // SAFETY: between the stages rank p writes column p of its own slot
        // alone, and reads column p of the others' (the shape): this rank's
        // column of its slot is its own to write, the same column of every
        // other slot only read; the slices borrow the round mutably.
        let mine = unsafe { &mut self.slice(me)[range.clone()] };
        let theirs = (0..world)
            .map(|p| match p == me {
                true => &[][..],
                // SAFETY: see above: column `me` of another rank's slot.
                false => unsafe { &self.slice(p)[range.clone()] },
            })
            .collect();
        (mine, theirs)
    }

    /// The slot of `rank`, to read once every write stage of the round has passed.
    pub fn slot(&self, rank: usize) -> &[u8] {
        assert!(self.passed >= self.shape.writes(), "{:?}: reading a slot at stage {}", self.shape, self.passed);
        // SAFETY: after the round's last write stage every slot is only read,
        // until every rank has arrived at the next round's first stage, which
        // this rank does only after this round (borrowed by the slice) ends.
        unsafe { self.slice(rank) }
    }

    /// The bytes of each slot.
    pub fn slot_bytes(&self) -> usize {
        self.arena.slot_bytes
    }

    /// The tag `rank` wrote for this round (after the first stage: its own for this round).
    pub fn tag(&self, rank: usize) -> [u8; TAG_BYTES] {
        self.arena.stamp(rank, self.parity).tag()
    }

    /// Whether `rank` has arrived at the stage this rank last arrived at.
    /// SeqCst, not just Acquire: `arrive` and `wait` rely on these loads
    /// being in the one total order with the arrivals and the sleepers'
    /// count (on x86 it is the same plain load).
    fn has_arrived(&self, rank: usize) -> bool {
        let theirs = self.arena.stamp(rank, self.parity).arrived.load(Ordering::SeqCst);
        theirs.wrapping_sub(self.local.stages) as i32 >= 0
    }

    /// A rank, other than this one, that has not yet arrived at the stage
    /// this one last arrived at (the lowest), if any: whom it waits for.
    pub fn late(&self) -> Option<usize> {
        (0..self.arena.world).find(|&r| r != self.arena.rank && !self.has_arrived(r))
    }

    /// Arrive, then wait until every rank has arrived at this stage (`arrive`,
    /// then `wait`).
    pub fn stage(&mut self, deadline: Instant, spin: Duration, cost: &Cost) -> std::result::Result<(), Stuck> {
        if self.arrive() {
            return Ok(());
        }
        self.wait(deadline, spin, cost)
    }

    /// Arrive at this round's next stage: whether every rank has now arrived
    /// (this one last, having woken any that sleep).
    pub fn arrive(&mut self) -> bool {
        let a = self.arena;
        self.stages += 1;
        let mine = self.local.stages.wrapping_add(1);
        self.local.stages = mine;
        self.from = 0;
        // SeqCst, as the loads in `passed` and of `sleepers`, and the sleeper's
        // count and loads in `wait`: of the arrivals that complete a stage, the
        // last in that order sees every other one, and either sees the sleeper
        // counted or the sleeper, counted after it, sees the stage passed.
        a.stamp(a.rank, self.parity).arrived.store(mine, Ordering::SeqCst);
        if !self.passed() {
            return false;
        }
        self.passed = self.stages;
        let h = a.header();
        if h.sleepers.load(Ordering::SeqCst) > 0 {
            h.wake.fetch_add(1, Ordering::SeqCst);
            futex_wake(&h.wake);
        }
        true
    }

    /// Whether every rank has arrived at the stage this rank last arrived
    /// at; the ranks seen there are not read again for it.
    fn passed(&mut self) -> bool {
        let world = self.arena.world;
        while self.from < world && (self.from == self.arena.rank || self.has_arrived(self.from)) {
            self.from += 1;
        }
        self.from == world
    }

    /// After `arrive`: poll for up to `busy`, `POLLS` polls at a time, with
    /// a look at the clock and the abort in between, and, if the arena's
    /// ranks outnumber the cores, a yield of the core (which the rank waited
    /// for may need): whether the stage passed (`None`: not yet). `busy`
    /// counts from the first look at the clock, after the first polls: a
    /// stage that passes in those reads no clock.
    pub fn wait_busy(&mut self, busy: Duration) -> Option<std::result::Result<(), Stuck>> {
        if busy.is_zero() {
            return None;
        }
        let mut until = None;
        loop {
            if self.poll_a_while() {
                self.passed = self.stages;
                return Some(Ok(()));
            }
            if let Some(stuck) = self.aborted_before_passing() {
                return Some(Err(stuck));
            }
            let now = Instant::now();
            if now >= *until.get_or_insert(now + busy) {
                return None;
            }
            if self.arena.crowded {
                std::thread::yield_now();
            }
        }
    }

    /// The arena's abort, if it was aborted before this stage passed. A
    /// rank that passed the stage may finish its op and abort the arena
    /// (its group destroyed at once) between this rank's last look at the
    /// stage and its look at the abort: the stage is looked at once more,
    /// after the abort was seen, and an abort that came after the stage
    /// passed fails nothing of it (it fails the next round). SeqCst loads:
    /// the aborter arrived before it aborted, so once the abort is seen
    /// its arrival is too.
    fn aborted_before_passing(&mut self) -> Option<Stuck> {
        let stuck = self.arena.aborted()?;
        (!self.passed()).then_some(stuck)
    }

    /// `POLLS` polls without yielding the core: whether the stage passed.
    /// A yield is a system call, which costs far more than a poll on some
    /// hosts (a sandboxed kernel): a waiter yields only between these.
    fn poll_a_while(&mut self) -> bool {
        for _ in 0..POLLS {
            if self.passed() {
                return true;
            }
            std::hint::spin_loop();
        }
        false
    }

    /// After `arrive`: wait until every rank has arrived at this stage: poll
    /// for `spin` (yielding the core between `POLLS` polls), then sleep (each
    /// sleep charged to `cost`), until `deadline`.
    pub fn wait(&mut self, deadline: Instant, spin: Duration, cost: &Cost) -> std::result::Result<(), Stuck> {
        let a = self.arena;
        let h = a.header();
        let spin_until = Instant::now() + spin;
        loop {
            if self.poll_a_while() {
                self.passed = self.stages;
                return Ok(());
            }
            if let Some(stuck) = self.aborted_before_passing() {
                return Err(stuck);
            }
            if Instant::now() >= spin_until.min(deadline) {
                break;
            }
            std::thread::yield_now();
        }
        loop {
            h.sleepers.fetch_add(1, Ordering::SeqCst);
            let seen = h.wake.load(Ordering::SeqCst);
            let passed = self.passed();
            let aborted = a.aborted();
            let now = Instant::now();
            let asleep = !passed && aborted.is_none() && now < deadline;
            if asleep && futex_wait(&h.wake, seen, (deadline - now).min(TICK)) {
                cost.slept();
            }
            h.sleepers.fetch_sub(1, Ordering::SeqCst);
            if self.passed() {
                self.passed = self.stages;
                return Ok(());
            }
            if let Some(stuck) = self.aborted_before_passing() {
                return Err(stuck);
            }
            if Instant::now() >= deadline {
                let missing = (0..a.world).filter(|&r| !self.has_arrived(r)).collect();
                return Err(Stuck::TimedOut { missing });
            }
        }
    }
}

impl Drop for Round<'_> {
    fn drop(&mut self) {
        // A round that never arrived anywhere leaves this rank a round out of
        // step with the others: nothing may use the arena after it.
        if self.stages == 0 {
            self.arena.abort(&format!("rank {} left a round of the shared arena unused", self.arena.rank));
        }
    }
}

/// Sleep while `word` holds `seen`, up to `timeout`; whether this thread slept
/// (not if the word had changed already).
fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) -> bool {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // Not FUTEX_PRIVATE: the word is shared between processes. EAGAIN (it
    // changed), EINTR and ETIMEDOUT all return to the caller's checks.
    // SAFETY: FUTEX_WAIT reads the aligned u32 at `word` atomically (the
    // borrow keeps it mapped for the call) and the timespec, a local that
    // outlives the call; it writes nothing of ours.
    let rc =
        unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, seen, &ts as *const libc::timespec) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EAGAIN)
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as the key of its waiters;
    // the borrow keeps it mapped for the call.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(x: u8) -> [u8; TAG_BYTES] {
        [x; TAG_BYTES]
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    /// Every rank writes its rank and round into its slot, then reads every
    /// other's after the stage: what it reads is always that round's.
    #[test]
    fn rounds_alternate_slots_and_stages_order_writes_before_reads() {
        for spin in [Duration::ZERO, Duration::from_micros(50)] {
            let world = 4;
            let arenas = Arena::in_memory(world, 4096).unwrap();
            let costs: Vec<Cost> = (0..world).map(|_| Cost::default()).collect();
            std::thread::scope(|s| {
                for (a, cost) in arenas.iter().zip(&costs) {
                    s.spawn(move || {
                        for round in 0..500u32 {
                            let mut r = a.round(&tag(round as u8), Shape::Gather).unwrap();
                            r.own()[..4].copy_from_slice(&(a.rank() as u32 ^ round << 8).to_le_bytes());
                            r.stage(far(), spin, cost).unwrap();
                            for peer in 0..world {
                                assert_eq!(r.tag(peer), tag(round as u8));
                                let got = u32::from_le_bytes(r.slot(peer)[..4].try_into().unwrap());
                                assert_eq!(got, peer as u32 ^ round << 8, "rank {} round {round}", a.rank());
                            }
                        }
                    });
                }
            });
            // Without polling every wait sleeps at least once, but only the last arrival wakes anyone.
            let woken: u64 = costs.iter().map(|c| c.totals().wakeups).sum();
            assert!(woken <= (world as u64 - 1) * 500 * 2, "{woken} wake-ups");
        }
    }

    /// A round of `Columns`: every rank fills its slot, reduces its column of
    /// every slot into its own, and after the second stage reads every slot:
    /// each sees the whole sum, whatever the columns' sizes.
    #[test]
    fn a_columns_round_has_each_column_reduced_by_one_rank() {
        let world = 3;
        let arenas = Arena::in_memory(world, 64).unwrap();
        for len in [0, 4, 40, 64] {
            let shape = Shape::Columns { len, elem: 4 };
            std::thread::scope(|s| {
                for a in &arenas {
                    s.spawn(move || {
                        let mut r = a.round(&tag(1), shape).unwrap();
                        for (i, b) in r.own()[..len].iter_mut().enumerate() {
                            *b = (a.rank() * 10 + i) as u8;
                        }
                        r.stage(far(), Duration::ZERO, &Cost::default()).unwrap();
                        let (mine, theirs) = r.columns();
                        assert_eq!(theirs[a.rank()].len(), 0);
                        for t in theirs {
                            assert!(t.is_empty() || t.len() == mine.len());
                            for (m, v) in mine.iter_mut().zip(t) {
                                *m += v;
                            }
                        }
                        r.stage(far(), Duration::ZERO, &Cost::default()).unwrap();
                        for p in 0..world {
                            let cut = column(len, 4, world, p);
                            for (i, &b) in r.slot(p)[cut.clone()].iter().enumerate() {
                                assert_eq!(b as usize, 30 + 3 * (cut.start + i), "len {len}, column {p}");
                            }
                        }
                    });
                }
            });
        }
    }

    /// The columns cover the bytes once, in whole elements.
    #[test]
    fn columns_cut_whole_elements_in_order() {
        for (len, elem, world) in [(0, 4, 3), (40, 4, 3), (44, 4, 4), (6, 2, 5), (64, 8, 1)] {
            let cuts: Vec<_> = (0..world).map(|p| column(len, elem, world, p)).collect();
            assert_eq!(cuts[0].start, 0);
            assert_eq!(cuts[world - 1].end, len / elem * elem);
            for w in cuts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            assert!(cuts.iter().all(|c| c.start % elem == 0 && c.len() % elem == 0));
        }
    }

    #[test]
    #[should_panic(expected = "reading a slot at stage 0")]
    fn a_slot_is_not_read_before_its_stage() {
        let arenas = Arena::in_memory(1, 64).unwrap();
        let r = arenas[0].round(&tag(0), Shape::Gather).unwrap();
        let _ = r.slot(0);
    }

    #[test]
    #[should_panic(expected = "own slot")]
    fn an_own_slot_is_not_written_after_the_first_stage() {
        let arenas = Arena::in_memory(1, 64).unwrap();
        let mut r = arenas[0].round(&tag(0), Shape::Gather).unwrap();
        r.stage(far(), Duration::ZERO, &Cost::default()).unwrap();
        r.own()[0] = 1;
    }

    #[test]
    #[should_panic(expected = "reading a slot at stage 1")]
    fn a_columns_round_is_not_read_whole_between_its_stages() {
        let arenas = Arena::in_memory(1, 64).unwrap();
        let mut r = arenas[0].round(&tag(0), Shape::Columns { len: 64, elem: 4 }).unwrap();
        r.stage(far(), Duration::ZERO, &Cost::default()).unwrap();
        let _ = r.slot(0);
    }

    #[test]
    #[should_panic(expected = "others' slots")]
    fn only_a_scatters_root_writes_the_others_slots() {
        let arenas = Arena::in_memory(2, 64).unwrap();
        let mut r = arenas[0].round(&tag(0), Shape::Scatter { root: 1 }).unwrap();
        let _ = r.others_mut();
    }

    #[test]
    fn a_scatters_root_writes_every_slot_but_its_own() {
        let arenas = Arena::in_memory(3, 64).unwrap();
        std::thread::scope(|s| {
            for a in &arenas {
                s.spawn(move || {
                    let mut r = a.round(&tag(0), Shape::Scatter { root: 1 }).unwrap();
                    if a.rank() == 1 {
                        let slots = r.others_mut();
                        assert!(slots[1].is_none());
                        for (p, slot) in slots.into_iter().enumerate() {
                            if let Some(slot) = slot {
                                slot[0] = p as u8 + 100;
                            }
                        }
                    }
                    r.stage(far(), Duration::ZERO, &Cost::default()).unwrap();
                    if a.rank() != 1 {
                        assert_eq!(r.slot(a.rank())[0], a.rank() as u8 + 100);
                    }
                });
            }
        });
    }

    #[test]
    fn a_rank_that_never_arrives_is_named_at_the_deadline() {
        let arenas = Arena::in_memory(3, 64).unwrap();
        let cost = Cost::default();
        std::thread::scope(|s| {
            let a1 = &arenas[1];
            s.spawn(move || a1.round(&tag(0), Shape::Gather).unwrap().stage(far(), Duration::ZERO, &Cost::default()));
            let mut r = arenas[0].round(&tag(0), Shape::Gather).unwrap();
            let started = Instant::now();
            let deadline = started + Duration::from_millis(200);
            assert_eq!(r.stage(deadline, Duration::ZERO, &cost), Err(Stuck::TimedOut { missing: vec![2] }));
            assert!(started.elapsed() < Duration::from_secs(2));
            // Rank 1 waits on: free it.
            arenas[2].abort("done");
        });
    }

    #[test]
    fn an_abort_wakes_the_waiters_and_fails_later_rounds() {
        let arenas = Arena::in_memory(3, 64).unwrap();
        std::thread::scope(|s| {
            let waiters: Vec<_> = arenas[..2]
                .iter()
                .map(|a| {
                    s.spawn(move || {
                        a.round(&tag(1), Shape::Gather).unwrap().stage(far(), Duration::ZERO, &Cost::default())
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(50));
            arenas[2].abort("rank 2 lost its peer");
            arenas[0].abort("a second reason is not kept");
            for w in waiters {
                let started = Instant::now();
                let got = w.join().unwrap();
                assert_eq!(got, Err(Stuck::Aborted { by: 2, reason: "rank 2 lost its peer".into() }));
                assert!(started.elapsed() < Duration::from_secs(1));
            }
        });
        assert!(matches!(arenas[1].round(&tag(2), Shape::Gather), Err(Stuck::Aborted { by: 2, .. })));
    }

    #[test]
    fn the_last_arrival_passes_even_if_the_arena_was_aborted_meanwhile() {
        // Everything the stage waited for is there: an abort after the others
        // arrived does not fail it, but the next round.
        let arenas = Arena::in_memory(2, 64).unwrap();
        let mut r1 = arenas[1].round(&tag(0), Shape::Gather).unwrap();
        std::thread::scope(|s| {
            let a0 = &arenas[0];
            let first = s.spawn(move || {
                let mut r0 = a0.round(&tag(0), Shape::Gather).unwrap();
                r0.stage(far(), Duration::ZERO, &Cost::default())
            });
            while arenas[0].stamp(0, 0).arrived.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
            arenas[0].abort("rank 0 shut the group down");
            assert_eq!(r1.stage(far(), Duration::ZERO, &Cost::default()), Ok(()));
            // Rank 0 saw the stage pass, or the abort first: nothing else.
            let first = first.join().unwrap();
            assert!(matches!(first, Ok(()) | Err(Stuck::Aborted { by: 0, .. })), "{first:?}");
        });
        drop(r1);
        assert!(arenas[1].round(&tag(1), Shape::Gather).is_err());
    }

    /// A rank that passed a stage may finish its op and abort the arena
    /// (its group destroyed at once) while a slower rank, which arrived
    /// first, has not yet looked at the stage again: that rank's stage
    /// passed all the same (found by the group churn soak, where it failed
    /// ops now and then), and only its next round fails.
    #[test]
    fn an_abort_after_the_stage_passed_fails_only_the_next_round() {
        let arenas = Arena::in_memory(2, 64).unwrap();
        let mut r1 = arenas[1].round(&tag(0), Shape::Gather).unwrap();
        assert!(!r1.arrive(), "rank 1 first: it waits");
        // Rank 0 on a thread of its own, as in its own process (one round per thread).
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut r0 = arenas[0].round(&tag(0), Shape::Gather).unwrap();
                assert!(r0.arrive(), "rank 0 last: the stage passed");
            });
        });
        arenas[0].abort("rank 0: the process group was shut down");
        // What rank 1's wait asks when it sees the abort between two looks at the stage.
        assert_eq!(r1.aborted_before_passing(), None);
        assert_eq!(r1.wait(far(), Duration::ZERO, &Cost::default()), Ok(()));
        drop(r1);
        assert!(matches!(arenas[1].round(&tag(1), Shape::Gather), Err(Stuck::Aborted { by: 0, .. })));
    }

    /// What another process wrote in the header is bounded before use: a
    /// reason longer than there is room for, by a rank that does not exist.
    #[test]
    fn an_abort_written_by_a_scribbler_is_read_within_bounds() {
        let arenas = Arena::in_memory(2, 64).unwrap();
        arenas[1].abort("short");
        let h = arenas[0].header();
        h.reason_len.store(u32::MAX, Ordering::Relaxed);
        h.aborted_by.store(u32::MAX, Ordering::Relaxed);
        let Some(Stuck::Aborted { by, reason }) = arenas[0].aborted() else { panic!("not aborted") };
        assert_eq!(by, u32::MAX as usize, "passed on as it is; users check it before naming a rank");
        assert_eq!(reason.len(), REASON_MAX);
        assert!(reason.starts_with("short\0"));
    }

    /// A peer's arena whose slots would be misaligned is refused, though its size adds up.
    #[test]
    fn an_arena_with_misaligned_slots_is_refused() {
        let len = Arena::bytes_for(2, 4097).unwrap();
        let fd = sealed_memfd(len).unwrap();
        Arena::init(&Mapping::of(fd.as_raw_fd(), len).unwrap(), 0, 2, 4097);
        assert!(Arena::open(&fd, 1, 2).is_err());
    }

    #[test]
    fn arrivals_wrap_around() {
        let arenas = Arena::in_memory(3, 64).unwrap();
        // Start every count just below the wrap.
        let start = u32::MAX - 5;
        for a in &arenas {
            a.local.lock().unwrap().stages = start;
            for parity in 0..2 {
                a.stamp(a.rank(), parity).arrived.store(start, Ordering::Relaxed);
            }
        }
        std::thread::scope(|s| {
            for a in &arenas {
                s.spawn(move || {
                    for k in 0..20u8 {
                        a.round(&tag(k), Shape::Gather)
                            .unwrap()
                            .stage(far(), Duration::ZERO, &Cost::default())
                            .unwrap();
                    }
                });
            }
        });
    }

    #[test]
    fn an_arena_travels_by_its_descriptor_and_is_checked() {
        let made = Arena::create(2, 4096, 0, 0).unwrap();
        let opened = Arena::open(made.fd().unwrap(), 1, 2).unwrap();
        assert_eq!(opened.slot_bytes(), 4096);
        assert!(Arena::open(made.fd().unwrap(), 1, 3).is_err(), "made for another world size");
        let (_, ring_fd) = crate::transport::links::ring::Segment::create(64 << 10).unwrap();
        assert!(Arena::open(&ring_fd, 1, 2).is_err(), "not an arena");
        let mut o = opened.round(&tag(7), Shape::Gather).unwrap();
        // Rank 0 on a thread of its own, as in its own process (one round per thread).
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut r = made.round(&tag(7), Shape::Gather).unwrap();
                r.own()[0] = 42;
            });
        });
        assert!(opened.aborted().is_some(), "an unused round aborts the arena");
        // SAFETY: rank 0's slot, through the other mapping of the same memfd,
        // still alive; the thread that wrote it has ended.
        assert_eq!(unsafe { o.slice(0)[0] }, 42, "the same memory");
        assert!(o.stage(far(), Duration::ZERO, &Cost::default()).is_err());
    }
}
