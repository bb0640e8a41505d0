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
use super::{split_own, OpCtx};
use crate::error::Result;

/// `inputs[p]` goes to rank p (this rank's own is `own`, or in place (None)
/// what `outputs[rank]` holds), `outputs[p]` comes from rank p (sizes may
/// differ per pair).
pub fn pairwise_alltoall(ctx: &OpCtx, inputs: &[&[u8]], own: Option<&[u8]>, outputs: &mut [&mut [u8]]) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let input = |p: usize| if p == rank { own.unwrap_or(outputs[rank]) } else { inputs[p] };
    let sent = (0..world).map(|p| input(p).len() as u64).collect();
    let expected = outputs.iter().map(|o| o.len() as u64).collect();
    agree_on_block_sizes(ctx, sent, expected)?;
    let key = ctx.key(0);
    let (received, mine) = split_own(outputs, rank);
    ctx.with_transfers(|tr| {
        for (p, block) in received {
            // Given back with the scope, which waits for it.
            let _lent = tr.recv(p, key, block)?;
        }
        for p in ctx.peers() {
            tr.send(p, key, inputs[p])?;
        }
        if let Some(from) = own {
            ctx.copy_into(mine, from);
        }
        tr.wait_all()
    })
}

/// Check that every rank sends each other rank as many bytes as that rank
/// expects from it (see the top of this file): one message to and from
/// every rank, of W sizes sent and W expected. Peers' sizes are only
/// compared, never used.
fn agree_on_block_sizes(ctx: &OpCtx, mine_sent: Vec<u64>, mine_expected: Vec<u64>) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
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
