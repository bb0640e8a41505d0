//! Pipelined ring broadcast: the root streams segments to its right
//! neighbour, every other rank forwards each segment as soon as it lands.
//!
//! Bytes copied (`Cost`), for n bytes: the root n (sent through a ring);
//! every other rank n received, and all but the last n more forwarded through
//! a ring. With single copy the sends cost nothing: 0 at the root, n elsewhere.

use super::{OpCtx, RawBuf};
use crate::error::Result;

pub fn ring_broadcast(ctx: &OpCtx, buf: RawBuf, root: usize) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let segment_bytes = ctx.segment_bytes;
    if world == 1 || buf.len == 0 {
        return Ok(());
    }
    let pos = (rank + world - root) % world;
    let right = (rank + 1) % world;
    let left = (rank + world - 1) % world;
    let nseg = buf.len.div_ceil(segment_bytes);
    let segment = |j: usize| (j * segment_bytes, segment_bytes.min(buf.len - j * segment_bytes));

    let tr = &mut ctx.transfers();
    let mut ids = Vec::with_capacity(nseg);
    if pos != 0 {
        for j in 0..nseg {
            let (off, len) = segment(j);
            // SAFETY: segment j of the op's buffer (off + len <= buf.len), received
            // into by this transfer alone: the segments are disjoint, and this
            // rank sends a segment only after its receive is waited for.
            ids.push(unsafe { tr.recv(left, ctx.key(j as u64), buf.ptr.add(off), len)? });
        }
    }
    for j in 0..nseg {
        if pos != 0 {
            tr.wait(ids[j])?;
        }
        if pos != world - 1 {
            let (off, len) = segment(j);
            // SAFETY: segment j of the op's buffer, only read by the send: at the
            // root nothing writes the buffer; elsewhere segment j's receive was
            // waited for above, and later receives fill other segments.
            unsafe { tr.send(right, ctx.key(j as u64), buf.slice(off, len))? };
        }
    }
    tr.wait_all()
}
