//! Gather in the shared arena, a slot's worth of every block per round:
//! each rank but the root copies its part into its slot and, after one
//! stage, the root copies every rank's part into place (its own straight
//! from its input). Nothing of the root's is written before the stage.
//!
//! Bytes copied (`Cost`), for blocks of b bytes: b on every other rank (into
//! its slot), W b on the root (its own block and W-1 slots), as the direct
//! gather through the rings. Stages: 1 per slot of a block, instead of a
//! message from every rank; one wake-up of the root per stage.

use super::call_check::Fingerprint;
use super::in_arena::{in_rounds, part};
use super::OpCtx;
use crate::error::Result;
use crate::transport::group::arena::{Arena, Shape};

/// At the root, `outputs[i]` receives rank i's input (this rank's: `own`,
/// or in place (None) what `outputs[root]` holds); elsewhere `outputs` is
/// empty and `own` the input.
pub fn arena_gather(
    ctx: &OpCtx,
    arena: &Arena,
    own: Option<&[u8]>,
    outputs: &mut [&mut [u8]],
    root: usize,
    fp: &Fingerprint,
) -> Result<()> {
    let rank = ctx.transport.rank();
    let per_round = arena.slot_bytes();
    let len = own.map_or_else(|| outputs.get(root).map_or(0, |o| o.len()), |i| i.len());
    in_rounds(ctx, arena, fp, (len, per_round), Shape::Gather, |r, k| {
        if rank != root {
            let input = own.expect("a rank other than the root has its input");
            let mine = &input[part(len, per_round, k)];
            ctx.copy_into(&mut r.own()[..mine.len()], mine);
        }
        r.stage()?;
        for (p, out) in outputs.iter_mut().enumerate() {
            let at = part(out.len(), per_round, k);
            match (p == rank, own) {
                // In place the root's own block holds its input already.
                (true, None) => {}
                (true, Some(input)) => ctx.copy_into(&mut out[at.clone()], &input[at]),
                (false, _) => ctx.copy_into(&mut out[at.clone()], &r.slot(p)[..at.len()]),
            }
        }
        Ok(())
    })
}
