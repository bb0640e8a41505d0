//! Pipelined chain reduce: partial results flow around the ring from the
//! rank after the root to the root, segment by segment. Each link carries the
//! data once; only the root's buffer is written.
//!
//! Bytes copied (`Cost`), for n bytes: the first rank of the chain n (sent;
//! 0 with single copy); every other rank n received and n folded, and all
//! but the root n more sent (0 with single copy).

use super::{segments_mut, OpCtx};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;

pub fn ring_reduce(ctx: &OpCtx, buf: &mut [u8], root: usize, dtype: DType, op: ReduceOp) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    if world == 1 {
        return Ok(());
    }
    let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
    // Position in the chain: 0 starts it, world - 1 is the root.
    let pos = (rank + 2 * world - root - 1) % world;
    let seg = (ctx.segment_bytes / dtype.size()).max(1) * dtype.size();
    let key = |j: usize| ctx.key(j as u64);

    let mut scratch = ctx.scratch(if pos == 0 { 0 } else { buf.len() });
    ctx.with_transfers(|tr| {
        if pos == 0 {
            for (j, mine) in segments_mut(buf, seg).into_iter().enumerate() {
                tr.send(right, key(j), mine)?;
            }
            return tr.wait_all();
        }
        // Every segment of the partial result comes into scratch, is folded
        // with this rank's, and goes on (into the root's buffer at the root).
        let received = segments_mut(scratch.bytes_mut(), seg)
            .into_iter()
            .enumerate()
            .map(|(j, s)| tr.recv(left, key(j), s))
            .collect::<Result<Vec<_>>>()?;
        for ((j, lent), mine) in received.into_iter().enumerate().zip(segments_mut(buf, seg)) {
            let theirs = tr.give_back(lent)?;
            if pos == world - 1 {
                ctx.reduce_into(dtype, op, mine, theirs);
                if op == ReduceOp::Avg {
                    divide_by(dtype, mine, world);
                }
            } else {
                ctx.reduce_into(dtype, op, theirs, mine);
                tr.send(right, key(j), theirs)?;
            }
        }
        tr.wait_all()
    })
}
