//! Collective algorithms, written against `Transfers` (send/recv of byte
//! ranges by rank). They know nothing of sockets or of torch. `dispatch`
//! chooses one per collective; `call_check` catches mismatched calls.

// Segment loops index several parallel lists (offsets, posted receives) by
// the segment number; iterator chains would hide that.
#![allow(clippy::needless_range_loop)]

use crate::dtype::{DType, ReduceOp};
use crate::locks::{level, Mutex};
use crate::status::Cost;
use crate::transport::{Fold, Key, Transfers, Transport};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod alltoall;
mod arena_allgather;
mod arena_allreduce;
mod arena_alltoall;
mod arena_broadcast;
mod arena_gather;
mod arena_reduce_scatter;
mod arena_scatter;
mod broadcast;
pub mod call_check;
mod direct;
mod direct_allreduce;
mod dispatch;
mod hier_allgather;
mod hier_allreduce;
mod hier_direct_allreduce;
mod hier_reduce_scatter;
pub mod hosts;
mod in_arena;
mod monitored_barrier;
mod op_bufs;
mod pipeline;
mod ring_allgather;
mod ring_allreduce;
mod ring_reduce;
mod ring_reduce_scatter;
mod single_copy_allgather;
mod single_copy_broadcast;
mod single_copy_reduce;
mod sparse_allreduce;
mod tree_broadcast;
mod tree_reduce;

pub use alltoall::pairwise_alltoall;
pub use broadcast::ring_broadcast;
pub use direct::{direct_gather, direct_scatter};
pub use direct_allreduce::{direct_allreduce, prefers_direct};
pub use dispatch::{run, Algorithm, Plan};
pub use hier_allgather::hierarchical_allgather;
pub use hier_allreduce::hierarchical_allreduce;
pub use hier_direct_allreduce::hierarchical_direct_allreduce;
pub use hier_reduce_scatter::hierarchical_reduce_scatter;
pub use monitored_barrier::monitored_barrier;
pub use op_bufs::OpBufs;
pub use ring_allgather::ring_allgather;
pub use ring_allreduce::ring_allreduce;
pub use ring_reduce::ring_reduce;
pub use ring_reduce_scatter::ring_reduce_scatter;
pub use single_copy_allgather::single_copy_allgather;
pub use single_copy_broadcast::single_copy_broadcast;
pub use single_copy_reduce::{single_copy_allreduce, single_copy_reduce_scatter};
pub use sparse_allreduce::sparse_allreduce;
pub use tree_broadcast::tree_broadcast;
pub use tree_reduce::tree_reduce;

/// The op an algorithm runs, as its errors name it ("allreduce #4 on rank
/// 1 (piece 2)"): kept as its parts, and written out only when an error or
/// a noted wait needs it, which is not on the path of an op that succeeds.
#[derive(Clone, Debug)]
pub struct What {
    pub op: &'static str,
    pub seq: u64,
    pub rank: usize,
    /// The part of the op, outermost first: ("piece", 2), ("sparse round", 1).
    pub within: Vec<(&'static str, u64)>,
}

impl What {
    pub fn new(op: &'static str, seq: u64, rank: usize) -> What {
        What { op, seq, rank, within: Vec::new() }
    }

    /// Part `n` of this op, called `label`.
    pub fn within(&self, label: &'static str, n: u64) -> What {
        let mut w = self.clone();
        w.within.push((label, n));
        w
    }
}

impl std::fmt::Display for What {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} #{} on rank {}", self.op, self.seq, self.rank)?;
        self.within.iter().try_for_each(|(label, n)| write!(f, " ({label} {n})"))
    }
}

/// What an algorithm needs to know about the op it runs.
pub struct OpCtx<'a> {
    pub transport: &'a dyn Transport,
    /// Collective sequence number: the same on every rank for the same call.
    pub seq: u64,
    pub timeout: Duration,
    /// When the op must have finished: its start plus its timeout (read
    /// once, so that a small op looks at the clock no more than it must).
    pub deadline: Instant,
    /// "allreduce #4 on rank 1", for errors.
    pub what: What,
    /// Payload bytes per message in pipelined algorithms: large enough to
    /// amortise the 40-byte header and a syscall, small enough that send,
    /// receive and reduce of consecutive segments overlap.
    pub segment_bytes: usize,
    /// All-reduces up to this size use the direct exchange.
    pub small_allreduce_bytes: usize,
    pub pool: &'a ScratchPool,
    /// How long a wait polls before it sleeps.
    pub spin: Duration,
    /// Which piece of a buffer run in pieces this is (0 otherwise): its
    /// messages get keys of their own.
    pub piece: u64,
    /// Which phase of an algorithm made of others this is (0 otherwise): its
    /// messages get keys of their own too.
    pub phase: u64,
    /// What the op costs this rank: its transfers and its own copies and folds.
    pub cost: &'a Arc<Cost>,
}

