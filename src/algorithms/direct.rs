//! Gather and scatter: every rank talks to the root directly (one message per
//! rank), which is what the root's link has to carry anyway.
//!
//! Bytes copied (`Cost`), for blocks of b bytes: the root Wb (its own block,
//! and the W-1 others received); every other rank b (its block, sent through
//! a ring; 0 where the root reads it from its memory).

use super::{split_own, OpCtx};
use crate::error::Result;

/// At the root, `outputs[i]` receives rank i's input (this rank's: `own`,
/// or in place (None) what `outputs[root]` holds); elsewhere `outputs` is
/// empty and `own` the input.
pub fn direct_gather(ctx: &OpCtx, own: Option<&[u8]>, outputs: &mut [&mut [u8]], root: usize) -> Result<()> {
    let rank = ctx.transport.rank();
    let key = ctx.key(0);
    if rank != root {
        let input = own.expect("a rank other than the root has its input");
        return ctx.with_transfers(|tr| tr.send(root, key, input).and_then(|_| tr.wait_all()));
    }
    let (received, mine) = split_own(outputs, rank);
    ctx.with_transfers(|tr| {
        for (peer, block) in received {
            // Given back with the scope, which waits for it.
            let _lent = tr.recv(peer, key, block)?;
        }
        if let Some(input) = own {
            ctx.copy_into(mine, input);
        }
        tr.wait_all()
    })
}

/// At the root, `inputs[i]` goes to rank i's `output` (its own, `inputs[root]`,
/// is `own`, or None in place: what `output` holds); elsewhere `inputs` is
/// empty.
pub fn direct_scatter(ctx: &OpCtx, inputs: &[&[u8]], own: Option<&[u8]>, output: &mut [u8], root: usize) -> Result<()> {
    let rank = ctx.transport.rank();
    let key = ctx.key(0);
    if rank != root {
        return ctx.with_transfers(|tr| tr.recv(root, key, output).and_then(|lent| tr.give_back(lent).map(drop)));
    }
    // Start with the next rank so that concurrent scatters spread their load.
    let world = inputs.len();
    ctx.with_transfers(|tr| {
        for peer in (1..world).map(|k| (rank + k) % world) {
            tr.send(peer, key, inputs[peer])?;
        }
        if let Some(input) = own {
            ctx.copy_into(output, input);
        }
        tr.wait_all()
    })
}
