//! Reduce-scatter in the shared arena: each round takes up to 1/W of a slot
//! from each of a rank's W input blocks, at the same offset in each; every
//! rank copies its parts into its slot, part c at c/W of the slot, and after
//! one stage rank c folds part c of every rank's slot, in rank order, into
//! its output. Blocks may differ in size (every rank gives the same sizes).
//! Nothing of the caller's is written before the stage, and PREMUL_SUM
//! scales the slot's copy.
//!
//! Bytes copied (`Cost`), per rank, for blocks of b bytes: W b into its
//! slot + W b folded into the output: 2 per input byte. Stages: 1 per
//! slot / W of the largest block.

use super::arena_allreduce::Reducing;
use super::call_check::Fingerprint;
use super::in_arena::{part, round};
use super::{OpCtx, RawBuf};
use crate::dtype::ReduceOp;
use crate::error::Result;
use crate::reduce::{divide_by, scale};
use crate::transport::group::arena::Arena;

/// `inputs[c]` is this rank's contribution to block c; `output` gets block `rank`.
pub fn arena_reduce_scatter(
    ctx: &OpCtx,
    arena: &Arena,
    inputs: &[RawBuf],
    output: RawBuf,
    how: &Reducing,
    fp: &Fingerprint,
) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    // Each block has a part of its own in every slot: at most world of them fit.
    assert_eq!(inputs.len(), world, "arena_reduce_scatter: one input block per rank");
    let es = how.dtype.size();
    let deadline = ctx.deadline;
    // The dispatcher sees that every block gets an element at least.
    let per_block = arena.slot_bytes() / world / es * es;
    let longest = inputs.iter().map(|b| b.len).max().unwrap_or(0);
    for k in 0..longest.div_ceil(per_block).max(1) {
        let mut r = round(ctx, arena, fp, k as u64, deadline)?;
        // Block c's part in rank p's slot.
        let slots: Vec<RawBuf> = (0..world).map(|p| r.slot(p, arena.slot_bytes())).collect();
        // c < world (asserted above) and len <= per_block (`part`), and
        // world * per_block <= slot bytes: the part lies inside slot p.
        let at = |p: usize, c: usize, len: usize| slots[p].sub(c * per_block, len);
        for (c, block) in inputs.iter().enumerate() {
            let src = part(*block, per_block, k);
            let dst = at(rank, c, src.len);
            // SAFETY: before the stage this rank writes only its own slot, which no
            // rank reads yet; `src` lies in the op's input block (only read), and
            // `dst` in the slot, so the two do not overlap.
            unsafe {
                ctx.copy(dst, src);
                if let Some(f) = how.premul {
                    scale(how.dtype, dst.slice_mut(0, dst.len), f);
                }
            }
        }
        r.stage()?;
        let out = part(output, per_block, k);
        // SAFETY: after the stage the slots are only read; `out` lies in the op's
        // output (it may be inputs[rank] itself, already copied to the slot).
        unsafe { ctx.copy(out, at(0, rank, out.len)) };
        // SAFETY: `out` lies in the op's output, touched by nothing else while the
        // folds run; the parts folded into it are in the slots.
        let acc = unsafe { out.slice_mut(0, out.len) };
        for p in 1..world {
            // SAFETY: part `rank` of rank p's slot, written by p before the stage and
            // only read after it.
            ctx.reduce_into(how.dtype, how.op, acc, unsafe { at(p, rank, out.len).slice(0, out.len) });
        }
        if how.op == ReduceOp::Avg {
            divide_by(how.dtype, acc, world);
        }
    }
    Ok(())
}