impl<'a> OpCtx<'a> {
    /// Scratch for this op, from the group's pool.
    pub fn scratch(&self, bytes: usize) -> Scratch<'a> {
        self.pool.take(bytes)
    }

    /// The key of this op's message `step` (for the current piece and phase).
    pub fn key(&self, step: u64) -> Key {
        debug_assert!(step < 1 << 32 && self.piece < 1 << 24 && self.phase < MAX_PHASES);
        Key::collective(self.seq, self.phase << 56 | self.piece << 32 | step)
    }

    /// This op's phase `phase` (1 to MAX_PHASES - 1) on `view`, some of the
    /// group's ranks (a `Subgroup`): an algorithm run on it moves bytes
    /// between those ranks only, with keys of that phase.
    pub fn phase<'b>(&'b self, view: &'b dyn Transport, phase: u64) -> OpCtx<'b> {
        OpCtx { transport: view, phase, what: self.what.clone(), ..*self }
    }

    /// Transfers for this op. Algorithms create them after any scratch memory,
    /// so that cleanup finishes before the scratch is freed.
    pub fn transfers(&self) -> Transfers<'a, 'static> {
        Transfers::new(self.transport, self.timeout, self.what.to_string(), self.spin, self.cost.clone())
    }

    /// Runs `f` with this op's transfers, which borrow the slices lent to
    /// them for `'b`: every one is done with before this returns
    /// (`Transfers::scope`).
    pub fn with_transfers<'b, R>(&self, f: impl FnOnce(&mut Transfers<'a, 'b>) -> R) -> R {
        Transfers::scope(self.transport, self.timeout, self.what.to_string(), self.spin, self.cost.clone(), f)
    }

    /// Every other rank, from the next one on (so that ranks that all send
    /// to everyone do not all start with the same rank).
    pub fn peers(&self) -> impl Iterator<Item = usize> {
        let (rank, world) = (self.transport.rank(), self.transport.size());
        (1..world).map(move |k| (rank + k) % world)
    }

    /// Copy `src` into `dst` (same length: asserted), and count it.
    pub fn copy_into(&self, dst: &mut [u8], src: &[u8]) {
        self.cost.copied(src.len());
        dst.copy_from_slice(src);
    }

    /// Fold `src` into `dst` with `op`, and count it.
    pub fn reduce_into(&self, dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
        self.cost.copied(src.len());
        crate::reduce::reduce_into(dtype, op, dst, src)
    }
}

/// Phases an op's keys tell apart (one key value stays for `call_check`).
pub const MAX_PHASES: u64 = 255;

/// Folds what arrives into a receive buffer with `op` (the transport counts the folds).
pub fn reducing(dtype: DType, op: ReduceOp) -> Fold {
    let f = move |dst: &mut [u8], src: &[u8]| crate::reduce::reduce_into(dtype, op, dst, src);
    Fold { unit: dtype.size(), f: Arc::new(f) }
}

/// Scratch memory kept between ops: a fresh large allocation costs a page
/// fault per 4 KiB on first touch, more than the op's own work.
#[derive(Default)]
pub struct ScratchPool {
    free: Mutex<level::ScratchPool, Vec<Vec<u64>>>,
}

/// Buffers the pool keeps at most; collectives need at most three at once.
const POOL_KEEP: usize = 4;

