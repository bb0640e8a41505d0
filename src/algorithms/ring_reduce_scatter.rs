//! Ring reduce-scatter, out of place: the partial sum of block c travels the
//! ring and each rank adds its own contribution, so each rank sends (W-1)/W of
//! the data, and rank r ends with block r fully reduced. Inputs stay untouched,
//! but for this rank's own block where the output is that very block (the
//! hierarchical all-reduce reduces its chunks in place so). Blocks may differ
//! in size (every rank must give the same sizes). The last step folds the
//! arriving partials straight into the output, which already holds this
//! rank's own block.
//!
//! Bytes copied (`Cost`), per rank, for blocks of b bytes: b (its own block
//! into the output) + 2(W-1)b (each step's partial received and folded) +
//! (W-1)b sent through the rings (0 with single copy).

use super::{reducing, segment, segment_count, OpCtx, RawBuf};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;
use crate::transport::TransferId;

/// `inputs[c]` is this rank's contribution to block c; `output` gets block
/// `rank` (as long as `inputs[rank]`; it may be `inputs[rank]` itself).
pub fn ring_reduce_scatter(ctx: &OpCtx, inputs: &[RawBuf], output: RawBuf, dtype: DType, op: ReduceOp) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    if world == 1 {
        // SAFETY: one rank: no transfers; `output` and inputs[0] are the op's
        // buffers (in place the same memory, which `copy` skips).
        unsafe { ctx.copy(output, inputs[0]) };
        return Ok(());
    }
    let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
    assert_eq!(output.len, inputs[rank].len, "ring_reduce_scatter: the output holds this rank's block");
    let len = |c: usize| inputs[c].len;
    // Whole elements per segment, so reductions never split one.
    let seg = (ctx.segment_bytes / dtype.size()).max(1) * dtype.size();
    let nseg = |c: usize| segment_count(len(c), seg);
    let stride = (0..world).map(nseg).max().unwrap_or(1);
    let steps = world - 1;
    let key = |t: usize, j: usize| ctx.key((t * stride + j) as u64);
    // Step t sends the partial of block (rank - t - 1) and receives block (rank - t - 2).
    let block = |t: usize| (rank + 3 * world - t - 1) % world;

    // Three rotating partial buffers: a buffer is refilled two steps after its
    // partials were queued for sending, and only once those sends are done.
    let partials = if steps > 1 { (0..world).map(len).max().unwrap_or(0) } else { 0 };
    let mut scratch = [ctx.scratch(partials), ctx.scratch(partials), ctx.scratch(partials)];
    let bufs = [scratch[0].raw(), scratch[1].raw(), scratch[2].raw()];
    let tr = &mut ctx.transfers();
    let mut recvs: Vec<Vec<TransferId>> = vec![Vec::new(); steps];
    let mut sends: Vec<Vec<TransferId>> = vec![Vec::new(); steps + 1];
    // The last step's block is this rank's own: start the output from it.
    // SAFETY: before any receive into `output` is posted (the first `post`
    // follows); inputs[rank] is never sent, only read here.
    unsafe { ctx.copy(output, inputs[rank]) };
    let fold = reducing(dtype, op);
    // Step t receives block(t + 1).
    let post = |tr: &mut super::Transfers, t: usize| -> Result<Vec<TransferId>> {
        let c = block(t + 1);
        (0..nseg(c))
            .map(|j| {
                let (off, n) = segment(len(c), seg, j);
                if t + 1 == steps {
                    // SAFETY: segment j of `output` at the last step, the only transfer into
                    // it; nothing else touches it until the receive is waited for.
                    unsafe { tr.recv_folded_raw(left, key(t, j), output.ptr.add(off), n, Some(fold.clone())) }
                } else {
                    // SAFETY: segment j of partial buffer t % 3 (scratch as large as the
                    // largest block): its previous partials, sent at step t - 3, were
                    // waited for before this post (see the loop), so only this receive
                    // touches it.
                    unsafe { tr.recv_raw(left, key(t, j), bufs[t % 3].ptr.add(off), n) }
                }
            })
            .collect()
    };

    recvs[0] = post(tr, 0)?;
    for j in 0..nseg(block(0)) {
        let (off, n) = segment(len(block(0)), seg, j);
        // SAFETY: segment j of the op's input block(0) != rank: only read, by this
        // send; inputs are never written (but inputs[rank], never sent).
        sends[0].push(unsafe { tr.send_raw(right, key(0, j), inputs[block(0)].slice(off, n))? });
    }
    for t in 0..steps {
        if t + 1 < steps {
            // bufs[(t + 1) % 3] last held the partials sent at step t - 2.
            if t >= 2 {
                for &id in &sends[t - 1] {
                    tr.wait(id)?;
                }
            }
            recvs[t + 1] = post(tr, t + 1)?;
        }
        let c = block(t + 1);
        let last = t + 1 == steps;
        for j in 0..nseg(c) {
            tr.wait(recvs[t][j])?;
            let (off, n) = segment(len(c), seg, j);
            if last {
                if op == ReduceOp::Avg {
                    // SAFETY: the last fold into this segment of `output` was waited for just
                    // above; no transfer touches it now.
                    divide_by(dtype, unsafe { output.slice_mut(off, n) }, world);
                }
            } else {
                // SAFETY: the receive into this segment of partial t % 3 was waited for
                // above; it is sent (below) only after this fold.
                let partial = unsafe { bufs[t % 3].slice_mut(off, n) };
                // SAFETY: inputs[c], c != rank (c is received at a step before the last):
                // only read, and other memory than the partial (scratch).
                let mine = unsafe { inputs[c].slice(off, n) };
                ctx.reduce_into(dtype, op, partial, mine);
                // SAFETY: `partial` is not written again until its buffer is refilled,
                // three steps on, after this send is waited for.
                sends[t + 1].push(unsafe { tr.send_raw(right, key(t + 1, j), partial)? });
            }
        }
    }
    tr.wait_all()
}
