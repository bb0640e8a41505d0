//! Hierarchical reduce-scatter, for a group of H hosts with L ranks each.
//! Rank r's block is summed first on every host, then across hosts: for each
//! host g, a reduce-scatter among each host's ranks leaves its i-th rank with
//! the host's sum of the block of host g's i-th rank; then the i-th ranks of
//! all hosts reduce-scatter those H partial blocks around a ring of their
//! own. Each host's link carries (H-1)/H of a rank's input each way, where
//! one ring over all W ranks carries (W-1)/W. Groups whose hosts hold
//! different numbers of ranks, or one each, take one ring in host order.
//! On hosts whose ranks share an arena (`Hosts::arena`), the blocks are
//! reduced on the host there, a stage for each host's blocks (per slot's
//! worth) instead of L - 1 steps; inputs that would go in pieces
//! (`piece_count`), from L = 3 (`Hosts::arena_for`).
//!
//! Bytes copied (`Cost`), per rank, for blocks of b bytes: H times a
//! reduce-scatter of L blocks, (1 + 3(L-1))b each (in the arena 2Lb), then
//! one of H blocks, (1 + 3(H-1))b (see the ring and arena algorithms; less
//! what single copy saves).

use super::arena_allreduce::Reducing;
use super::arena_reduce_scatter::arena_reduce_scatter;
use super::call_check::Fingerprint;
use super::hosts::Hosts;
use super::pipeline::piece_count;
use super::{ring_reduce_scatter, take_front, OpCtx};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;
use crate::transport::group::subgroup::Subgroup;

/// `inputs[r]` is this rank's contribution to rank r's block (its own,
/// `inputs[rank]`, is `own`, or None in place: what `output` holds);
/// `output` gets this rank's; `fp`: the call, for the arena's rounds to compare.
pub fn hierarchical_reduce_scatter(
    ctx: &OpCtx,
    (inputs, own): (&[&[u8]], Option<&[u8]>),
    output: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    hosts: &Hosts,
    fp: &Fingerprint,
) -> Result<()> {
    let Some(_) = hosts.per_host() else {
        let ring = hosts.ring_view(ctx.transport);
        let in_ring: Vec<&[u8]> = hosts.ring().into_iter().map(|r| inputs[r]).collect();
        return ring_reduce_scatter(&ctx.phase(&ring, ctx.phase), &in_ring, own, output, dtype, op);
    };
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let (host, i) = hosts.locate(rank);
    let count = hosts.members.len();
    let b = output.len();
    let sum = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    // partials[g]: this host's sum of the block of host g's i-th rank.
    let mut scratch = ctx.scratch(count * b);
    let mut rest = scratch.bytes_mut();
    let mut partials: Vec<&mut [u8]> = (0..count).map(|_| take_front(&mut rest, b)).collect();
    let on_host = Subgroup::new(ctx.transport, hosts.members[host].clone());
    let one_piece = piece_count(ctx, (0..world).map(|r| if r == rank { b } else { inputs[r].len() }).sum(), 1) == 1;
    let arena = Hosts::arena_for(&on_host, one_piece);
    for (g, members) in hosts.members.iter().enumerate() {
        // In place this rank's input is the output, written only at the end.
        let input = |r: usize| if r == rank { own.unwrap_or(output) } else { inputs[r] };
        let blocks: Vec<&[u8]> = members.iter().map(|&r| input(r)).collect();
        let on_host = &ctx.phase(&on_host, 1 + g as u64);
        match &arena {
            Some(arena) => {
                let how = Reducing { dtype, op: sum, premul: None, root: None };
                arena_reduce_scatter(on_host, arena, &blocks, Some(blocks[i]), partials[g], &how, fp)?
            }
            None => ring_reduce_scatter(on_host, &blocks, Some(blocks[i]), partials[g], dtype, sum)?,
        }
    }
    let across = Subgroup::new(ctx.transport, hosts.counterparts(i));
    let partials: Vec<&[u8]> = partials.into_iter().map(|p| &*p).collect();
    ring_reduce_scatter(&ctx.phase(&across, 1 + count as u64), &partials, Some(partials[host]), output, dtype, sum)?;
    if op == ReduceOp::Avg {
        divide_by(dtype, output, world);
    }
    Ok(())
}
