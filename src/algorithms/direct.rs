//! Gather and scatter: every rank talks to the root directly (one message per
//! rank), which is what the root's link has to carry anyway.
//!
//! Bytes copied (`Cost`), for blocks of b bytes: the root Wb (its own block,
//! and the W-1 others received); every other rank b (its block, sent through
//! a ring; 0 where the root reads it from its memory).

use super::{OpCtx, RawBuf};
use crate::error::Result;

/// At the root, `outputs[i]` receives rank i's `input`; elsewhere `outputs` is empty.
pub fn direct_gather(ctx: &OpCtx, input: RawBuf, outputs: &[RawBuf], root: usize) -> Result<()> {
    let rank = ctx.transport.rank();
    let key = ctx.key(0);
    let tr = &mut ctx.transfers();
    if rank != root {
        // SAFETY: the op's input, only read (by this send) until `tr` is done.
        unsafe { tr.send_raw(root, key, input.slice(0, input.len))? };
        return tr.wait_all();
    }
    for (peer, out) in outputs.iter().enumerate().filter(|&(p, _)| p != rank) {
        // SAFETY: outputs[peer] (peer != root) is the op's buffer, filled by this
        // receive alone; nothing else here touches it.
        unsafe { tr.recv_raw(peer, key, out.ptr, out.len)? };
    }
    // SAFETY: outputs[rank] is in no transfer; the input is only read (in
    // place they are the same memory, and `copy` skips it).
    unsafe { ctx.copy(outputs[rank], input) };
    tr.wait_all()
}

/// At the root, `inputs[i]` goes to rank i's `output`; elsewhere `inputs` is empty.
pub fn direct_scatter(ctx: &OpCtx, inputs: &[RawBuf], output: RawBuf, root: usize) -> Result<()> {
    let rank = ctx.transport.rank();
    let key = ctx.key(0);
    let tr = &mut ctx.transfers();
    if rank != root {
        // SAFETY: the op's output, filled by this receive alone until `tr` is done.
        unsafe { tr.recv_raw(root, key, output.ptr, output.len)? };
        return tr.wait_all();
    }
    // Start with the next rank so that concurrent scatters spread their load.
    let world = inputs.len();
    for peer in (1..world).map(|k| (rank + k) % world) {
        // SAFETY: inputs[peer] is the op's buffer, only read (by this send).
        unsafe { tr.send_raw(peer, key, inputs[peer].slice(0, inputs[peer].len))? };
    }
    // SAFETY: `output` is in no transfer; inputs[rank] is not sent, only
    // read here (in place, the same memory: `copy` skips it).
    unsafe { ctx.copy(output, inputs[rank]) };
    tr.wait_all()
}
