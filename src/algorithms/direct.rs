//! Gather and scatter: every rank talks to the root directly (one message per
//! rank), which is what the root's link has to carry anyway.
//!
//! Bytes copied (`Cost`), for blocks of b bytes: the root Wb (its own block,
//! and the W-1 others received); every other rank b (its block, sent through
//! a ring; 0 where the root reads it from its memory).

use super::{others, others_mut, own_block, OpCtx, RawBuf};
use crate::error::Result;

/// At the root, `outputs[i]` receives rank i's `input`; elsewhere `outputs` is empty.
pub fn direct_gather(ctx: &OpCtx, input: RawBuf, outputs: &[RawBuf], root: usize) -> Result<()> {
    let rank = ctx.transport.rank();
    let key = ctx.key(0);
    if rank != root {
        // SAFETY: the op's input (see `RawBuf`), only read.
        let input = unsafe { input.slice(0, input.len) };
        return ctx.with_transfers(|tr| tr.send(root, key, input).and_then(|_| tr.wait_all()));
    }
    // SAFETY: the op's buffers, nothing else's until it ends: the outputs,
    // apart from each other and from the input, but for the root's own,
    // which may be the input (in place).
    let (mut received, own) = unsafe { (others_mut(outputs, rank), own_block(input, outputs[rank])) };
    ctx.with_transfers(|tr| {
        for (peer, block) in received.iter_mut().enumerate().filter(|&(p, _)| p != rank) {
            // Given back with the scope, which waits for it.
            let _lent = tr.recv(peer, key, block)?;
        }
        if let Some((from, to)) = own {
            ctx.copy_into(to, from);
        }
        tr.wait_all()
    })
}

/// At the root, `inputs[i]` goes to rank i's `output`; elsewhere `inputs` is empty.
pub fn direct_scatter(ctx: &OpCtx, inputs: &[RawBuf], output: RawBuf, root: usize) -> Result<()> {
    let rank = ctx.transport.rank();
    let key = ctx.key(0);
    if rank != root {
        // SAFETY: the op's output (see `RawBuf`), nothing else's until it ends.
        let output = unsafe { output.slice_mut(0, output.len) };
        return ctx.with_transfers(|tr| tr.recv(root, key, output).and_then(|lent| tr.give_back(lent).map(drop)));
    }
    // SAFETY: the op's buffers, nothing else's until it ends: the inputs, only
    // read, and the output, apart from them but for the root's own input
    // block, which may be the output (in place).
    let (sent, own) = unsafe { (others(inputs, rank), own_block(inputs[rank], output)) };
    // Start with the next rank so that concurrent scatters spread their load.
    let world = inputs.len();
    ctx.with_transfers(|tr| {
        for peer in (1..world).map(|k| (rank + k) % world) {
            tr.send(peer, key, sent[peer])?;
        }
        if let Some((from, to)) = own {
            ctx.copy_into(to, from);
        }
        tr.wait_all()
    })
}
