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
use super::{OpCtx, RawBuf};
use crate::error::Result;
use crate::transport::group::arena::Arena;

/// At the root, `inputs[i]` goes to rank i's `output`; elsewhere `inputs` is empty.
pub fn arena_scatter(
    ctx: &OpCtx,
    arena: &Arena,
    inputs: &[RawBuf],
    output: RawBuf,
    root: usize,
    fp: &Fingerprint,
) -> Result<()> {
    let rank = ctx.transport.rank();
    let per_round = arena.slot_bytes();
    in_rounds(ctx, arena, fp, output.len, per_round, |r, k| {
        for (p, block) in inputs.iter().enumerate().filter(|&(p, _)| p != rank) {
            let src = part(*block, per_round, k);
            // SAFETY: before the stage the root alone writes every other rank's slot
            // (in a scatter no rank writes its own), and no rank reads any; `src`
            // lies in the op's input block (`part`), only read.
            unsafe { ctx.copy(r.slot(p, src.len), src) };
        }
        r.stage()?;
        let dst = part(output, per_round, k);
        let src = if rank == root { part(inputs[rank], per_round, k) } else { r.slot(rank, dst.len) };
        // SAFETY: after the stage the slots are only read; `dst` lies in the op's
        // output, touched by nothing else; `src` is this rank's slot or, at
        // the root, its own input block (in place, `copy` skips it).
        unsafe { ctx.copy(dst, src) };
        Ok(())
    })
}
