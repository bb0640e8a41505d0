//! All-gather in the shared arena, a slot's worth of every rank's block per
//! round: each rank copies its part into its slot and, after one stage,
//! copies every rank's part into place. Blocks may differ in size (a rank's
//! output for rank r is as long as rank r's input). Nothing of the caller's
//! is written before the stage.
//!
//! Bytes copied (`Cost`), per rank, for blocks of b bytes: b into its slot
//! and W b into place, (W + 1)/W per output byte; in place, its own block
//! already holds its part, so (W - 1) b into place, 1 per output byte.
//! Stages: 1 per slot of the largest block.

use super::call_check::Fingerprint;
use super::in_arena::{in_rounds, part, part_mut};
use super::OpCtx;
use crate::error::Result;
use crate::transport::group::arena::{Arena, Shape};

/// `outputs[r]` receives rank r's input: `own`, or, in place (None), what
/// `outputs[rank]` holds.
pub fn arena_allgather(
    ctx: &OpCtx,
    arena: &Arena,
    own: Option<&[u8]>,
    outputs: &mut [&mut [u8]],
    fp: &Fingerprint,
) -> Result<()> {
    let rank = ctx.transport.rank();
    let per_round = arena.slot_bytes();
    let longest = outputs.iter().map(|o| o.len()).max().unwrap_or(0);
    in_rounds(ctx, arena, fp, (longest, per_round), Shape::Gather, |r, k| {
        let input = own.unwrap_or(outputs[rank]);
        let mine = &input[part(input.len(), per_round, k)];
        ctx.copy_into(&mut r.own()[..mine.len()], mine);
        r.stage()?;
        for (p, out) in outputs.iter_mut().enumerate().filter(|&(p, _)| p != rank || own.is_some()) {
            let dst = part_mut(out, per_round, k);
            ctx.copy_into(dst, &r.slot(p)[..dst.len()]);
        }
        Ok(())
    })
}
