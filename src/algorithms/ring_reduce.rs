//! Pipelined chain reduce: partial results flow around the ring from the
//! rank after the root to the root, segment by segment. Each link carries the
//! data once; only the root's buffer is written.
//!
//! Bytes copied (`Cost`), for n bytes: the first rank of the chain n (sent;
//! 0 with single copy); every other rank n received and n folded, and all
//! but the root n more sent (0 with single copy).

use super::{segment, segment_count, OpCtx, RawBuf};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;

pub fn ring_reduce(ctx: &OpCtx, buf: RawBuf, root: usize, dtype: DType, op: ReduceOp) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    if world == 1 {
        return Ok(());
    }
    let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
    // Position in the chain: 0 starts it, world - 1 is the root.
    let pos = (rank + 2 * world - root - 1) % world;
    let seg = (ctx.segment_bytes / dtype.size()).max(1) * dtype.size();
    let nseg = segment_count(buf.len, seg);
    let key = |j: usize| ctx.key(j as u64);

    let mut scratch = ctx.scratch(if pos == 0 { 0 } else { buf.len });
    let partial = scratch.raw();
    let tr = &mut ctx.transfers();
    let ids = if pos == 0 {
        Vec::new()
    } else {
        (0..nseg)
            .map(|j| {
                let (off, n) = segment(buf.len, seg, j);
                // SAFETY: segment j of the scratch (buf.len bytes, taken before `tr`),
                // filled by this receive alone; each segment is received once.
                unsafe { tr.recv(left, key(j), partial.ptr.add(off), n) }
            })
            .collect::<Result<Vec<_>>>()?
    };
    for j in 0..nseg {
        let (off, n) = segment(buf.len, seg, j);
        if pos == 0 {
            // SAFETY: the first rank of the chain only reads its buffer (it receives
            // nothing): segment j of the op's buffer, unchanged until `tr` is done.
            unsafe { tr.send(right, key(j), buf.slice(off, n))? };
            continue;
        }
        tr.wait(ids[j])?;
        // SAFETY: segment j of the scratch, whose receive was just waited for; it
        // is sent on (below) only after this fold.
        let theirs = unsafe { partial.slice_mut(off, n) };
        if pos == world - 1 {
            // SAFETY: the root's buffer: it sends nothing from it and receives into
            // scratch, so segment j is touched by this fold alone.
            let mine = unsafe { buf.slice_mut(off, n) };
            ctx.reduce_into(dtype, op, mine, theirs);
            if op == ReduceOp::Avg {
                divide_by(dtype, mine, world);
            }
        } else {
            // SAFETY: segment j of the op's buffer, only read (ranks between the first
            // and the root never write it); other memory than `theirs` (scratch).
            ctx.reduce_into(dtype, op, theirs, unsafe { buf.slice(off, n) });
            // SAFETY: `theirs` is scratch segment j, received and folded above and
            // never written again during the op.
            unsafe { tr.send(right, key(j), theirs)? };
        }
    }
    tr.wait_all()
}
