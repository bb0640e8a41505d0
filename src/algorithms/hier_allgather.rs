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
use super::pipeline::{piece_count, pieces, pieces_mut, pipelined};
use super::{pick, ring_allgather, OpCtx};
use crate::error::Result;
use crate::transport::group::subgroup::Subgroup;

/// `outputs[r]` receives rank r's input: `own`, or, in place (None), what
/// `outputs[rank]` holds; `fp`: the call, for the arena's rounds to compare.
pub fn hierarchical_allgather(
    ctx: &OpCtx,
    own: Option<&[u8]>,
    outputs: &mut [&mut [u8]],
    hosts: &Hosts,
    fp: &Fingerprint,
) -> Result<()> {
    let Some(_) = hosts.per_host() else {
        let ring = hosts.ring_view(ctx.transport);
        return ring_allgather(&ctx.phase(&ring, ctx.phase), own, &mut hosts.in_ring_order(outputs));
    };
    let (host, i) = hosts.locate(ctx.transport.rank());
    let across = Subgroup::new(ctx.transport, hosts.counterparts(i));
    let on_host = Subgroup::new(ctx.transport, hosts.members[host].clone());
    // Each piece takes a phase across hosts and one on the host per host.
    let keys = 1 + hosts.members.len();
    let count = piece_count(ctx, outputs.iter().map(|o| o.len()).sum(), keys);
    let arena = Hosts::arena_for(&on_host, count == 1);
    let mut parts: Vec<Part> = match own {
        Some(input) => {
            pieces(input, 1, count).into_iter().map(|p| Part { input: Some(p), outputs: Vec::new() }).collect()
        }
        None => (0..count).map(|_| Part { input: None, outputs: Vec::new() }).collect(),
    };
    for out in outputs.iter_mut() {
        for (k, p) in pieces_mut(out, 1, count).into_iter().enumerate() {
            parts[k].outputs.push(p);
        }
    }
    let stage = |stage: usize, k: usize, Part { input, outputs: outs }: &mut Part| -> Result<()> {
        let phase = 1 + (k * keys) as u64;
        if stage == 0 {
            let mut theirs = pick(outs, &hosts.counterparts(i));
            return ring_allgather(&ctx.phase(&across, phase), *input, &mut theirs);
        }
        for (g, members) in hosts.members.iter().enumerate() {
            // Every block is filled in place: this rank's by the phase before.
            let mut blocks = pick(outs, members);
            let on_host = &ctx.phase(&on_host, phase + 1 + g as u64);
            match &arena {
                Some(arena) => arena_allgather(on_host, arena, None, &mut blocks, fp)?,
                None => ring_allgather(on_host, None, &mut blocks)?,
            }
        }
        Ok(())
    };
    if count == 1 {
        let mut part = parts.pop().expect("one piece");
        return (0..2).try_for_each(|s| stage(s, 0, &mut part));
    }
    pipelined(ctx, 2, parts, stage)
}

/// Piece k of an all-gather: that of this rank's input (None in place), and
/// that of every output block.
struct Part<'a> {
    input: Option<&'a [u8]>,
    outputs: Vec<&'a mut [u8]>,
}
