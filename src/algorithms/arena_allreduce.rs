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
use super::in_arena::{part_mut, round};
use super::OpCtx;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::{divide_by, scale};
use crate::transport::group::arena::{column, Arena, Shape};

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

pub fn arena_allreduce(ctx: &OpCtx, arena: &Arena, buf: &mut [u8], how: &Reducing, fp: &Fingerprint) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let es = how.dtype.size();
    let gets_result = how.root.is_none_or(|r| r == rank);
    let deadline = ctx.deadline;
    let per_round = arena.slot_bytes() / es * es;
    let one_stage = buf.len() * world <= ONE_STAGE_BYTES && buf.len() <= ctx.small_allreduce_bytes.min(per_round);
    let rounds = if one_stage { 1 } else { buf.len().div_ceil(per_round).max(1) };
    for k in 0..rounds {
        let chunk = part_mut(buf, per_round, k);
        let len = chunk.len();
        let shape = if one_stage { Shape::Gather } else { Shape::Columns { len, elem: es } };
        let mut r = round(ctx, arena, fp, k as u64, shape, deadline)?;
        let mine = &mut r.own()[..len];
        ctx.copy_into(mine, chunk);
        if let Some(f) = how.premul {
            scale(how.dtype, mine, f);
        }
        r.stage()?;
        if one_stage {
            if gets_result {
                fold_all(ctx, how, chunk, (0..world).map(|p| &r.slot(p)[..len]));
            }
            continue;
        }
        // Column p of the chunk: its elements [p m / W, (p + 1) m / W), which rank p reduces.
        let (acc, theirs) = r.columns();
        for p in ctx.peers() {
            ctx.reduce_into(how.dtype, how.op, acc, theirs[p]);
        }
        if how.op == ReduceOp::Avg {
            divide_by(how.dtype, acc, world);
        }
        r.stage()?;
        if gets_result {
            for p in 0..world {
                let cut = column(len, es, world, p);
                ctx.copy_into(&mut chunk[cut.clone()], &r.slot(p)[cut]);
            }
        }
    }
    Ok(())
}

/// `out` = the fold of `slots` (every rank's, in rank order), then divided,
/// for an average.
fn fold_all<'s>(ctx: &OpCtx, how: &Reducing, out: &mut [u8], mut slots: impl ExactSizeIterator<Item = &'s [u8]>) {
    let world = slots.len();
    ctx.copy_into(out, slots.next().expect("a group has a rank"));
    for s in slots {
        ctx.reduce_into(how.dtype, how.op, out, s);
    }
    if how.op == ReduceOp::Avg {
        divide_by(how.dtype, out, world);
    }
}
