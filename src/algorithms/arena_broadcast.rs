//! Broadcast in the shared arena, a slot's worth per round: the root copies
//! its chunk into its slot and, after one stage, every other rank copies it
//! out at once. While they read chunk k the root fills its other slot with
//! chunk k + 1. Nothing of a receiver's is written before the stage.
//!
//! Bytes copied (`Cost`) per payload byte: 1 on the root, 1 on every other
//! rank. Stages: 1 per slot of data.

use super::call_check::Fingerprint;
use super::in_arena::{in_rounds, part};
use super::{OpCtx, RawBuf};
use crate::error::Result;
use crate::transport::group::arena::Arena;

pub fn arena_broadcast(ctx: &OpCtx, arena: &Arena, buf: RawBuf, root: usize, fp: &Fingerprint) -> Result<()> {
    let rank = ctx.transport.rank();
    let per_round = arena.slot_bytes();
    in_rounds(ctx, arena, fp, buf.len, per_round, |r, k| {
        let chunk = part(buf, per_round, k);
        let theirs = r.slot(root, chunk.len);
        if rank == root {
            // SAFETY: before the stage the root's slot is written by the root alone
            // and read by none; `chunk` lies in the op's buffer (`part`), only read.
            unsafe { ctx.copy(theirs, chunk) };
        }
        r.stage()?;
        if rank != root {
            // SAFETY: after the stage the root's slot is only read until every rank
            // has arrived at the next round's first stage; on a receiver `chunk`
            // lies in the op's buffer, which nothing else touches.
            unsafe { ctx.copy(chunk, theirs) };
        }
        Ok(())
    })
}