impl ScratchPool {
    /// At least `bytes` of 8-byte aligned memory (contents unspecified).
    pub fn take(&self, bytes: usize) -> Scratch<'_> {
        let words = bytes.div_ceil(8);
        let mut free = self.free.lock().unwrap();
        // The smallest free buffer that is big enough, else the biggest (grown).
        let fit = (0..free.len()).filter(|&i| free[i].len() >= words).min_by_key(|&i| free[i].len());
        let pick = fit.or_else(|| (0..free.len()).max_by_key(|&i| free[i].len()));
        let mut buf = pick.map(|i| free.swap_remove(i)).unwrap_or_default();
        drop(free);
        if buf.len() < words {
            buf.resize(words, 0);
        }
        Scratch { buf, bytes, pool: Some(self) }
    }
}

/// 8-byte aligned scratch memory, so kernels can view it as any dtype;
/// returned to its pool when dropped.
pub struct Scratch<'p> {
    buf: Vec<u64>,
    bytes: usize,
    pool: Option<&'p ScratchPool>,
}

impl Scratch<'static> {
    /// Unpooled, zeroed memory.
    pub fn new(bytes: usize) -> Scratch<'static> {
        Scratch { buf: vec![0u64; bytes.div_ceil(8)], bytes, pool: None }
    }
}

impl Scratch<'_> {
    /// The memory, as bytes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut crate::reduce::bytes_of_words(&mut self.buf)[..self.bytes]
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        let Some(pool) = self.pool else { return };
        let mut free = pool.free.lock().unwrap();
        free.push(std::mem::take(&mut self.buf));
        if free.len() > POOL_KEEP {
            let smallest = (0..free.len()).min_by_key(|&i| free[i].len()).unwrap();
            free.swap_remove(smallest);
        }
    }
}

/// An op's blocks, one per rank, split into every other rank's (numbered),
/// to lend one by one, and this rank's own.
pub fn split_own<'o>(blocks: &'o mut [&mut [u8]], rank: usize) -> (Vec<(usize, &'o mut [u8])>, &'o mut [u8]) {
    let (before, rest) = blocks.split_at_mut(rank);
    let (own, after) = rest.split_first_mut().expect("this rank's own block");
    let others = before.iter_mut().enumerate().chain((rank + 1..).zip(after.iter_mut()));
    (others.map(|(p, b)| (p, &mut **b)).collect(), own)
}

/// The blocks numbered `at` (each once), in that order, out of `blocks`.
pub fn pick<'o>(blocks: &'o mut [&mut [u8]], at: &[usize]) -> Vec<&'o mut [u8]> {
    let mut all: Vec<Option<&mut [u8]>> = blocks.iter_mut().map(|b| Some(&mut **b)).collect();
    at.iter().map(|&i| all[i].take().expect("each block is picked once")).collect()
}

/// Byte range of segment `j` when `len` bytes are cut into `seg`-byte pieces.
pub fn segment(len: usize, seg: usize, j: usize) -> (usize, usize) {
    let off = (j * seg).min(len);
    (off, seg.min(len - off))
}

/// The first `len` bytes of `rest`, which keeps what follows: memory cut
/// into consecutive pieces of different lengths, one call a piece.
pub fn take_front<'s>(rest: &mut &'s mut [u8], len: usize) -> &'s mut [u8] {
    let (front, after) = std::mem::take(rest).split_at_mut(len);
    *rest = after;
    front
}

/// `buf` cut into the segments `segment` numbers (one empty one where it is
/// empty, as `segment_count` counts them), to lend to transfers one by one.
pub fn segments_mut(buf: &mut [u8], seg: usize) -> Vec<&mut [u8]> {
    match buf.is_empty() {
        true => vec![buf],
        false => buf.chunks_mut(seg).collect(),
    }
}

/// Number of segments for `len` bytes (at least one, so empty buffers still
/// exchange a message and every rank takes the same steps).
pub fn segment_count(len: usize, seg: usize) -> usize {
    len.div_ceil(seg).max(1)
}

#[cfg(test)]
mod tests {
    use super::What;

    #[test]
    fn an_op_is_named_with_the_parts_it_runs_in() {
        let op = What::new("allreduce", 4, 1);
        assert_eq!(op.to_string(), "allreduce #4 on rank 1");
        let inner = op.within("piece", 2).within("sparse round", 1);
        assert_eq!(inner.to_string(), "allreduce #4 on rank 1 (piece 2) (sparse round 1)");
        assert_eq!(op.to_string(), "allreduce #4 on rank 1", "the op's own name is left as it was");
    }
}
