//! Which algorithm runs each collective, and the work around them that is
//! not an algorithm of its own: barrier, PREMUL_SUM's scaling. Where every rank reads the others' memory
//! (`Transport::single_copy_bytes`, the same on every rank), broadcast,
//! all-gather, reduce-scatter and all-reduce of blocks that large go in one
//! or two steps instead of around the ring. Groups on several hosts take the
//! hierarchical all-reduce, reduce-scatter and all-gather, and rings in host
//! order for broadcast and reduce, so that fewer bytes cross between hosts;
//! where each host's ranks share an arena, their phases on the host, and
//! the trees' hops on the host, run there (`Hosts::arena`). Groups on one host with
//! a shared arena run their collectives there (`in_arena`), but for those
//! that take the single-copy algorithms (an all-reduce that fits a round of
//! the arena runs there anyway). What a call depends on of its group
//! (its arena, its hosts, single copy) is looked at once, in its `Plan`,
//! which says both whether the algorithm checks the call itself and which
//! algorithm runs.

use super::arena_allreduce::{arena_allreduce, Reducing};
use super::call_check::Fingerprint;
use super::hosts::Hosts;
use super::{
    arena_allgather::arena_allgather, arena_alltoall, arena_broadcast::arena_broadcast, arena_gather::arena_gather,
    arena_reduce_scatter::arena_reduce_scatter, arena_scatter::arena_scatter, in_arena,
};
use super::{
    direct_allreduce, direct_gather, direct_scatter, hierarchical_allgather, hierarchical_allreduce,
    hierarchical_direct_allreduce, hierarchical_reduce_scatter, monitored_barrier, pairwise_alltoall, prefers_direct,
    ring_allgather, ring_allreduce, ring_broadcast, ring_reduce, ring_reduce_scatter, single_copy_allgather,
    single_copy_allreduce, single_copy_broadcast, single_copy_reduce_scatter, sparse_allreduce, tree_broadcast,
    tree_reduce, OpCtx, RawBuf, Scratch,
};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::ops::{Collective, Reduction};
use crate::reduce::scale;
use crate::transport::arena::Arena;
use crate::transport::subgroup::Subgroup;
use std::sync::Arc;

/// How one collective runs on its group: decided once (`Plan::of`), the same
/// on every rank for the same call, then followed by `run`.
pub struct Plan {
    /// The group's arena, where it has one (direct exchanges give way to it).
    arena: Option<Arc<Arena>>,
    /// The call runs in the arena (`in_arena`).
    in_arena: bool,
    /// The call's single-copy algorithm takes it (`single_copy`).
    single_copy: bool,
    /// The group's hosts, where it spans several.
    hosts: Option<Hosts>,
}

impl Plan {
    pub fn of(ctx: &OpCtx, part: &Collective) -> Plan {
        let arena = ctx.transport.arena();
        let single_copy = single_copy(ctx, part);
        let in_arena = arena.as_ref().is_some_and(|a| in_arena(ctx, a, part, single_copy));
        Plan { arena, in_arena, single_copy, hosts: Hosts::apart(ctx.transport) }
    }

    /// Whether the algorithm checks the call itself, with every rank,
    /// rather than before it starts (`call_check::agree`): the smallest
    /// all-reduces and barriers (alongside their one exchange), and the
    /// single-copy algorithms (before any data moves), and whatever runs in
    /// the arena (in its first round). PREMUL_SUM all-reduce outside the
    /// arena scales the caller's buffer first, so it checks before.
    pub fn checks_inline(&self, ctx: &OpCtx, part: &Collective) -> bool {
        if self.in_arena {
            return true;
        }
        let direct = |bytes| self.direct(ctx, bytes, ctx.transport.size());
        match part {
            Collective::AllReduce { buf, red } => red.premul.is_none() && (direct(buf.len) || self.single_copy),
            Collective::Barrier => direct(1),
            _ => self.single_copy,
        }
    }

    /// Whether an all-reduce (or a tree) of `bytes` among `fanout` ranks takes
    /// the direct exchange: small enough, and not in a group with an arena,
    /// where the arena's algorithms do small ones in fewer steps.
    fn direct(&self, ctx: &OpCtx, bytes: usize, fanout: usize) -> bool {
        self.arena.is_none() && prefers_direct(bytes, fanout, ctx.small_allreduce_bytes)
    }

