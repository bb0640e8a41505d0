//! All-to-all: every pair exchanges its blocks directly. All receives are
//! posted first, then sends go out starting with the next rank, so that no
//! peer is hit by everyone at once.
//!
//! Bytes copied (`Cost`), per rank: its own block, the W-1 blocks received,
//! and the W-1 sent through the rings (none where peers read them from its memory).

use super::{OpCtx, RawBuf};
use crate::error::Result;

/// `inputs[p]` goes to rank p, `outputs[p]` comes from rank p (sizes may differ per pair).
pub fn pairwise_alltoall(ctx: &OpCtx, inputs: &[RawBuf], outputs: &[RawBuf]) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let key = ctx.key(0);
    let tr = &mut ctx.transfers();
    let peers = || (1..world).map(|k| (rank + k) % world);
    for p in peers() {
        // SAFETY: outputs[p] is the op's buffer (see `RawBuf`), handed to the
        // transport alone until `tr` waits for it or is dropped; p != rank, so
        // no other transfer or copy here touches it.
        unsafe { tr.recv(p, key, outputs[p].ptr, outputs[p].len)? };
    }
    for p in peers() {
        // SAFETY: inputs[p] is the op's buffer, only read here and by the
        // transport until `tr` is done; nothing of this op writes an input.
        unsafe { tr.send(p, key, inputs[p].slice(0, inputs[p].len))? };
    }
    // SAFETY: both are the op's buffers, the same length (`Collective::check`
    // for all-to-all does not say so: `copy` asserts it); outputs[rank] is
    // in no transfer, inputs[rank] only read by the sends above.
    unsafe { ctx.copy(outputs[rank], inputs[rank]) };
    tr.wait_all()
}
