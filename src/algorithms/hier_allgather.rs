//! Hierarchical all-gather, for a group of H hosts with L ranks each: the
//! i-th ranks of all hosts gather their blocks around a ring of their own,
//! then for each host g, the ranks of each host all-gather the blocks of
//! host g's ranks among themselves. Each host's link carries (H-1)/H of the
//! output each way, where one ring over all W ranks carries (W-1)/W. Every
//! block lands straight in its place. Groups whose hosts hold different
//! numbers of ranks, or one each, take one ring in host order. A large
//! output goes in pieces (`pipelined`): while one piece crosses the link,
//! the one before is gathered on the host. On hosts whose ranks share an
//! arena (`Hosts::arena`), each piece is gathered on the host there (in
//! pieces, from L = 3: `Hosts::arena_for`), a stage for each host's blocks
//! instead of L - 1 steps (only the phase on the host takes the arena, so
//! its rounds come one at a time).
//!
//! Bytes copied (`Cost`), per rank, for blocks of b bytes: b (its own) +
//! 2(H-1)b across hosts + H times 2(L-1)b on the host (see the ring algorithm;
//! less what single copy saves), or in the arena H times (L + 1)b.

use super::arena_allgather::arena_allgather;
use super::call_check::Fingerprint;
use super::hosts::Hosts;
use super::pipeline::{piece, piece_count, pipelined};
use super::{ring_allgather, OpCtx, RawBuf};
use crate::error::Result;
use crate::transport::group::subgroup::Subgroup;

/// `outputs[r]` receives rank r's `input`; `fp`: the call, for the arena's rounds to compare.
pub fn hierarchical_allgather(
    ctx: &OpCtx,
    input: RawBuf,
    outputs: &[RawBuf],
    hosts: &Hosts,
    fp: &Fingerprint,
) -> Result<()> {
    let Some(_) = hosts.per_host() else {
        let ring = hosts.ring_view(ctx.transport);
        return ring_allgather(&ctx.phase(&ring, ctx.phase), input, &hosts.in_ring_order(outputs));
    };
    let (host, i) = hosts.locate(ctx.transport.rank());
    let across = Subgroup::new(ctx.transport, hosts.counterparts(i));
    let on_host = Subgroup::new(ctx.transport, hosts.members[host].clone());
    // Each piece takes a phase across hosts and one on the host per host.
    let keys = 1 + hosts.members.len();
    let count = piece_count(ctx, outputs.iter().map(|o| o.len).sum(), keys);
    let arena = Hosts::arena_for(&on_host, count == 1);
    let stage = |stage: usize, k: usize| -> Result<()> {
        let cut = |b: RawBuf| piece(b, 1, count, k);
        let phase = 1 + (k * keys) as u64;
        if stage == 0 {
            let theirs: Vec<RawBuf> = hosts.members.iter().map(|m| cut(outputs[m[i]])).collect();
            return ring_allgather(&ctx.phase(&across, phase), cut(input), &theirs);
        }
        for (g, members) in hosts.members.iter().enumerate() {
            let blocks: Vec<RawBuf> = members.iter().map(|&r| cut(outputs[r])).collect();
            let on_host = &ctx.phase(&on_host, phase + 1 + g as u64);
            match &arena {
                Some(arena) => arena_allgather(on_host, arena, blocks[i], &blocks, fp)?,
                None => ring_allgather(on_host, blocks[i], &blocks)?,
            }
        }
        Ok(())
    };
    if count == 1 {
        return (0..2).try_for_each(|s| stage(s, 0));
    }
    pipelined(ctx, 2, count, stage)
}
