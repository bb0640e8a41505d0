//! Ring allreduce: a reduce-scatter then an all-gather around the ring, each
//! chunk cut into segments so that sending, receiving and reducing overlap.
//! Every chunk is reduced by exactly one rank, so all ranks end bit-identical.
//! Reduce-scatter steps fold what arrives straight into the tensor as it is
//! read, so the peer's bytes never pass through scratch memory.
//!
//! Bytes copied (`Cost`), per rank, for n bytes in chunks of c = n/W:
//! 2(W-1)c (reduce-scatter: received and folded) + (W-1)c (all-gather:
//! received) + 2(W-1)c sent through the rings (0 with single copy).
//!
//! A chunk is sent and later received into again (its total, in the
//! all-gather steps): that receive is posted ahead of its message but
//! written only once the chunk's send is done (`Transfers::recv_after`), so
//! the slice goes from one transfer to the next without coming back.

use super::{reducing, take_front, OpCtx};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;
use crate::transport::{Fold, Key, Lent, Transfers};

/// Where a segment's memory is: here, or lent to a transfer.
enum Seg<'b> {
    Here(&'b mut [u8]),
    Lent(Lent<'b>),
}

pub fn ring_allreduce(ctx: &OpCtx, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let es = dtype.size();
    let n = buf.len() / es;
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
    // Bytes of segment j of chunk c (possibly none, for short chunks).
    let seg_bytes = |c: usize, j: usize| {
        let clen = start(c + 1) - start(c);
        (((j + 1) * seg_elems).min(clen) - (j * seg_elems).min(clen)) * es
    };
    // segs[c][j]: segment j of chunk c, cut once, in order.
    let mut rest = &mut buf[..];
    let mut segs: Vec<Vec<Option<Seg>>> = (0..world)
        .map(|c| (0..nseg).map(|j| Some(Seg::Here(take_front(&mut rest, seg_bytes(c, j))))).collect())
        .collect();
    // Step t receives chunk (rank - t - 1) and sends chunk (rank - t), mod world.
    let incoming = |t: usize| (rank + 2 * world - t - 1) % world;
    let steps = 2 * (world - 1);
    let reduce_steps = world - 1;
    let key = |t: usize, j: usize| ctx.key((t * nseg + j) as u64);
    let fold = reducing(dtype, op);
    // Step t's receives: folded in the reduce-scatter steps; each after
    // whatever transfer holds its segment (in the all-gather steps, the
    // chunk's send) is done. Posted a step ahead.
    let folding = |t: usize| (t < reduce_steps).then(|| fold.clone());
    ctx.with_transfers(|tr| {
        post(tr, &mut segs[incoming(0)], left, |j| key(0, j), folding(0))?;
        for (j, seg) in segs[rank].iter_mut().enumerate() {
            let mine = here(seg);
            *seg = Some(Seg::Lent(tr.send_mut(right, key(0, j), mine)?));
        }
        if steps > 1 {
            post(tr, &mut segs[incoming(1)], left, |j| key(1, j), folding(1))?;
        }
        for t in 0..steps {
            if t >= 1 && t + 1 < steps {
                post(tr, &mut segs[incoming(t + 1)], left, |j| key(t + 1, j), folding(t + 1))?;
            }
            for (j, seg) in segs[incoming(t)].iter_mut().enumerate() {
                let Some(Seg::Lent(received)) = seg.take() else { unreachable!("step {t} received segment {j}") };
                let s = tr.give_back(received)?;
                if t == reduce_steps - 1 && op == ReduceOp::Avg {
                    divide_by(dtype, s, world);
                }
                *seg = Some(match t + 1 < steps {
                    true => Seg::Lent(tr.send_mut(right, key(t + 1, j), s)?),
                    false => Seg::Here(s),
                });
            }
        }
        tr.wait_all()
    })
}

/// Post a receive from `peer` into each segment of `segs` (segment j with
/// `key(j)`), after the transfer that holds it, if any.
fn post<'b>(
    tr: &mut Transfers<'_, 'b>,
    segs: &mut [Option<Seg<'b>>],
    peer: usize,
    key: impl Fn(usize) -> Key,
    fold: Option<Fold>,
) -> Result<()> {
    for (j, seg) in segs.iter_mut().enumerate() {
        let lent = match seg.take().expect("a segment is in one transfer at a time") {
            Seg::Here(s) => tr.recv_folded(peer, key(j), s, fold.clone())?,
            Seg::Lent(held) => tr.recv_after(held, peer, key(j), fold.clone())?,
        };
        *seg = Some(Seg::Lent(lent));
    }
    Ok(())
}

/// The memory of a segment that is here.
fn here<'b>(seg: &mut Option<Seg<'b>>) -> &'b mut [u8] {
    match seg.take() {
        Some(Seg::Here(s)) => s,
        _ => unreachable!("a segment sent first is here"),
    }
}
