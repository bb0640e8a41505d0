//! Ring allreduce: a reduce-scatter then an all-gather around the ring, each
//! chunk cut into segments so that sending, receiving and reducing overlap.
//! Every chunk is reduced by exactly one rank, so all ranks end bit-identical.
//! Reduce-scatter steps fold what arrives straight into the tensor as it is
//! read, so the peer's bytes never pass through scratch memory.
//!
//! Bytes copied (`Cost`), per rank, for n bytes in chunks of c = n/W:
//! 2(W-1)c (reduce-scatter: received and folded) + (W-1)c (all-gather:
//! received) + 2(W-1)c sent through the rings (0 with single copy).

use super::{reducing, OpCtx, RawBuf};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;
use crate::transport::{TransferId, Transfers};

pub fn ring_allreduce(ctx: &OpCtx, buf: RawBuf, dtype: DType, op: ReduceOp) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let es = dtype.size();
    let n = buf.len / es;
    if world == 1 || n == 0 {
        return Ok(());
    }
    let right = (rank + 1) % world;
    let left = (rank + world - 1) % world;

    // Chunk c holds elements [start(c), start(c + 1)); sizes differ by at most one.
    let start = |c: usize| c * n / world;
    let max_chunk = n.div_ceil(world);
    let seg_elems = (ctx.segment_bytes / es).max(1);
    let nseg = max_chunk.div_ceil(seg_elems);
    // Byte range of segment j of chunk c (possibly empty for short chunks).
    let segment = |c: usize, j: usize| {
        let clen = start(c + 1) - start(c);
        let lo = start(c) + (j * seg_elems).min(clen);
        let hi = start(c) + ((j + 1) * seg_elems).min(clen);
        (lo * es, (hi - lo) * es)
    };
    // Step t receives chunk (rank - t - 1) and sends chunk (rank - t), mod world.
    let incoming = |t: usize| (rank + 2 * world - t - 1) % world;
    let steps = 2 * (world - 1);
    let reduce_steps = world - 1;
    let key = |t: usize, j: usize| ctx.key((t * nseg + j) as u64);

    // Step t's chunk is neither sent nor folded into by any other step in flight.
    let fold = reducing(dtype, op);
    let tr = &mut ctx.transfers();
    let mut posted: [Vec<TransferId>; 2] = [Vec::new(), Vec::new()];
    let post = |tr: &mut Transfers, t: usize, posted: &mut [Vec<TransferId>; 2]| -> Result<()> {
        let c = incoming(t);
        let ids = &mut posted[t % 2];
        ids.clear();
        for j in 0..nseg {
            let (off, len) = segment(c, j);
            let folding = (t < reduce_steps).then(|| fold.clone());
            // SAFETY: segment j of chunk `incoming(t)` of the op's buffer (inside it:
            // `segment` stays within the chunk). While this receive is pending no
            // other step folds into or overwrites that chunk (posted steps t and
            // t + 1 take different chunks), and it is sent only once this receive
            // is waited for. In the all-gather steps it overwrites a chunk whose
            // send from the reduce-scatter steps may still count as pending: what
            // arrives there is that chunk's total, which the ring computes only
            // after the right neighbour has read what this rank sent, so the
            // transport is done reading it by then.
            ids.push(unsafe { tr.recv_folded_raw(left, key(t, j), buf.ptr.add(off), len, folding)? });
        }
        Ok(())
    };

    post(tr, 0, &mut posted)?;
    if steps > 1 {
        post(tr, 1, &mut posted)?;
    }
    for j in 0..nseg {
        let (off, len) = segment(rank, j);
        // SAFETY: this rank's own chunk, only read by the send; it is received
        // into only at step W - 1, with bytes that arrive after the right
        // neighbour has read these (see the receive above).
        unsafe { tr.send_raw(right, key(0, j), buf.slice(off, len))? };
    }
    for t in 0..steps {
        // Step t + 1's receives reuse the list of step t - 1's, all waited for.
        if t >= 1 && t + 1 < steps {
            post(tr, t + 1, &mut posted)?;
        }
        let c = incoming(t);
        for j in 0..nseg {
            tr.wait(posted[t % 2][j])?;
            let (off, len) = segment(c, j);
            if t == reduce_steps - 1 && op == ReduceOp::Avg {
                // SAFETY: the chunk's last fold was waited for just above and its send on
                // starts below: no transfer touches this segment meanwhile.
                divide_by(dtype, unsafe { buf.slice_mut(off, len) }, world);
            }
            if t + 1 < steps {
                // SAFETY: segment j of the chunk whose receive was waited for above; only
                // read by the send (later receives into it arrive after the right
                // neighbour has read it, see `post`).
                unsafe { tr.send_raw(right, key(t + 1, j), buf.slice(off, len))? };
            }
        }
    }
    tr.wait_all()
}
