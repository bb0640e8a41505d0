//! Pipelined ring broadcast: the root streams segments to its right
//! neighbour, every other rank forwards each segment as soon as it lands.
//!
//! Bytes copied (`Cost`), for n bytes: the root n (sent through a ring);
//! every other rank n received, and all but the last n more forwarded through
//! a ring. With single copy the sends cost nothing: 0 at the root, n elsewhere.

use super::OpCtx;
use crate::error::Result;

pub fn ring_broadcast(ctx: &OpCtx, buf: &mut [u8], root: usize) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    if world == 1 || buf.is_empty() {
        return Ok(());
    }
    let pos = (rank + world - root) % world;
    let right = (rank + 1) % world;
    let left = (rank + world - 1) % world;
    let key = |j: usize| ctx.key(j as u64);
    ctx.with_transfers(|tr| {
        let segments = buf.chunks_mut(ctx.segment_bytes);
        if pos == 0 {
            for (j, s) in segments.enumerate() {
                tr.send(right, key(j), s)?;
            }
            return tr.wait_all();
        }
        // Every other rank receives each segment and, but the last, passes it on as it lands.
        let received = segments.enumerate().map(|(j, s)| tr.recv(left, key(j), s)).collect::<Result<Vec<_>>>()?;
        for (j, lent) in received.into_iter().enumerate() {
            let s = tr.give_back(lent)?;
            if pos != world - 1 {
                tr.send(right, key(j), s)?;
            }
        }
        tr.wait_all()
    })
}