    /// Whether a broadcast or reduce of `bytes` takes the tree (two hops at
    /// most) rather than the pipelined chain (W-1 hops): messages as small as the
    /// direct all-reduce's, where the root exchanges with at most SMALL_MAX_WORLD ranks.
    fn small_tree(&self, ctx: &OpCtx, bytes: usize) -> bool {
        let fanout = match &self.hosts {
            Some(hosts) => hosts.members.len() + hosts.members.iter().map(Vec::len).max().unwrap_or(0),
            None => ctx.transport.size(),
        };
        self.direct(ctx, bytes, fanout)
    }
}

/// Whether `part` runs in the group's shared `arena`: the collectives that
/// move data among all ranks, but those whose every message is large enough
/// to be read straight from the sender's memory (`single_copy`: one copy
/// less than through the arena). PREMUL_SUM all-reduce always, since there
/// it scales a copy instead of the caller's buffer.
fn in_arena(ctx: &OpCtx, arena: &Arena, part: &Collective, single_copy: bool) -> bool {
    match part {
        // One that fits a round of the arena runs there even where its blocks
        // could go as addresses: the round passes in two stages with no
        // message, where the single-copy algorithm sends addresses over the
        // links, each a wake-up of the I/O thread. At W=2 on 2 cores a 1 MiB
        // all-reduce took 95 µs so against 190.
        Collective::AllReduce { buf, red } => red.premul.is_some() || !single_copy || buf.len <= arena.slot_bytes(),
        Collective::Broadcast { .. } | Collective::AllGather { .. } => !single_copy,
        // Every rank's slot holds a part of each of the W blocks.
        Collective::ReduceScatter { .. } => !single_copy && arena.slot_bytes() / ctx.transport.size() >= 16,
        Collective::Reduce { .. } | Collective::Barrier => true,
        Collective::AllToAll { .. } => arena_alltoall::fits(arena, ctx.transport.size()),
        // Not `single_copy`: a large gather or scatter goes by direct messages,
        // its call checked before (`checks_inline`), not by a single-copy algorithm.
        Collective::Gather { input: block, .. } | Collective::Scatter { output: block, .. } => {
            !goes_as_address(ctx, block.len)
        }
        _ => false,
    }
}

/// Run `part` in the arena (`in_arena`), its call checked there as `fp` says.
fn run_in_arena(ctx: &OpCtx, arena: &Arena, part: &Collective, fp: &Fingerprint) -> Result<()> {
    let reducing = |red: &Reduction, root| Reducing { dtype: red.dtype, op: red.op, premul: red.premul, root };
    match part {
        Collective::AllReduce { buf, red } => arena_allreduce(ctx, arena, *buf, &reducing(red, None), fp),
        Collective::Reduce { buf, root, red } => arena_allreduce(ctx, arena, *buf, &reducing(red, Some(*root)), fp),
        Collective::Broadcast { buf, root, .. } => arena_broadcast(ctx, arena, *buf, *root, fp),
        Collective::AllGather { input, outputs, .. } => arena_allgather(ctx, arena, *input, outputs, fp),
        Collective::ReduceScatter { inputs, output, red } => {
            arena_reduce_scatter(ctx, arena, inputs, *output, &reducing(red, None), fp)
        }
        Collective::AllToAll { inputs, outputs, .. } => arena_alltoall::arena_alltoall(ctx, arena, inputs, outputs, fp),
        Collective::Gather { input, outputs, root, .. } => arena_gather(ctx, arena, *input, outputs, *root, fp),
        Collective::Scatter { inputs, output, root, .. } => arena_scatter(ctx, arena, inputs, *output, *root, fp),
        // A barrier: one stage with nothing in it.
        _ => in_arena::agree(ctx, arena, fp),
    }
}

/// Whether the single-copy algorithm of `part` (broadcast, all-gather,
/// reduce-scatter, all-reduce) takes it: all ranks read each other's memory,
/// and every message of the op (a block, for all but broadcast) is large
/// enough to go as its address. Every rank decides the same for the same call.
fn single_copy(ctx: &OpCtx, part: &Collective) -> bool {
    let world = ctx.transport.size();
    let smallest = match part {
        Collective::Broadcast { buf, .. } => buf.len,
        Collective::AllGather { outputs, .. } => outputs.iter().map(|o| o.len).min().unwrap_or(0),
        Collective::ReduceScatter { output, .. } => output.len,
        // Its W blocks hold n/W elements, rounded down or up.
        Collective::AllReduce { buf, red } => buf.len / red.dtype.size() / world * red.dtype.size(),
        _ => return false,
    };
    world > 1 && goes_as_address(ctx, smallest)
}

