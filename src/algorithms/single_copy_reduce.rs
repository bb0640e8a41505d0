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

use super::call_check::{agree_with_all, Fingerprint};
use super::{reducing, OpCtx, RawBuf};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;
use crate::transport::Transfers;

/// `inputs[c]` is this rank's contribution to block c; `output` gets block `rank`.
pub fn single_copy_reduce_scatter(
    ctx: &OpCtx,
    inputs: &[RawBuf],
    output: RawBuf,
    dtype: DType,
    op: ReduceOp,
    check: &Fingerprint,
) -> Result<()> {
    let rank = ctx.transport.rank();
    let tr = &mut ctx.transfers();
    agree_with_all(ctx, tr, check)?;
    send_blocks(ctx, tr, inputs, 0)?;
    // SAFETY: `output` is in no transfer yet (folds into it come next); the
    // sends above only read inputs[p] for p != rank, and inputs[rank]
    // is only read here (in place the same memory: `copy` skips it).
    unsafe { ctx.copy(output, inputs[rank]) };
    fold_peers_blocks(ctx, tr, output, dtype, op)?;
    tr.wait_all()
}

/// All-reduce of `buf`, cut into W blocks of whole elements.
pub fn single_copy_allreduce(ctx: &OpCtx, buf: RawBuf, dtype: DType, op: ReduceOp, check: &Fingerprint) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let blocks = allreduce_blocks(buf, dtype, world);
    let tr = &mut ctx.transfers();
    agree_with_all(ctx, tr, check)?;
    send_blocks(ctx, tr, &blocks, 0)?;
    fold_peers_blocks(ctx, tr, blocks[rank], dtype, op)?;
    // A peer's block is overwritten only by the peer's reduced one, which it
    // sends after it has read (and folded) ours.
    for p in ctx.peers() {
        // SAFETY: blocks[p], p != rank, of the op's buffer. Its send above may
        // still count as pending, but peer p reads it (as its address) before
        // it folds and sends its reduced block, which is what fills this
        // receive: the transport is done reading it by then. No other receive
        // fills it.
        unsafe { tr.recv_raw(p, ctx.key(1), blocks[p].ptr, blocks[p].len)? };
    }
    for p in ctx.peers() {
        // SAFETY: this rank's reduced block, whose folds were all waited for; no
        // receive fills it, the sends only read it.
        unsafe { tr.send_raw(p, ctx.key(1), blocks[rank].slice(0, blocks[rank].len))? };
    }
    tr.wait_all()
}

/// Block c of an all-reduce's buffer: elements [c n / W, (c + 1) n / W).
fn allreduce_blocks(buf: RawBuf, dtype: DType, world: usize) -> Vec<RawBuf> {
    let (es, n) = (dtype.size(), buf.len / dtype.size());
    let start = |c: usize| c * n / world * es;
    (0..world).map(|c| buf.sub(start(c), start(c + 1) - start(c))).collect()
}

/// Send `blocks[p]` to every peer p (as its address: the peer reads it).
fn send_blocks(ctx: &OpCtx, tr: &mut Transfers, blocks: &[RawBuf], step: u64) -> Result<()> {
    for p in ctx.peers() {
        // SAFETY: blocks[p], p != rank, of the op's buffers: only read, by the
        // sends; nothing writes them before the peers have read them (see
        // `single_copy_allreduce`).
        unsafe { tr.send_raw(p, ctx.key(step), blocks[p].slice(0, blocks[p].len))? };
    }
    Ok(())
}

/// Fold every peer's block into `mine`, one peer at a time (folds into one
/// buffer must not run at once), then divide for AVG.
fn fold_peers_blocks(ctx: &OpCtx, tr: &mut Transfers, mine: RawBuf, dtype: DType, op: ReduceOp) -> Result<()> {
    let fold = reducing(dtype, op);
    for p in ctx.peers() {
        // SAFETY: `mine` is this rank's block (never sent from here), filled by one
        // fold at a time: each is waited for before the next is posted.
        let id = unsafe { tr.recv_folded_raw(p, ctx.key(0), mine.ptr, mine.len, Some(fold.clone()))? };
        tr.wait(id)?;
    }
    if op == ReduceOp::Avg {
        // SAFETY: every fold into `mine` was waited for: no transfer touches it.
        divide_by(dtype, unsafe { mine.slice_mut(0, mine.len) }, ctx.transport.size());
    }
    Ok(())
}
