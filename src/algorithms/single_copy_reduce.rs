//! Reduce-scatter and all-reduce in at most two steps when every rank reads
//! the others' memory (`Transport::single_copy_bytes`), instead of the ring's
//! W-1 and 2(W-1): every rank sends block c of its data to rank c as its
//! address, and folds every peer's contribution to its own block as it reads
//! it, one peer after the other (in a fixed order, from the next rank on, so
//! that ranks do not all read the same rank at once). All-reduce then sends
//! each reduced block to every rank, which reads it straight into place.
//! Every block is reduced by one rank, so all ranks end bit-identical. The
//! calls are checked with every rank before any data moves (see call_check).
//!
//! Bytes copied per rank, for blocks of c bytes: reduce-scatter c (its own
//! contribution to its output) + 2(W-1)c (each peer's block read and
//! folded); all-reduce 3(W-1)c (the same folds, then the W-1 reduced blocks
//! read), as much as the ring's with single copy.
//!
//! All-reduce receives the peers' reduced blocks into the blocks it sent
//! them: each receive is posted once its block's send is done (the peer has
//! read it), `Transfers::recv_after`.

use super::call_check::{agree_with_all, Fingerprint};
use super::pipeline::pieces_mut;
use super::{reducing, OpCtx};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;
use crate::transport::Transfers;

/// `inputs[c]` is this rank's contribution to block c (its own, `inputs[rank]`,
/// is `own`, or None in place: what `output` holds); `output` gets block `rank`.
pub fn single_copy_reduce_scatter(
    ctx: &OpCtx,
    (inputs, own): (&[&[u8]], Option<&[u8]>),
    output: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    check: &Fingerprint,
) -> Result<()> {
    ctx.with_transfers(|tr| {
        agree_with_all(ctx, tr, check)?;
        for p in ctx.peers() {
            tr.send(p, ctx.key(0), inputs[p])?;
        }
        if let Some(own) = own {
            ctx.copy_into(output, own);
        }
        fold_peers_blocks(ctx, tr, output, dtype, op)?;
        tr.wait_all()
    })
}

/// All-reduce of `buf`, cut into W blocks of whole elements (block c:
/// elements [c n / W, (c + 1) n / W)).
pub fn single_copy_allreduce(
    ctx: &OpCtx,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    check: &Fingerprint,
) -> Result<()> {
    let rank = ctx.transport.rank();
    let mut blocks: Vec<Option<&mut [u8]>> =
        pieces_mut(buf, dtype.size(), ctx.transport.size()).into_iter().map(Some).collect();
    let mine = blocks[rank].take().expect("this rank's block");
    ctx.with_transfers(|tr| {
        agree_with_all(ctx, tr, check)?;
        let mut sent = Vec::new();
        for p in ctx.peers() {
            let block = blocks[p].take().expect("each block is sent once");
            sent.push((p, tr.send_mut(p, ctx.key(0), block)?));
        }
        let mine: &[u8] = fold_peers_blocks(ctx, tr, mine, dtype, op)?;
        // A peer's block is overwritten by the peer's reduced one, once the
        // peer has read (and folded) ours.
        for (p, block) in sent {
            // Given back with the scope, which waits for it.
            let _lent = tr.recv_after(block, p, ctx.key(1), None)?;
        }
        for p in ctx.peers() {
            tr.send(p, ctx.key(1), mine)?;
        }
        tr.wait_all()
    })
}

/// Fold every peer's block into `mine`, one peer at a time (folds into one
/// buffer must not run at once), then divide for AVG; `mine` back.
fn fold_peers_blocks<'b>(
    ctx: &OpCtx,
    tr: &mut Transfers<'_, 'b>,
    mut mine: &'b mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<&'b mut [u8]> {
    let fold = reducing(dtype, op);
    for p in ctx.peers() {
        let lent = tr.recv_folded(p, ctx.key(0), mine, Some(fold.clone()))?;
        mine = tr.give_back(lent)?;
    }
    if op == ReduceOp::Avg {
        divide_by(dtype, mine, ctx.transport.size());
    }
    Ok(mine)
}
