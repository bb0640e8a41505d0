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
//! A large buffer goes in pieces through the three phases (`pipelined`):
//! while one piece crosses the link, the next is reduced on the host and the
//! one before gathered. On hosts whose ranks share an arena (`Hosts::arena`),
//! the two phases on the host run there, a stage each per slot's worth
//! instead of L - 1 steps (in pieces, from L = 3: `Hosts::arena_for`), and
//! then both on one thread, as the arena takes one round at a time
//! (`pipelined_through`).
//!
//! Bytes copied (`Cost`), per rank, for n bytes, chunks of c = n/L and their
//! pieces of c/H: the reduce-scatter 3(L-1)c, the all-reduce 5(H-1)c/H and
//! the all-gather 2(L-1)c (see the ring algorithms; 0 sent through rings
//! where single copy applies). In the arena, the reduce-scatter 2n and the
//! all-gather c + n (see the arena's algorithms).

use super::arena_allgather::arena_allgather;
use super::arena_allreduce::Reducing;
use super::arena_reduce_scatter::arena_reduce_scatter;
use super::call_check::Fingerprint;
use super::hosts::Hosts;
use super::pipeline::{piece_count, pieces_mut, pipelined, pipelined_through};
use super::{ring_allgather, ring_allreduce, ring_reduce_scatter, split_own, OpCtx};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;
use crate::transport::group::arena::Arena;
use crate::transport::group::subgroup::Subgroup;
use std::sync::Arc;

/// `fp`: the call, for the arena's rounds to compare.
pub fn hierarchical_allreduce(
    ctx: &OpCtx,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    hosts: &Hosts,
    fp: &Fingerprint,
) -> Result<()> {
    let Some(local) = hosts.per_host() else {
        let ring = hosts.ring_view(ctx.transport);
        return ring_allreduce(&ctx.phase(&ring, ctx.phase), buf, dtype, op);
    };
    let (host, i) = hosts.locate(ctx.transport.rank());
    let count = piece_count(ctx, buf.len(), 3);
    let on_host = Subgroup::new(ctx.transport, hosts.members[host].clone());
    let plan = Plan {
        arena: Hosts::arena_for(&on_host, count == 1),
        on_host,
        across: Subgroup::new(ctx.transport, hosts.counterparts(i)),
        i,
        local,
        dtype,
        op,
        fp,
    };
    let mut pieces = pieces_mut(buf, dtype.size(), count);
    if count == 1 {
        return (0..3).try_for_each(|stage| plan.stage(ctx, stage, 0, pieces[0]));
    }
    let stage = |stage, k, piece: &mut &mut [u8]| plan.stage(ctx, stage, k, piece);
    match plan.arena {
        Some(_) => pipelined_through(ctx, pieces, stage),
        None => pipelined(ctx, 3, pieces, stage),
    }
}

/// The three phases of one rank's share of the work.
struct Plan<'a> {
    on_host: Subgroup<'a>,
    /// The arena of the host's ranks, if they share one.
    arena: Option<Arc<Arena>>,
    across: Subgroup<'a>,
    /// This rank's place on its host: the chunk it reduces across hosts.
    i: usize,
    local: usize,
    dtype: DType,
    op: ReduceOp,
    fp: &'a Fingerprint,
}

impl Plan<'_> {
    /// Phase `stage` (0: reduce-scatter on the host, 1: all-reduce across
    /// hosts, 2: all-gather on the host) of piece `k`, `part`, with keys of its own.
    fn stage(&self, ctx: &OpCtx, stage: usize, k: usize, part: &mut [u8]) -> Result<()> {
        // Chunk c holds elements [c n / L, (c + 1) n / L): sizes differ by at most one.
        let mut chunks = pieces_mut(part, self.dtype.size(), self.local);
        // An average divides once, by W, after the sums across hosts.
        let sum = if self.op == ReduceOp::Avg { ReduceOp::Sum } else { self.op };
        let phase = 1 + 3 * k as u64 + stage as u64;
        let on_host = &ctx.phase(&self.on_host, phase);
        match (stage, &self.arena) {
            (0, arena) => {
                // This rank's chunk, in place, is the output.
                let (others, mine) = split_own(&mut chunks, self.i);
                let mut inputs = vec![&[][..]; self.local];
                for (c, chunk) in others {
                    inputs[c] = chunk;
                }
                match arena {
                    Some(arena) => {
                        let how = Reducing { dtype: self.dtype, op: sum, premul: None, root: None };
                        arena_reduce_scatter(on_host, arena, &inputs, None, mine, &how, self.fp)
                    }
                    None => ring_reduce_scatter(on_host, &inputs, None, mine, self.dtype, sum),
                }
            }
            (1, _) => {
                let mine = &mut *chunks[self.i];
                ring_allreduce(&ctx.phase(&self.across, phase), mine, self.dtype, sum)?;
                if self.op == ReduceOp::Avg {
                    divide_by(self.dtype, mine, ctx.transport.size());
                }
                Ok(())
            }
            // This rank's chunk is its input, in place.
            (_, Some(arena)) => arena_allgather(on_host, arena, None, &mut chunks, self.fp),
            (_, None) => ring_allgather(on_host, None, &mut chunks),
        }
    }
}
