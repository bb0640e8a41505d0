//! Hierarchical all-reduce, for a group of H hosts with L ranks each: a
//! reduce-scatter among each host's ranks leaves its i-th rank with the
//! host's sum of chunk i (1/L of the buffer); the i-th ranks of all hosts
//! all-reduce that chunk around a ring of their own; an all-gather among each
//! host's ranks hands every rank the other chunks. Each host's link carries
//! 2(H-1)/H of the buffer each way, where one ring over all W ranks carries
//! 2(W-1)/W (1.5 against 1 at H = L = 2, 1.75 against 1 with L = 4), and
//! all L ranks of a host use the link at once. Every chunk is reduced by one
//! rank per step, so all ranks end bit-identical. Groups whose hosts hold
//! different numbers of ranks, or one each, take one ring in host order.
//!
//! Bytes copied (`Cost`), per rank, for n bytes, chunks of c = n/L and their
//! pieces of c/H: the reduce-scatter 3(L-1)c, the all-reduce 5(H-1)c/H and
//! the all-gather 2(L-1)c (see the ring algorithms; 0 sent through rings
//! where single copy applies).

use super::hosts::Hosts;
use super::{ring_allgather, ring_allreduce, ring_reduce_scatter, OpCtx, RawBuf};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;
use crate::transport::subgroup::Subgroup;

pub fn hierarchical_allreduce(ctx: &OpCtx, buf: RawBuf, dtype: DType, op: ReduceOp, hosts: &Hosts) -> Result<()> {
    let Some(local) = hosts.per_host() else {
        let ring = hosts.ring_view(ctx.transport);
        return ring_allreduce(&ctx.phase(&ring, ctx.phase), buf, dtype, op);
    };
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let (host, i) = hosts.locate(rank);
    let es = dtype.size();
    let n = buf.len / es;
    // Chunk c holds elements [c n / L, (c + 1) n / L): sizes differ by at most one.
    let chunks: Vec<RawBuf> = (0..local)
        .map(|c| {
            let (lo, hi) = (c * n / local, (c + 1) * n / local);
            RawBuf::new(unsafe { buf.ptr.add(lo * es) }, (hi - lo) * es)
        })
        .collect();
    // An average divides once, by W, after the sums across hosts.
    let sum = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    let on_host = Subgroup::new(ctx.transport, hosts.members[host].clone());
    let across = Subgroup::new(ctx.transport, hosts.counterparts(i));
    ring_reduce_scatter(&ctx.phase(&on_host, 1), &chunks, chunks[i], dtype, sum)?;
    ring_allreduce(&ctx.phase(&across, 2), chunks[i], dtype, sum)?;
    if op == ReduceOp::Avg {
        divide_by(dtype, unsafe { chunks[i].slice_mut(0, chunks[i].len) }, world);
    }
    ring_allgather(&ctx.phase(&on_host, 3), chunks[i], &chunks)
}
