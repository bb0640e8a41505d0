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
use super::in_arena::{part, part_mut, round};
use super::OpCtx;
use crate::dtype::ReduceOp;
use crate::error::Result;
use crate::reduce::{divide_by, scale};
use crate::transport::group::arena::{Arena, Shape};

/// `inputs[c]` is this rank's contribution to block c (its own, `inputs[rank]`,
/// is `own`, or None in place: what `output` holds); `output` gets block `rank`.
pub fn arena_reduce_scatter(
    ctx: &OpCtx,
    arena: &Arena,
    inputs: &[&[u8]],
    own: Option<&[u8]>,
    output: &mut [u8],
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
    let longest = (0..world).map(|c| if c == rank { output.len() } else { inputs[c].len() }).max().unwrap_or(0);
    for k in 0..longest.div_ceil(per_block).max(1) {
        let mut r = round(ctx, arena, fp, k as u64, Shape::Gather, deadline)?;
        // Block c's part in a slot: world * per_block <= slot bytes.
        let at = |c: usize, len: usize| c * per_block..c * per_block + len;
        let slot = r.own();
        for c in 0..world {
            let block = match c == rank {
                true => own.unwrap_or(output),
                false => inputs[c],
            };
            let src = &block[part(block.len(), per_block, k)];
            let dst = &mut slot[at(c, src.len())];
            ctx.copy_into(dst, src);
            if let Some(f) = how.premul {
                scale(how.dtype, dst, f);
            }
        }
        r.stage()?;
        let out = part_mut(output, per_block, k);
        let len = out.len();
        ctx.copy_into(out, &r.slot(0)[at(rank, len)]);
        for p in 1..world {
            ctx.reduce_into(how.dtype, how.op, out, &r.slot(p)[at(rank, len)]);
        }
        if how.op == ReduceOp::Avg {
            divide_by(how.dtype, out, world);
        }
    }
    Ok(())
}