/// Whether a message of `bytes` to a rank of this group is read straight
/// from the sender's memory (`Transport::single_copy_bytes`).
fn goes_as_address(ctx: &OpCtx, bytes: usize) -> bool {
    ctx.transport.single_copy_bytes().is_some_and(|from| bytes >= from)
}

/// Run one collective as `plan` says, its call checked before (or, with
/// `check`, by the algorithm itself: see `Plan::checks_inline`; without it,
/// as for the pieces of a staged op, the ring algorithms run).
pub fn run(ctx: &OpCtx, part: &Collective, plan: &Plan, check: Option<&Fingerprint>) -> Result<()> {
    if let Some(arena) = plan.arena.as_ref().filter(|_| plan.in_arena) {
        return run_in_arena(ctx, arena, part, &check.copied().unwrap_or_else(|| Fingerprint::of(part)));
    }
    let apart = plan.hosts.as_ref();
    // What the rounds in a host's arena compare (`Hosts::arena`).
    let fp = &check.copied().unwrap_or_else(|| Fingerprint::of(part));
    let single_copy = check.filter(|_| plan.single_copy);
    match part {
        Collective::AllReduce { buf, red } => {
            let op = premultiply(buf, red);
            let direct = plan.direct(ctx, buf.len, ctx.transport.size());
            match (single_copy.filter(|_| !direct), apart.filter(|_| !direct)) {
                (Some(check), _) => single_copy_allreduce(ctx, *buf, red.dtype, op, check),
                (None, Some(hosts)) => hierarchical_allreduce(ctx, *buf, red.dtype, op, hosts, fp),
                _ => all_reduce(ctx, plan, *buf, red.dtype, op, (check, fp)),
            }
        }
        Collective::Reduce { buf, root, red } => {
            // PREMUL_SUM scales the root's buffer, which the op overwrites, in
            // place; the others' must stay as they were, so they send a scaled copy.
            let mut copy = Scratch::new(0);
            let (input, op) = if ctx.transport.rank() == *root {
                (*buf, premultiply(buf, red))
            } else {
                (premultiplied_copies(&mut copy, ctx, std::slice::from_ref(buf), red)[0], red.op)
            };
            if plan.small_tree(ctx, buf.len) {
                tree_reduce(ctx, input, *root, red.dtype, op, apart, fp)
            } else {
                chained(ctx, apart, *root, Towards::Root, |ctx, root| ring_reduce(ctx, input, root, red.dtype, op))
            }
        }
        Collective::Broadcast { buf, root, .. } => match single_copy {
            Some(check) => single_copy_broadcast(ctx, *buf, *root, check),
            _ if plan.small_tree(ctx, buf.len) => tree_broadcast(ctx, *buf, *root, apart, fp),
            _ => chained(ctx, apart, *root, Towards::Others, |ctx, root| ring_broadcast(ctx, *buf, root)),
        },
        Collective::AllGather { input, outputs, .. } => match (single_copy, apart) {
            (Some(check), _) => single_copy_allgather(ctx, *input, outputs, check),
            (None, Some(hosts)) => hierarchical_allgather(ctx, *input, outputs, hosts, fp),
            _ => ring_allgather(ctx, *input, outputs),
        },
        Collective::Gather { input, outputs, root, .. } => direct_gather(ctx, *input, outputs, *root),
        Collective::Scatter { inputs, output, root, .. } => direct_scatter(ctx, inputs, *output, *root),
        Collective::ReduceScatter { inputs, output, red } => {
            let mut copy = Scratch::new(0);
            let inputs = premultiplied_copies(&mut copy, ctx, inputs, red);
            match (single_copy, apart) {
                (Some(check), _) => single_copy_reduce_scatter(ctx, &inputs, *output, red.dtype, red.op, check),
                (None, Some(hosts)) => hierarchical_reduce_scatter(ctx, &inputs, *output, red.dtype, red.op, hosts, fp),
                _ => ring_reduce_scatter(ctx, &inputs, *output, red.dtype, red.op),
            }
        }
        Collective::AllToAll { inputs, outputs, .. } => pairwise_alltoall(ctx, inputs, outputs),
        // An all-reduce of one byte: nobody finishes before everybody has arrived.
        Collective::Barrier => {
            let mut one = Scratch::new(1);
            let buf = RawBuf { ptr: one.raw().ptr, len: 1 };
            all_reduce(ctx, plan, buf, DType::U8, ReduceOp::BOr, (check, fp))
        }
        Collective::MonitoredBarrier { wait_all, timeout } => {
            monitored_barrier(ctx, *wait_all, timeout.unwrap_or(ctx.timeout))
        }
        Collective::AllReduceSparse { indices, values, shape, out, .. } => {
            let rows = shape.rows(indices, values).expect("checked by Collective::check");
            *out.lock().unwrap() = sparse_allreduce(ctx, *indices, *values, rows, shape)?;
            Ok(())
        }
    }
}

