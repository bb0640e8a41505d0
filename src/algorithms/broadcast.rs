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
    if world == 1 || buf.len == 0 {
        return Ok(());
    }
    // SAFETY: the op's buffer, which this rank's transfers below alone touch.
    let buf = unsafe { buf.slice_mut(0, buf.len) };
    let pos = (rank + world - root) % world;
    let right = (rank + 1) % world;
    let left = (rank + world - 1) % world;
    let key = |j: usize| ctx.key(j as u64);
    ctx.with_transfers(|tr| {
        // Every rank but the root receives each segment, then forwards it
        // (but the last); the root only sends.
        let segments = buf.chunks_mut(ctx.segment_bytes);
        let lent = match pos {
            0 => segments.map(Ok).collect::<Vec<_>>(),
            _ => segments.enumerate().map(|(j, s)| tr.recv(left, key(j), s).map(Err)).collect::<Result<_>>()?,
        };
        for (j, segment) in lent.into_iter().enumerate() {
            let segment = match segment {
                Ok(s) => s,
                Err(lent) => tr.give_back(lent)?,
            };
            if pos != world - 1 {
                tr.send(right, key(j), segment)?;
            }
        }
        tr.wait_all()
    })
}
