//! All-gather in the shared arena, a slot's worth of every rank's block per
//! round: each rank copies its part into its slot and, after one stage,
//! copies every rank's part into place. Blocks may differ in size (a rank's
//! output for rank r is as long as rank r's input). Nothing of the caller's
//! is written before the stage.
//!
//! Bytes copied (`Cost`), per rank, for blocks of b bytes: b into its slot
//! and W b into place, (W + 1)/W per output byte. Stages: 1 per slot of the
//! largest block.

use super::call_check::Fingerprint;
use super::in_arena::{in_rounds, part};
use super::{OpCtx, RawBuf};
use crate::error::Result;
use crate::transport::group::arena::Arena;

/// `outputs[r]` receives rank r's `input`.
pub fn arena_allgather(ctx: &OpCtx, arena: &Arena, input: RawBuf, outputs: &[RawBuf], fp: &Fingerprint) -> Result<()> {
    let rank = ctx.transport.rank();
    let per_round = arena.slot_bytes();
    let longest = outputs.iter().map(|o| o.len).max().unwrap_or(0);
    in_rounds(ctx, arena, fp, longest, per_round, |r, k| {
        let mine = part(input, per_round, k);
        // SAFETY: this round's slot of this rank, which no other rank touches
        // before the stage (`Round::slot`); `mine` is within the op's input
        // (`part`), only read. `slot` keeps the length within the slot.
        unsafe { ctx.copy(r.slot(rank, mine.len), mine) };
        r.stage()?;
        for (p, out) in outputs.iter().enumerate() {
            let dst = part(*out, per_round, k);
            // SAFETY: after the stage every slot of this round is only read, until
            // every rank has arrived at the next round's first stage; `dst` lies in
            // the op's buffer outputs[p] (`part`), which nothing else touches (with
            // p == rank in place it is the input, copied into the slot already).
            unsafe { ctx.copy(dst, r.slot(p, dst.len)) };
        }
        Ok(())
    })
}
