//! All-gather in one step when every rank reads the others' memory
//! (`Transport::single_copy_bytes`): every rank sends its block to every
//! other as its address, and reads every other rank's block straight into
//! its place, all at once, instead of W-1 steps around the ring. The calls
//! are checked with every rank before any data moves (see call_check).
//!
//! Bytes copied per rank: its own block once, and every other rank's block
//! once (the ring also copies W-1 blocks out: 2W-1 blocks, or W with single
//! copy, in W-1 steps).

use super::call_check::{agree_with_all, Fingerprint};
use super::{others_mut, own_block, OpCtx, RawBuf};
use crate::error::Result;

/// `outputs[i]` receives rank i's `input` (`outputs[rank]` has `input.len` bytes).
pub fn single_copy_allgather(ctx: &OpCtx, input: RawBuf, outputs: &[RawBuf], check: &Fingerprint) -> Result<()> {
    let rank = ctx.transport.rank();
    // SAFETY: the op's buffers (see `RawBuf`), nothing else's until it ends:
    // the input, only read, and the outputs, apart from each other and from
    // the input but for this rank's own, which may be the input (in place).
    let (sent, mut received, own) =
        unsafe { (input.slice(0, input.len), others_mut(outputs, rank), own_block(input, outputs[rank])) };
    ctx.with_transfers(|tr| {
        agree_with_all(ctx, tr, check)?;
        for (p, block) in received.iter_mut().enumerate().filter(|&(p, _)| p != rank) {
            // Given back with the scope, which waits for it.
            let _lent = tr.recv(p, ctx.key(0), block)?;
        }
        for p in ctx.peers() {
            tr.send(p, ctx.key(0), sent)?;
        }
        if let Some((from, to)) = own {
            ctx.copy_into(to, from);
        }
        tr.wait_all()
    })
}
