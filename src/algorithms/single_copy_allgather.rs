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
use super::{split_own, OpCtx};
use crate::error::Result;

/// `outputs[i]` receives rank i's input: `own`, or, in place (None), what
/// `outputs[rank]` holds.
pub fn single_copy_allgather(
    ctx: &OpCtx,
    own: Option<&[u8]>,
    outputs: &mut [&mut [u8]],
    check: &Fingerprint,
) -> Result<()> {
    let rank = ctx.transport.rank();
    let (received, mine) = split_own(outputs, rank);
    ctx.with_transfers(|tr| {
        agree_with_all(ctx, tr, check)?;
        for (p, block) in received {
            // Given back with the scope, which waits for it.
            let _lent = tr.recv(p, ctx.key(0), block)?;
        }
        match own {
            Some(input) => {
                for p in ctx.peers() {
                    tr.send(p, ctx.key(0), input)?;
                }
                ctx.copy_into(mine, input);
            }
            None => {
                let mine: &[u8] = mine;
                for p in ctx.peers() {
                    tr.send(p, ctx.key(0), mine)?;
                }
            }
        }
        tr.wait_all()
    })
}
