//! All-reduce and reduce in the shared arena, as DeepSpeed's CPU all-reduce
//! does it, a slot's worth of the buffer per round: every rank copies its
//! chunk into its slot; after a stage, rank i folds slice i (1/W of the
//! chunk) of every rank's slot into its own, in one pass per slot; after a
//! second stage every rank (for reduce, the root alone) copies each rank's
//! reduced slice out. Small buffers take one stage: every rank (the root)
//! folds every slot, in rank order, straight into its buffer. Each element
//! is reduced by one rank, or by every rank in the same order, so all ranks
//! end bit-identical; nothing of the caller's is written before a round's
//! last stage, and PREMUL_SUM scales the slot's copy, not the caller's buffer.
//!
//! Bytes copied (`Cost`), per rank, for n bytes: n into its slot +
//! (W-1)n/W folding its slices + n copied out (reduce: the root only).
//! Small (n W <= ONE_STAGE_BYTES, n <= small_allreduce_bytes): n into its
//! slot + n + (W-1)n folding every slot into the buffer (reduce: the root
//! only). Stages: 2 per slot of data, 1 if small; at most one wake-up each.

use super::call_check::Fingerprint;
use super::in_arena::{part, round};
use super::{OpCtx, RawBuf};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::{divide_by, scale};
use crate::transport::group::arena::Arena;

/// Buffers whose every rank's copy together is at most this large take one
/// stage (if no larger than `small_allreduce_bytes`, where the direct
/// exchange, which copies more, would have run): each rank reading every
/// slot costs less than a second stage. It copies W + 1 bytes per byte
/// against (3W - 1)/W, so only where latency, not bytes, is what counts.
pub const ONE_STAGE_BYTES: usize = 64 << 10;

/// What is reduced, and who gets the result.
pub struct Reducing {
    pub dtype: DType,
    pub op: ReduceOp,
    /// PREMUL_SUM's factor.
    pub premul: Option<f64>,
    /// Reduce: only this rank's buffer gets the result.
    pub root: Option<usize>,
}

pub fn arena_allreduce(ctx: &OpCtx, arena: &Arena, buf: RawBuf, how: &Reducing, fp: &Fingerprint) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let es = how.dtype.size();
    let gets_result = how.root.is_none_or(|r| r == rank);
    let deadline = ctx.deadline;
    let per_round = arena.slot_bytes() / es * es;
    let one_stage = buf.len * world <= ONE_STAGE_BYTES && buf.len <= ctx.small_allreduce_bytes.min(per_round);
    let rounds = if one_stage { 1 } else { buf.len.div_ceil(per_round).max(1) };
    for k in 0..rounds {
        let chunk = part(buf, per_round, k);
        let len = chunk.len;
        let mut r = round(ctx, arena, fp, k as u64, deadline)?;
        let mine = r.slot(rank, len);
        // SAFETY: before the round's first stage this rank's slot is written by
        // it alone and read by none (`Round::slot`); `chunk` lies in the op's
        // buffer (`part`), only read here; `mine` is `len` <= slot bytes long.
        unsafe {
            ctx.copy(mine, chunk);
            if let Some(f) = how.premul {
                scale(how.dtype, mine.slice_mut(0, len), f);
            }
        }
        r.stage()?;
        if one_stage {
            if gets_result {
                fold_all(ctx, how, chunk, (0..world).map(|p| r.slot(p, len)));
            }
            continue;
        }
        // Slice p of the chunk: elements [p m / W, (p + 1) m / W).
        let m = len / es;
        let slice = |p: usize, of: RawBuf| {
            let (lo, hi) = (p * m / world * es, (p + 1) * m / world * es);
            of.sub(lo, hi - lo)
        };
        let acc = slice(rank, mine);
        // SAFETY: after the first stage, rank p writes only slice p of its own
        // slot and reads slice p of the others': slice `rank` of this rank's
        // slot is touched by this rank alone until the second stage.
        let dst = unsafe { acc.slice_mut(0, acc.len) };
        for p in ctx.peers() {
            // SAFETY: slice `rank` of rank p's slot: rank p wrote it before the first
            // stage and writes only its own slice p now; other ranks only read it.
            // It does not overlap `dst`, which lies in this rank's slot.
            ctx.reduce_into(how.dtype, how.op, dst, unsafe { slice(rank, r.slot(p, len)).slice(0, acc.len) });
        }
        if how.op == ReduceOp::Avg {
            divide_by(how.dtype, dst, world);
        }
        r.stage()?;
        if gets_result {
            for p in 0..world {
                // SAFETY: after the second stage every slot is only read (until every
                // rank has arrived at the next round's first stage); slice p of the
                // chunk lies in the op's buffer, which no transfer touches.
                unsafe { ctx.copy(slice(p, chunk), slice(p, r.slot(p, len))) };
            }
        }
    }
    Ok(())
}

/// `out` = the fold of `slots` (every rank's, in rank order), then divided,
/// for an average.
fn fold_all(ctx: &OpCtx, how: &Reducing, out: RawBuf, mut slots: impl ExactSizeIterator<Item = RawBuf>) {
    let world = slots.len();
    let first = slots.next().expect("a group has a rank");
    // SAFETY: after the round's one stage the slots are only read; `out` is a
    // chunk of the op's buffer, the same length as every slot here.
    unsafe { ctx.copy(out, first) };
    // SAFETY: `out` is a chunk of the op's buffer, touched by nothing else
    // while the fold runs; the slots it reads are other memory.
    let acc = unsafe { out.slice_mut(0, out.len) };
    for s in slots {
        // SAFETY: a slot of this round, after its one stage: read-only until every
        // rank has arrived at the next round's first stage.
        ctx.reduce_into(how.dtype, how.op, acc, unsafe { s.slice(0, s.len) });
    }
    if how.op == ReduceOp::Avg {
        divide_by(how.dtype, acc, world);
    }
}
