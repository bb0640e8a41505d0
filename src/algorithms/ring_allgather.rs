//! Ring all-gather: each rank's block travels once around the ring, cut into
//! segments, forwarded as soon as it lands. Every receive goes straight into
//! its final place, so all of them are posted up front. Blocks may differ in
//! size per rank (all-gather-v); every rank must expect the same sizes.
//!
//! Bytes copied (`Cost`), per rank, for blocks of b bytes: b (its own) +
//! (W-1)b received + (W-1)b forwarded through the rings (0 with single copy).

use super::{segment, segment_count, OpCtx, RawBuf};
use crate::error::Result;

/// `outputs[i]` receives rank i's `input` (`outputs[rank]` has `input.len` bytes).
pub fn ring_allgather(ctx: &OpCtx, input: RawBuf, outputs: &[RawBuf]) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    // SAFETY: before any transfer: outputs[rank] and the input are the op's
    // buffers (in place the same memory, which `copy` skips).
    unsafe { ctx.copy(outputs[rank], input) };
    if world == 1 {
        return Ok(());
    }
    let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
    let seg = ctx.segment_bytes;
    let nseg = |b: usize| segment_count(outputs[b].len, seg);
    let stride = (0..world).map(nseg).max().unwrap_or(1);
    let key = |t: usize, j: usize| ctx.key((t * stride + j) as u64);
    // Step t sends block (rank - t) and receives block (rank - t - 1).
    let block = |t: usize| (rank + 2 * world - t) % world;

    let tr = &mut ctx.transfers();
    let mut ids = Vec::with_capacity(world - 1);
    for t in 0..world - 1 {
        let b = block(t + 1);
        let step = (0..nseg(b))
            .map(|j| {
                let (off, n) = segment(outputs[b].len, seg, j);
                // SAFETY: segment j of outputs[b], b != rank (blocks rank - 1 down to
                // rank - W + 1, each received at one step only): filled by this receive
                // alone, and sent on only once it is waited for.
                unsafe { tr.recv(left, key(t, j), outputs[b].ptr.add(off), n) }
            })
            .collect::<Result<Vec<_>>>()?;
        ids.push(step);
    }
    for t in 0..world - 1 {
        let b = block(t);
        for j in 0..nseg(b) {
            if t > 0 {
                tr.wait(ids[t - 1][j])?;
            }
            let (off, n) = segment(outputs[b].len, seg, j);
            // SAFETY: segment j of outputs[b], only read by the send: b == rank at
            // step 0 (copied above, received into never), else its receive was
            // waited for just above; nothing writes an output block after that.
            unsafe { tr.send(right, key(t, j), outputs[b].slice(off, n))? };
        }
    }
    tr.wait_all()
}
