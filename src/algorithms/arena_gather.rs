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
use super::{OpCtx, RawBuf};
use crate::error::Result;
use crate::transport::group::arena::Arena;

/// At the root, `outputs[i]` receives rank i's `input`; elsewhere `outputs` is empty.
pub fn arena_gather(
    ctx: &OpCtx,
    arena: &Arena,
    input: RawBuf,
    outputs: &[RawBuf],
    root: usize,
    fp: &Fingerprint,
) -> Result<()> {
    let rank = ctx.transport.rank();
    let per_round = arena.slot_bytes();
    in_rounds(ctx, arena, fp, input.len, per_round, |r, k| {
        let mine = part(input, per_round, k);
        if rank != root {
            // SAFETY: before the stage this rank's slot is written by it alone and
            // read by none; `mine` lies in the op's input (`part`), only read.
            unsafe { ctx.copy(r.slot(rank, mine.len), mine) };
        }
        r.stage()?;
        for (p, out) in outputs.iter().enumerate() {
            let dst = part(*out, per_round, k);
            let src = if p == rank { mine } else { r.slot(p, dst.len) };
            // SAFETY: after the stage the slots are only read; `dst` lies in the op's
            // buffer outputs[p] (at the root), touched by nothing else; `src` is
            // a slot or this rank's input (only read; in place, `copy` skips it).
            unsafe { ctx.copy(dst, src) };
        }
        Ok(())
    })
}
