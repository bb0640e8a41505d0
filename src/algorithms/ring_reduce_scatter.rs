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

use super::{reducing, segment, segment_count, segments_mut, OpCtx};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;
use crate::transport::{Fold, Key, Lent, Transfers};

/// `inputs[c]` is this rank's contribution to block c (its own, `inputs[rank]`,
/// is `own`, or None in place: what `output` holds); `output` gets block
/// `rank`.
pub fn ring_reduce_scatter(
    ctx: &OpCtx,
    inputs: &[&[u8]],
    own: Option<&[u8]>,
    output: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let lens: Vec<usize> = (0..world).map(|c| if c == rank { output.len() } else { inputs[c].len() }).collect();
    // The output starts as this rank's own block (the last step's).
    if let Some(own) = own {
        ctx.copy_into(output, own);
    }
    if world == 1 {
        return Ok(());
    }
    let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
    let len = |c: usize| lens[c];
    // Whole elements per segment, so reductions never split one.
    let seg = (ctx.segment_bytes / dtype.size()).max(1) * dtype.size();
    let nseg = |c: usize| segment_count(len(c), seg);
    let stride = (0..world).map(nseg).max().unwrap_or(1);
    let steps = world - 1;
    let key = &|t: usize, j: usize| ctx.key((t * stride + j) as u64);
    // Step t sends the partial of block (rank - t - 1) and receives block (rank - t - 2).
    let block = |t: usize| (rank + 3 * world - t - 1) % world;

    // Three rotating partial buffers, cut into segments once (every block's
    // segment j is the head of segment j of the largest): a buffer's
    // segments are refilled two steps after its partials were queued for
    // sending, once those sends have given them back.
    let partials = if steps > 1 { (0..world).map(len).max().unwrap_or(0) } else { 0 };
    let mut scratch = [ctx.scratch(partials), ctx.scratch(partials), ctx.scratch(partials)];
    let mut free: Vec<Vec<Option<&mut [u8]>>> =
        scratch.iter_mut().map(|s| segments_mut(s.bytes_mut(), seg).into_iter().map(Some).collect()).collect();
    let mut out: Vec<Option<&mut [u8]>> = segments_mut(output, seg).into_iter().map(Some).collect();
    let fold = reducing(dtype, op);
    ctx.with_transfers(|tr| {
        // Step t receives block(t + 1): into the output at the last step (its
        // partials folded straight in), else into partial buffer t % 3.
        let last = |t: usize| t + 1 == steps;
        let msgs = |t: usize| {
            let c = block(t + 1);
            (0..nseg(c)).map(move |j| (key(t, j), segment(len(c), seg, j).1))
        };
        let fold_at = |t: usize| last(t).then(|| fold.clone());
        let mut recvs: Vec<Vec<Lent>> = (0..steps).map(|_| Vec::new()).collect();
        // sends[t]: the partials sent at step t (t >= 1), from buffer (t - 1) % 3.
        let mut sends: Vec<Vec<Lent>> = (0..=steps).map(|_| Vec::new()).collect();
        recvs[0] = lend_receives(tr, left, if last(0) { &mut out } else { &mut free[0] }, msgs(0), fold_at(0))?;
        for j in 0..nseg(block(0)) {
            let (off, n) = segment(len(block(0)), seg, j);
            tr.send(right, key(0, j), &inputs[block(0)][off..off + n])?;
        }
        for t in 0..steps {
            if t + 1 < steps {
                // Buffer (t + 1) % 3 last held the partials sent at step t - 1.
                if t >= 2 {
                    for (j, sent) in std::mem::take(&mut sends[t - 1]).into_iter().enumerate() {
                        free[(t + 1) % 3][j] = Some(tr.give_back(sent)?);
                    }
                }
                let parts = if last(t + 1) { &mut out } else { &mut free[(t + 1) % 3] };
                recvs[t + 1] = lend_receives(tr, left, parts, msgs(t + 1), fold_at(t + 1))?;
            }
            let c = block(t + 1);
            for (j, received) in std::mem::take(&mut recvs[t]).into_iter().enumerate() {
                let part = tr.give_back(received)?;
                let (off, n) = segment(len(c), seg, j);
                if t + 1 == steps {
                    if op == ReduceOp::Avg {
                        divide_by(dtype, part, world);
                    }
                } else {
                    ctx.reduce_into(dtype, op, &mut part[..n], &inputs[c][off..off + n]);
                    sends[t + 1].push(tr.send_head(right, key(t + 1, j), part, n)?);
                }
            }
        }
        tr.wait_all()
    })
}

/// Lend `parts[j]` to the receive of message j, (key, bytes) in `msgs`,
/// from `peer`, folding it in with `fold` where there is one.
fn lend_receives<'b>(
    tr: &mut Transfers<'_, 'b>,
    peer: usize,
    parts: &mut [Option<&'b mut [u8]>],
    msgs: impl Iterator<Item = (Key, usize)>,
    fold: Option<Fold>,
) -> Result<Vec<Lent<'b>>> {
    let lend = |(j, (key, n))| {
        let part = Option::take(&mut parts[j]).expect("a segment is lent again only once it is back");
        tr.recv_head(peer, key, part, n, fold.clone())
    };
    msgs.enumerate().map(lend).collect()
}
