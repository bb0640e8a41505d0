//! Ring all-gather: each rank's block travels once around the ring, cut into
//! segments, forwarded as soon as it lands. Every receive goes straight into
//! its final place, so all of them are posted up front. Blocks may differ in
//! size per rank (all-gather-v); every rank must expect the same sizes.
//!
//! Bytes copied (`Cost`), per rank, for blocks of b bytes: b (its own) +
//! (W-1)b received + (W-1)b forwarded through the rings (0 with single copy).

use super::{segment_count, segments_mut, OpCtx};
use crate::error::Result;

/// `outputs[i]` receives rank i's input: `own`, or, in place (None), what
/// `outputs[rank]` holds.
pub fn ring_allgather(ctx: &OpCtx, own: Option<&[u8]>, outputs: &mut [&mut [u8]]) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    if let Some(input) = own {
        ctx.copy_into(outputs[rank], input);
    }
    if world == 1 {
        return Ok(());
    }
    let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
    let seg = ctx.segment_bytes;
    let lens: Vec<usize> = outputs.iter().map(|o| o.len()).collect();
    let nseg = |b: usize| segment_count(lens[b], seg);
    let stride = (0..world).map(nseg).max().unwrap_or(1);
    let key = |t: usize, j: usize| ctx.key((t * stride + j) as u64);
    // Step t sends block (rank - t) and receives block (rank - t - 1).
    let block = |t: usize| (rank + 2 * world - t) % world;

    let mut blocks: Vec<Option<&mut [u8]>> = outputs.iter_mut().map(|b| Some(&mut **b)).collect();
    let mut take = |b: usize| segments_mut(blocks[b].take().expect("each block is received at one step only"), seg);
    ctx.with_transfers(|tr| {
        let own = take(rank);
        let received = (0..world - 1)
            .map(|t| take(block(t + 1)).into_iter().enumerate().map(|(j, s)| tr.recv(left, key(t, j), s)).collect())
            .collect::<Result<Vec<Vec<_>>>>()?;
        for (j, s) in own.into_iter().enumerate() {
            tr.send(right, key(0, j), s)?;
        }
        // What step t received is sent on at step t + 1, segment by segment
        // as it lands (but at the last step).
        for (t, step) in received.into_iter().enumerate() {
            for (j, lent) in step.into_iter().enumerate() {
                let s = tr.give_back(lent)?;
                if t + 1 < world - 1 {
                    tr.send(right, key(t + 1, j), s)?;
                }
            }
        }
        tr.wait_all()
    })
}