/// Which way the data of a rooted chain flows.
enum Towards {
    Root,
    Others,
}

/// Run a chain algorithm rooted at `root` (broadcast, reduce) on a group on
/// several hosts (`apart`) in the order of `Hosts::chain`, reversed for a
/// chain towards the root, so that it crosses H - 1 links between hosts
/// once each; `f` gets the root's rank in that order. Otherwise as it is.
fn chained(
    ctx: &OpCtx,
    apart: Option<&Hosts>,
    root: usize,
    towards: Towards,
    f: impl FnOnce(&OpCtx, usize) -> Result<()>,
) -> Result<()> {
    let Some(hosts) = apart else { return f(ctx, root) };
    let mut order = hosts.chain(root);
    if let Towards::Root = towards {
        order.reverse();
    }
    let chain = Subgroup::new(ctx.transport, order);
    f(&ctx.phase(&chain, ctx.phase), chain.position(root).expect("the root is in the chain"))
}

/// Small messages: one direct exchange (on several hosts of as many ranks
/// each, one on each host, then one across); large ones: the
/// bandwidth-optimal ring. `check`: the call, if checked here; `fp`: the call.
fn all_reduce(
    ctx: &OpCtx,
    plan: &Plan,
    buf: RawBuf,
    dtype: DType,
    op: ReduceOp,
    (check, fp): (Option<&Fingerprint>, &Fingerprint),
) -> Result<()> {
    if plan.direct(ctx, buf.len, ctx.transport.size()) {
        match plan.hosts.as_ref().filter(|hosts| hosts.per_host().is_some()) {
            Some(hosts) => hierarchical_direct_allreduce(ctx, buf, dtype, op, hosts, check, fp),
            None => direct_allreduce(ctx, buf, dtype, op, check),
        }
    } else {
        debug_assert!(check.is_none(), "the ring checks the call before it starts");
        ring_allreduce(ctx, buf, dtype, op)
    }
}

/// PREMUL_SUM on a buffer the op overwrites anyway: scale it in place, then sum.
fn premultiply(buf: &RawBuf, red: &Reduction) -> ReduceOp {
    if let Some(f) = red.premul {
        // SAFETY: before the algorithm starts: the op's buffer (its whole `len`)
        // is in no transfer, and this rank alone touches it.
        scale(red.dtype, unsafe { buf.slice_mut(0, buf.len) }, f);
    }
    red.op
}

/// PREMUL_SUM on inputs the caller keeps: scaled copies of `blocks` in `scratch`
/// (taken from the pool here); without PREMUL_SUM the blocks themselves.
fn premultiplied_copies<'a>(
    scratch: &mut Scratch<'a>,
    ctx: &OpCtx<'a>,
    blocks: &[RawBuf],
    red: &Reduction,
) -> Vec<RawBuf> {
    let Some(factor) = red.premul else { return blocks.to_vec() };
    *scratch = ctx.scratch(blocks.iter().map(|b| b.len).sum());
    let mut at = scratch.raw().ptr;
    blocks
        .iter()
        .map(|b| {
            let dst = RawBuf::new(at, b.len);
            // SAFETY: `dst` lies in the scratch, which holds the sum of the blocks'
            // lengths, at the running offset `at` (advanced by each block's length,
            // so at most to the scratch's end); the scratch is no one else's yet,
            // and `*b` is the op's input block, only read.
            unsafe {
                ctx.copy(dst, *b);
                scale(red.dtype, dst.slice_mut(0, dst.len), factor);
                at = at.add(b.len);
            }
            dst
        })
        .collect()
}
