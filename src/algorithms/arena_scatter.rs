//! Scatter in the shared arena, a slot's worth of every block per round:
//! the root copies each rank's part into that rank's slot (the one slot a
//! rank does not write itself) and, after one stage, every rank copies its
//! own out at once (the root straight from its input). Nothing of a
//! receiver's is written before the stage.
//!
//! Bytes copied (`Cost`), for blocks of b bytes: W b on the root (W-1 slots
//! and its own block), b on every other rank (out of its slot), as the
//! direct scatter through the rings. Stages: 1 per slot of a block, instead
//! of a message to every rank.

use super::call_check::Fingerprint;
use super::in_arena::{in_rounds, part};
use super::OpCtx;
use crate::error::Result;
use crate::transport::group::arena::{Arena, Shape};

/// At the root, `inputs[i]` goes to rank i's `output` (its own, `inputs[root]`,
/// is `own`, or None in place: what `output` holds); elsewhere `inputs` is
/// empty.
pub fn arena_scatter(
    ctx: &OpCtx,
    arena: &Arena,
    inputs: &[&[u8]],
    own: Option<&[u8]>,
    output: &mut [u8],
    root: usize,
    fp: &Fingerprint,
) -> Result<()> {
    let rank = ctx.transport.rank();
    let per_round = arena.slot_bytes();
    in_rounds(ctx, arena, fp, (output.len(), per_round), Shape::Scatter { root }, |r, k| {
        let at = part(output.len(), per_round, k);
        if rank == root {
            for (p, slot) in r.others_mut().into_iter().enumerate() {
                if let Some(slot) = slot {
                    let src = &inputs[p][part(inputs[p].len(), per_round, k)];
                    ctx.copy_into(&mut slot[..src.len()], src);
                }
            }
        }
        r.stage()?;
        match (rank == root, own) {
            // In place the root's output holds its block already.
            (true, None) => {}
            (true, Some(input)) => ctx.copy_into(&mut output[at.clone()], &input[at]),
            (false, _) => ctx.copy_into(&mut output[at.clone()], &r.slot(rank)[..at.len()]),
        }
        Ok(())
    })
}
