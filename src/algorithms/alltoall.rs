//! All-to-all: every pair exchanges its blocks directly. All receives are
//! posted first, then sends go out starting with the next rank, so that no
//! peer is hit by everyone at once.
//!
//! Block sizes differ per pair, so the call check cannot compare them; first
//! every rank tells every other the sizes of the blocks it sends and expects
//! (`agree_on_block_sizes`). Each rank then sees every pair's, and finds the
//! same first disagreement as every other: all raise before any data moves,
//! not only the receiver of a block that does not fit, after the others
//! have returned success.
//!
//! Bytes copied (`Cost`), per rank: its own block, the W-1 blocks received,
//! and the W-1 sent through the rings (none where peers read them from its memory).

use super::call_check::mismatch_across;
use super::{others, others_mut, own_block, OpCtx, RawBuf};
use crate::error::Result;

/// `inputs[p]` goes to rank p, `outputs[p]` comes from rank p (sizes may differ per pair).
pub fn pairwise_alltoall(ctx: &OpCtx, inputs: &[RawBuf], outputs: &[RawBuf]) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    agree_on_block_sizes(ctx, inputs, outputs)?;
    // SAFETY: the op's buffers (see `RawBuf`), nothing else's until it ends:
    // inputs only read, outputs written, apart from each other but for this
    // rank's own block, which may be one memory (in place).
    let (sent, mut received, own) =
        unsafe { (others(inputs, rank), others_mut(outputs, rank), own_block(inputs[rank], outputs[rank])) };
    let key = ctx.key(0);
    let peers = || (1..world).map(|k| (rank + k) % world);
    ctx.with_transfers(|tr| {
        for (p, block) in received.iter_mut().enumerate().filter(|&(p, _)| p != rank) {
            // Given back with the scope, which waits for it.
            let _lent = tr.recv(p, key, block)?;
        }
        for p in peers() {
            tr.send(p, key, sent[p])?;
        }
        if let Some((from, to)) = own {
            ctx.copy_into(to, from);
        }
        tr.wait_all()
    })
}

/// Check that every rank sends each other rank as many bytes as that rank
/// expects from it (see the top of this file): one message to and from
/// every rank, of W sizes sent and W expected. Peers' sizes are only
/// compared, never used.
fn agree_on_block_sizes(ctx: &OpCtx, inputs: &[RawBuf], outputs: &[RawBuf]) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let sizes = |bufs: &[RawBuf]| bufs.iter().map(|b| b.len as u64).collect::<Vec<_>>();
    let (mine_sent, mine_expected) = (sizes(inputs), sizes(outputs));
    let message: Vec<u8> = mine_sent.iter().chain(&mine_expected).flat_map(|n| n.to_le_bytes()).collect();
    let key = ctx.key(1);
    let tr = &mut ctx.transfers();
    let ids = ctx.peers().map(|p| Ok((p, tr.recv_owned(p, key, message.len())?))).collect::<Result<Vec<_>>>()?;
    for p in ctx.peers() {
        tr.send_copy(p, key, &message)?;
    }
    // sent[s][d]: what rank s sends rank d; expected[d][s]: what d expects from s.
    let (mut sent, mut expected) = (vec![Vec::new(); world], vec![Vec::new(); world]);
    (sent[rank], expected[rank]) = (mine_sent, mine_expected);
    for (p, id) in ids {
        // A finished receive holds exactly 2 W words: one of another length fails at its header.
        tr.wait(id)?;
        let words: Vec<u64> =
            tr.received(id).chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))).collect();
        let (s, e) = words.split_at(world);
        (sent[p], expected[p]) = (s.to_vec(), e.to_vec());
    }
    tr.wait_all()?;
    let pairs = (0..world).flat_map(|s| (0..world).map(move |d| (s, d)));
    match pairs.filter(|(s, d)| s != d).find(|&(s, d)| sent[s][d] != expected[d][s]) {
        Some((s, d)) => Err(mismatch_across(
            ctx,
            if rank == s { d } else { s },
            format!("rank {s} sends {} bytes to rank {d}, which expects {}", sent[s][d], expected[d][s]),
        )),
        None => Ok(()),
    }
}
