//! Ring all-gather: each rank's block travels once around the ring, cut into
//! segments, forwarded as soon as it lands. Every receive goes straight into
//! its final place, so all of them are posted up front.

use super::{copy_buf, segment, segment_count, OpCtx, RawBuf};
use crate::error::Result;
use crate::transport::Key;

/// `outputs[i]` receives rank i's `input`; all blocks have `input.len` bytes.
pub fn ring_allgather(ctx: &OpCtx, input: RawBuf, outputs: &[RawBuf]) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    unsafe { copy_buf(outputs[rank], input) };
    if world == 1 {
        return Ok(());
    }
    let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
    let len = input.len;
    let nseg = segment_count(len, ctx.segment_bytes);
    let key = |t: usize, j: usize| Key::collective(ctx.seq, (t * nseg + j) as u64);
    // Step t sends block (rank - t) and receives block (rank - t - 1).
    let block = |t: usize| (rank + 2 * world - t) % world;

    let tr = &mut ctx.transfers();
    let mut ids = Vec::with_capacity((world - 1) * nseg);
    for t in 0..world - 1 {
        let dst = outputs[block(t + 1)];
        for j in 0..nseg {
            let (off, n) = segment(len, ctx.segment_bytes, j);
            ids.push(unsafe { tr.recv(left, key(t, j), dst.ptr.add(off), n)? });
        }
    }
    for t in 0..world - 1 {
        let src = outputs[block(t)];
        for j in 0..nseg {
            if t > 0 {
                tr.wait(ids[(t - 1) * nseg + j])?;
            }
            let (off, n) = segment(len, ctx.segment_bytes, j);
            unsafe { tr.send(right, key(t, j), src.slice(off, n))? };
        }
    }
    tr.wait_all()
}
