//! Broadcast in the shared arena, a slot's worth per round: the root copies
//! its chunk into its slot and, after one stage, every other rank copies it
//! out at once. While they read chunk k the root fills its other slot with
//! chunk k + 1. Nothing of a receiver's is written before the stage.
//!
//! Bytes copied (`Cost`) per payload byte: 1 on the root, 1 on every other
//! rank. Stages: 1 per slot of data.

use super::call_check::Fingerprint;
use super::in_arena::{in_rounds, part};
use super::OpCtx;
use crate::error::Result;
use crate::transport::group::arena::{Arena, Shape};

/// The buffer of a broadcast: the root's, only read (it may be in other
/// transfers meanwhile), or another rank's, written.
pub enum Cast<'a> {
    From(&'a [u8]),
    Into(&'a mut [u8]),
}

impl Cast<'_> {
    fn len(&self) -> usize {
        match self {
            Cast::From(b) => b.len(),
            Cast::Into(b) => b.len(),
        }
    }
}

/// `buf` is `Cast::From` at `root`, `Cast::Into` elsewhere.
pub fn arena_broadcast(ctx: &OpCtx, arena: &Arena, mut buf: Cast, root: usize, fp: &Fingerprint) -> Result<()> {
    let rank = ctx.transport.rank();
    assert_eq!(matches!(buf, Cast::From(_)), rank == root, "the root's buffer is read, the others' written");
    let per_round = arena.slot_bytes();
    in_rounds(ctx, arena, fp, (buf.len(), per_round), Shape::Gather, |r, k| {
        let at = part(buf.len(), per_round, k);
        if let Cast::From(buf) = &buf {
            ctx.copy_into(&mut r.own()[..at.len()], &buf[at.clone()]);
        }
        r.stage()?;
        if let Cast::Into(buf) = &mut buf {
            ctx.copy_into(&mut buf[at.clone()], &r.slot(root)[..at.len()]);
        }
        Ok(())
    })
}
