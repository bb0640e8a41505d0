//! Broadcast in one step when every rank reads the others' memory
//! (`Transport::single_copy_bytes`): the root sends its buffer to every rank
//! at once as its address, and every rank reads it from there at the same
//! time, instead of forwarding it around the ring in W-1 hops. The calls are
//! checked with every rank before any data moves (see call_check).
//!
//! Bytes copied per payload byte: the root 0, every other rank 1.

use super::call_check::{agree_with_all, Fingerprint};
use super::OpCtx;
use crate::error::Result;

pub fn single_copy_broadcast(ctx: &OpCtx, buf: &mut [u8], root: usize, check: &Fingerprint) -> Result<()> {
    ctx.with_transfers(|tr| {
        agree_with_all(ctx, tr, check)?;
        if ctx.transport.rank() == root {
            for p in ctx.peers() {
                tr.send(p, ctx.key(0), buf)?;
            }
            tr.wait_all()
        } else {
            let lent = tr.recv(root, ctx.key(0), buf)?;
            tr.give_back(lent)?;
            tr.wait_all()
        }
    })
}
