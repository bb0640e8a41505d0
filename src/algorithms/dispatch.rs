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
//! the arena runs there anyway). One place decides each call's algorithm,
//! from what it depends on of its group (its arena, its hosts, single
//! copy): `Plan::of`, which also says whether the algorithm checks the call
//! itself; `run` only follows it.

use super::arena_allreduce::{arena_allreduce, Reducing};
use super::arena_broadcast::Cast;
use super::call_check::Fingerprint;
use super::hosts::Hosts;
use super::op_bufs::OpBufs;
use super::{
    arena_allgather::arena_allgather, arena_alltoall, arena_broadcast::arena_broadcast, arena_gather::arena_gather,
    arena_reduce_scatter::arena_reduce_scatter, arena_scatter::arena_scatter, in_arena,
};
use super::{
    direct_allreduce, direct_gather, direct_scatter, hierarchical_allgather, hierarchical_allreduce,
    hierarchical_direct_allreduce, hierarchical_reduce_scatter, monitored_barrier, pairwise_alltoall, prefers_direct,
    ring_allgather, ring_allreduce, ring_broadcast, ring_reduce, ring_reduce_scatter, single_copy_allgather,
    single_copy_allreduce, single_copy_broadcast, single_copy_reduce_scatter, sparse_allreduce, take_front,
    tree_broadcast, tree_reduce, OpCtx, Scratch,
};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::ops::{Collective, Reduction};
use crate::reduce::scale;
use crate::transport::group::arena::Arena;
use crate::transport::group::subgroup::Subgroup;
use std::sync::Arc;

/// The algorithm one collective runs (`Plan::of` decides it; `run` follows
/// it; the table test below pins it for every kind of group).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// In the group's shared arena (`run_in_arena`): every collective but
    /// those the single-copy algorithms take.
    Arena,
    /// Every rank reads the others' memory: broadcast, all-gather,
    /// reduce-scatter and all-reduce in one or two steps.
    SingleCopy,
    /// One exchange among all ranks: all-reduce and barrier, small ones.
    Direct,
    /// One exchange on each host, then one across (hosts of as many ranks
    /// each): all-reduce and barrier, small ones.
    HostsDirect,
    /// On each host, across hosts, on each host again: all-reduce,
    /// all-gather and reduce-scatter on several hosts.
    Hierarchical,
    /// Two hops at most from or to the root: broadcast and reduce, small ones.
    Tree,
    /// A pipelined chain through every rank (W-1 hops; in host order on
    /// several hosts): broadcast and reduce.
    Chain,
    /// The bandwidth-optimal ring: all-reduce, all-gather, reduce-scatter,
    /// and a barrier too wide for the direct exchange.
    Ring,
    /// Messages between the root and each rank (gather, scatter), or
    /// between every pair (all-to-all).
    Pairwise,
    /// The collective's only algorithm: monitored barrier, sparse all-reduce.
    OwnOnly,
}

/// How one collective runs on its group: decided once (`Plan::of`), the same
/// on every rank for the same call, then followed by `run`.
pub struct Plan {
    pub algorithm: Algorithm,
    /// Whether the algorithm checks the call itself, with every rank,
    /// rather than before it starts (`call_check::agree`): the smallest
    /// all-reduces and barriers (alongside their one exchange), and the
    /// single-copy algorithms (before any data moves), and whatever runs in
    /// the arena (in its first round). PREMUL_SUM all-reduce outside the
    /// arena scales the caller's buffer first, so it checks before.
    pub checks_inline: bool,
    /// The group's arena, where the call runs there.
    arena: Option<Arc<Arena>>,
    /// The group's hosts, where it spans several.
    hosts: Option<Hosts>,
}

impl Plan {
    /// The plan of `part` on `ctx`'s group. `may_check_inline`: false where
    /// the call was checked before already (the pieces of a staged op), so
    /// that no algorithm that checks it itself (single copy) is chosen, and
    /// the direct exchange does not check it again.
    pub fn of(ctx: &OpCtx, part: &Collective, may_check_inline: bool) -> Plan {
        let arena = ctx.transport.arena();
        let hosts = Hosts::apart(ctx.transport);
        let world = ctx.transport.size();
        let single_copy = single_copy(ctx, part);
        // The direct exchanges give way to an arena, even where the call does not
        // run there: the arena's algorithms do small ones in fewer steps.
        let no_arena = arena.is_none();
        if let Some(arena) = arena.filter(|a| in_arena(ctx, a, part, single_copy)) {
            return Plan { algorithm: Algorithm::Arena, checks_inline: may_check_inline, arena: Some(arena), hosts };
        }
        let direct = |bytes, fanout| no_arena && prefers_direct(bytes, fanout, ctx.small_allreduce_bytes);
        // A broadcast or reduce takes the tree (two hops at most) rather than the
        // chain (W-1 hops) for messages as small as the direct all-reduce's, where
        // the root exchanges with at most SMALL_MAX_WORLD ranks.
        let tree_fanout = match &hosts {
            Some(hosts) => hosts.members.len() + hosts.members.iter().map(Vec::len).max().unwrap_or(0),
            None => world,
        };
        let rooted = |bytes| if direct(bytes, tree_fanout) { Algorithm::Tree } else { Algorithm::Chain };
        // Small ones: one direct exchange (on several hosts of as many ranks each,
        // one on each host, then one across); large ones: the ring.
        let exchange = |bytes| match direct(bytes, world) {
            true if hosts.as_ref().is_some_and(|h| h.per_host().is_some()) => Algorithm::HostsDirect,
            true => Algorithm::Direct,
            false => Algorithm::Ring,
        };
        // Single copy only where this call may be checked by the algorithm.
        let single_copy = single_copy && may_check_inline;
        let spread = |single_copy| match single_copy {
            true => Algorithm::SingleCopy,
            false if hosts.is_some() => Algorithm::Hierarchical,
            false => Algorithm::Ring,
        };
        let (algorithm, checks_inline) = match part {
            Collective::AllReduce { buf, red } => {
                // PREMUL_SUM scales the caller's buffer first: its call is
                // checked before, so not by single copy, which checks it itself.
                let checked_here = red.premul.is_none();
                match direct(buf.len, world) {
                    true => (exchange(buf.len), checked_here),
                    false => (spread(single_copy && checked_here), single_copy && checked_here),
                }
            }
            Collective::Barrier => (exchange(1), direct(1, world)),
            Collective::Reduce { buf, .. } => (rooted(buf.len), false),
            Collective::Broadcast { buf, .. } => match single_copy {
                true => (Algorithm::SingleCopy, true),
                false => (rooted(buf.len), false),
            },
            Collective::AllGather { .. } | Collective::ReduceScatter { .. } => (spread(single_copy), single_copy),
            Collective::Gather { .. } | Collective::Scatter { .. } | Collective::AllToAll { .. } => {
                (Algorithm::Pairwise, false)
            }
            Collective::MonitoredBarrier { .. } | Collective::AllReduceSparse { .. } => (Algorithm::OwnOnly, false),
        };
        Plan { algorithm, checks_inline: checks_inline && may_check_inline, arena: None, hosts }
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

/// Run `part`, whose buffers are `bufs`, in the arena (`in_arena`), its
/// call checked there as `fp` says.
fn run_in_arena(ctx: &OpCtx, arena: &Arena, part: &Collective, bufs: OpBufs, fp: &Fingerprint) -> Result<()> {
    let reducing = |red: &Reduction, root| Reducing { dtype: red.dtype, op: red.op, premul: red.premul, root };
    let rank = ctx.transport.rank();
    let OpBufs { inputs, own, mut outputs } = bufs;
    match part {
        Collective::AllReduce { red, .. } => arena_allreduce(ctx, arena, one(&mut outputs), &reducing(red, None), fp),
        Collective::Reduce { root, red, .. } => {
            arena_allreduce(ctx, arena, one(&mut outputs), &reducing(red, Some(*root)), fp)
        }
        Collective::Broadcast { root, .. } => {
            let buf = one(&mut outputs);
            let buf = if rank == *root { Cast::From(buf) } else { Cast::Into(buf) };
            arena_broadcast(ctx, arena, buf, *root, fp)
        }
        Collective::AllGather { .. } => arena_allgather(ctx, arena, own, &mut outputs, fp),
        Collective::ReduceScatter { red, .. } => {
            arena_reduce_scatter(ctx, arena, &inputs, own, one(&mut outputs), &reducing(red, None), fp)
        }
        Collective::AllToAll { .. } => arena_alltoall::arena_alltoall(ctx, arena, &inputs, own, &mut outputs, fp),
        Collective::Gather { root, .. } => arena_gather(ctx, arena, own, &mut outputs, *root, fp),
        Collective::Scatter { root, .. } => arena_scatter(ctx, arena, &inputs, own, one(&mut outputs), *root, fp),
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

/// Run one collective as `plan` says, on its buffers `bufs` (lent by the
/// engine, `engine::lend`): `fp` is the call, which the algorithm checks
/// where `plan.checks_inline` (the arena's rounds and the hosts' phases
/// compare it in any case).
pub fn run(ctx: &OpCtx, part: &Collective, mut bufs: OpBufs, plan: &Plan, fp: &Fingerprint) -> Result<()> {
    use Algorithm::*;
    let rank = ctx.transport.rank();
    let check = plan.checks_inline.then_some(fp);
    let apart = plan.hosts.as_ref();
    let hosts = || apart.expect("hierarchical algorithms are planned for groups on several hosts");
    match (plan.algorithm, part) {
        (Arena, _) => run_in_arena(ctx, plan.arena.as_ref().expect("planned with its arena"), part, bufs, fp),
        (algorithm, Collective::AllReduce { red, .. }) => {
            let buf = one(&mut bufs.outputs);
            let op = premultiply(buf, red);
            match algorithm {
                SingleCopy => single_copy_allreduce(ctx, buf, red.dtype, op, fp),
                Hierarchical => hierarchical_allreduce(ctx, buf, red.dtype, op, hosts(), fp),
                _ => all_reduce(ctx, algorithm, apart, buf, red.dtype, op, (check, fp)),
            }
        }
        (algorithm, Collective::Reduce { root, red, .. }) => {
            // PREMUL_SUM scales the root's buffer, which the op overwrites, in
            // place; the others' must stay as they were, so they send a scaled copy.
            let buf = one(&mut bufs.outputs);
            let mut copy = Scratch::new(0);
            let (input, op) = match rank == *root {
                true => {
                    let op = premultiply(buf, red);
                    (buf, op)
                }
                false => (premultiplied(&mut copy, ctx, buf, red), red.op),
            };
            match algorithm {
                Tree => tree_reduce(ctx, input, *root, red.dtype, op, apart, fp),
                _ => {
                    chained(ctx, apart, *root, Towards::Root, |ctx, root| ring_reduce(ctx, input, root, red.dtype, op))
                }
            }
        }
        (algorithm, Collective::Broadcast { root, .. }) => {
            let buf = one(&mut bufs.outputs);
            match algorithm {
                SingleCopy => single_copy_broadcast(ctx, buf, *root, fp),
                Tree => tree_broadcast(ctx, buf, *root, apart, fp),
                _ => chained(ctx, apart, *root, Towards::Others, |ctx, root| ring_broadcast(ctx, buf, root)),
            }
        }
        (SingleCopy, Collective::AllGather { .. }) => {
            let OpBufs { own, mut outputs, .. } = bufs;
            single_copy_allgather(ctx, own, &mut outputs, fp)
        }
        (algorithm, Collective::AllGather { .. }) => {
            let OpBufs { own, mut outputs, .. } = bufs;
            match algorithm {
                Hierarchical => hierarchical_allgather(ctx, own, &mut outputs, hosts(), fp),
                _ => ring_allgather(ctx, own, &mut outputs),
            }
        }
        (_, Collective::Gather { root, .. }) => {
            let OpBufs { own, mut outputs, .. } = bufs;
            direct_gather(ctx, own, &mut outputs, *root)
        }
        (_, Collective::Scatter { root, .. }) => {
            let OpBufs { inputs, own, mut outputs } = bufs;
            direct_scatter(ctx, &inputs, own, one(&mut outputs), *root)
        }
        (algorithm, Collective::ReduceScatter { red, .. }) => {
            let OpBufs { mut inputs, mut own, mut outputs } = bufs;
            let output = one(&mut outputs);
            // PREMUL_SUM scales copies of the inputs, which the caller keeps.
            let mut copy;
            if let Some(factor) = red.premul {
                copy = ctx.scratch(inputs.iter().map(|b| b.len()).sum::<usize>() + output.len());
                let mut rest = copy.bytes_mut();
                let mut scaled = |b: &[u8]| -> &[u8] {
                    let c = take_front(&mut rest, b.len());
                    ctx.copy_into(c, b);
                    scale(red.dtype, c, factor);
                    c
                };
                own = Some(scaled(own.unwrap_or(output)));
                for b in inputs.iter_mut().filter(|b| !b.is_empty()) {
                    *b = scaled(b);
                }
            }
            match algorithm {
                SingleCopy => single_copy_reduce_scatter(ctx, (&inputs, own), output, red.dtype, red.op, fp),
                Hierarchical => {
                    hierarchical_reduce_scatter(ctx, (&inputs, own), output, red.dtype, red.op, hosts(), fp)
                }
                _ => ring_reduce_scatter(ctx, &inputs, own, output, red.dtype, red.op),
            }
        }
        (_, Collective::AllToAll { .. }) => {
            let OpBufs { inputs, own, mut outputs } = bufs;
            pairwise_alltoall(ctx, &inputs, own, &mut outputs)
        }
        // An all-reduce of one byte: nobody finishes before everybody has arrived.
        (algorithm, Collective::Barrier) => {
            let mut one = Scratch::new(1);
            all_reduce(ctx, algorithm, apart, one.bytes_mut(), DType::U8, ReduceOp::BOr, (check, fp))
        }
        (_, Collective::MonitoredBarrier { wait_all, timeout }) => {
            monitored_barrier(ctx, *wait_all, timeout.unwrap_or(ctx.timeout))
        }
        (_, Collective::AllReduceSparse { indices, values, shape, out, .. }) => {
            let rows = shape.rows(indices, values).expect("checked by Collective::check");
            let OpBufs { inputs, .. } = bufs;
            *out.lock().unwrap() = sparse_allreduce(ctx, inputs[0], inputs[1], rows, shape)?;
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

/// An all-reduce by one of the exchanges (`Direct`, `HostsDirect`) or the
/// ring. `check`: the call, if checked here; `fp`: the call.
fn all_reduce(
    ctx: &OpCtx,
    algorithm: Algorithm,
    apart: Option<&Hosts>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    (check, fp): (Option<&Fingerprint>, &Fingerprint),
) -> Result<()> {
    match (algorithm, apart) {
        (Algorithm::HostsDirect, Some(hosts)) => hierarchical_direct_allreduce(ctx, buf, dtype, op, hosts, check, fp),
        (Algorithm::Direct, _) => direct_allreduce(ctx, buf, dtype, op, check),
        _ => {
            debug_assert_eq!(algorithm, Algorithm::Ring, "planned for an all-reduce");
            debug_assert!(check.is_none(), "the ring checks the call before it starts");
            ring_allreduce(ctx, buf, dtype, op)
        }
    }
}

/// The one buffer of an op that has one (all-reduce, reduce, broadcast, and
/// the one output of reduce-scatter and scatter): `OpBufs::outputs`.
fn one<'a>(outputs: &mut [&'a mut [u8]]) -> &'a mut [u8] {
    std::mem::take(&mut outputs[0])
}

/// PREMUL_SUM on a buffer the op overwrites anyway: scale it in place, then sum.
fn premultiply(buf: &mut [u8], red: &Reduction) -> ReduceOp {
    if let Some(f) = red.premul {
        scale(red.dtype, buf, f);
    }
    red.op
}

/// PREMUL_SUM on an input the caller keeps: a scaled copy of `buf` in
/// `scratch` (taken from the pool here); without PREMUL_SUM `buf` itself.
fn premultiplied<'s, 'a>(
    scratch: &'s mut Scratch<'a>,
    ctx: &OpCtx<'a>,
    buf: &'s mut [u8],
    red: &Reduction,
) -> &'s mut [u8] {
    let Some(factor) = red.premul else { return buf };
    *scratch = ctx.scratch(buf.len());
    let copy = scratch.bytes_mut();
    ctx.copy_into(copy, buf);
    scale(red.dtype, copy, factor);
    copy
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{ScratchPool, What};
    use crate::dtype::BYTES;
    use crate::ops::RawBuf;
    use crate::transport::fake::{FakeNet, FakeTransport};
    use std::time::{Duration, Instant};

    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;
    /// The defaults (config.rs): all-reduces up to 16 KiB go direct, messages
    /// from 64 KiB go as addresses (`with_single_copy`), arena slots of 1 MiB.
    const SMALL: usize = 16 * KIB;
    const SINGLE_COPY: Option<usize> = Some(64 * KIB);
    const SLOT: usize = MIB;

    fn buf(len: usize) -> RawBuf {
        // Planning reads lengths only: nothing is ever read or written here.
        RawBuf::new(std::ptr::NonNull::<u8>::dangling().as_ptr(), len)
    }

    fn sum(premul: Option<f64>) -> Reduction {
        Reduction { premul, ..Reduction::new(DType::F32, ReduceOp::Sum) }
    }

    /// Every collective the table covers, of `bytes` per rank (per block where
    /// the op has a block per rank) on a group of `world`.
    fn ops(bytes: usize, world: usize) -> Vec<(&'static str, Collective)> {
        let blocks = || vec![buf(bytes); world];
        vec![
            ("all_reduce", Collective::AllReduce { buf: buf(bytes * world), red: sum(None) }),
            ("all_reduce premul", Collective::AllReduce { buf: buf(bytes * world), red: sum(Some(0.5)) }),
            ("broadcast", Collective::Broadcast { buf: buf(bytes), root: 0, dtype: BYTES }),
            ("reduce", Collective::Reduce { buf: buf(bytes), root: 0, red: sum(None) }),
            ("all_gather", Collective::AllGather { input: buf(bytes), outputs: blocks(), dtype: BYTES }),
            ("reduce_scatter", Collective::ReduceScatter { inputs: blocks(), output: buf(bytes), red: sum(None) }),
            ("gather", Collective::Gather { input: buf(bytes), outputs: blocks(), root: 0, dtype: BYTES }),
            ("all_to_all", Collective::AllToAll { inputs: blocks(), outputs: blocks(), dtype: BYTES }),
            ("barrier", Collective::Barrier),
            ("monitored_barrier", Collective::MonitoredBarrier { wait_all: false, timeout: None }),
        ]
    }

    /// What rank 0 of `net` plans for `part`: the algorithm, and whether it
    /// checks the call itself.
    fn planned(net: &[Arc<FakeTransport>], part: &Collective, may_check_inline: bool) -> (Algorithm, bool) {
        let (pool, cost) = (ScratchPool::default(), Default::default());
        let ctx = OpCtx {
            transport: &*net[0],
            seq: 0,
            timeout: Duration::from_secs(5),
            deadline: Instant::now() + Duration::from_secs(5),
            what: What::new("plan", 0, 0),
            segment_bytes: MIB,
            small_allreduce_bytes: SMALL,
            pool: &pool,
            spin: Duration::ZERO,
            piece: 0,
            phase: 0,
            cost: &cost,
        };
        let plan = Plan::of(&ctx, part, may_check_inline);
        (plan.algorithm, plan.checks_inline)
    }

    /// The route of every collective at 8 B, 32 KiB and 1 MiB (per rank or
    /// block) on each kind of group: one row per op, "algorithm/inline" at
    /// each size, "before" where the call is checked before the algorithm.
    fn table(net: &[Arc<FakeTransport>], may_check_inline: bool) -> Vec<String> {
        let world = net.len();
        let sizes = [8, 32 * KIB, MIB];
        let per_size: Vec<Vec<(&str, Collective)>> = sizes.iter().map(|&b| ops(b, world)).collect();
        (0..per_size[0].len())
            .map(|i| {
                let cells: Vec<String> = per_size
                    .iter()
                    .map(|ops| {
                        let (algorithm, inline) = planned(net, &ops[i].1, may_check_inline);
                        format!("{algorithm:?}/{}", if inline { "inline" } else { "before" })
                    })
                    .collect();
                format!("{}: {}", per_size[0][i].0, cells.join(" "))
            })
            .collect()
    }

    #[track_caller]
    fn pinned(net: &[Arc<FakeTransport>], may_check_inline: bool, expected: &str) {
        let expected: Vec<String> =
            expected.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect();
        assert_eq!(table(net, may_check_inline), expected);
    }

    /// A change of route for any size, group or topology fails here: change
    /// the table only together with the benchmark that justifies it.
    #[test]
    fn each_collective_takes_the_algorithm_pinned_for_its_size_and_group() {
        // One host, TCP and rings only.
        pinned(
            &FakeNet::new(4),
            true,
            "all_reduce: Direct/inline Ring/before Ring/before
             all_reduce premul: Direct/before Ring/before Ring/before
             broadcast: Tree/before Chain/before Chain/before
             reduce: Tree/before Chain/before Chain/before
             all_gather: Ring/before Ring/before Ring/before
             reduce_scatter: Ring/before Ring/before Ring/before
             gather: Pairwise/before Pairwise/before Pairwise/before
             all_to_all: Pairwise/before Pairwise/before Pairwise/before
             barrier: Direct/inline Direct/inline Direct/inline
             monitored_barrier: OwnOnly/before OwnOnly/before OwnOnly/before",
        );
        // Wider than the direct exchange goes (16 ranks).
        pinned(
            &FakeNet::new(17),
            true,
            "all_reduce: Ring/before Ring/before Ring/before
             all_reduce premul: Ring/before Ring/before Ring/before
             broadcast: Chain/before Chain/before Chain/before
             reduce: Chain/before Chain/before Chain/before
             all_gather: Ring/before Ring/before Ring/before
             reduce_scatter: Ring/before Ring/before Ring/before
             gather: Pairwise/before Pairwise/before Pairwise/before
             all_to_all: Pairwise/before Pairwise/before Pairwise/before
             barrier: Ring/before Ring/before Ring/before
             monitored_barrier: OwnOnly/before OwnOnly/before OwnOnly/before",
        );
        // Every rank reads the others' memory, no arena (RUSTC10D_ARENA_SLOT_BYTES=0).
        pinned(
            &FakeNet::with_single_copy(4, SINGLE_COPY),
            true,
            "all_reduce: Direct/inline Ring/before SingleCopy/inline
             all_reduce premul: Direct/before Ring/before Ring/before
             broadcast: Tree/before Chain/before SingleCopy/inline
             reduce: Tree/before Chain/before Chain/before
             all_gather: Ring/before Ring/before SingleCopy/inline
             reduce_scatter: Ring/before Ring/before SingleCopy/inline
             gather: Pairwise/before Pairwise/before Pairwise/before
             all_to_all: Pairwise/before Pairwise/before Pairwise/before
             barrier: Direct/inline Direct/inline Direct/inline
             monitored_barrier: OwnOnly/before OwnOnly/before OwnOnly/before",
        );
        // The pieces of a staged op, checked before: no single copy.
        pinned(
            &FakeNet::with_single_copy(4, SINGLE_COPY),
            false,
            "all_reduce: Direct/before Ring/before Ring/before
             all_reduce premul: Direct/before Ring/before Ring/before
             broadcast: Tree/before Chain/before Chain/before
             reduce: Tree/before Chain/before Chain/before
             all_gather: Ring/before Ring/before Ring/before
             reduce_scatter: Ring/before Ring/before Ring/before
             gather: Pairwise/before Pairwise/before Pairwise/before
             all_to_all: Pairwise/before Pairwise/before Pairwise/before
             barrier: Direct/before Direct/before Direct/before
             monitored_barrier: OwnOnly/before OwnOnly/before OwnOnly/before",
        );
        // One host with an arena (the default there).
        pinned(
            &FakeNet::with_arena(4, SLOT, None),
            true,
            "all_reduce: Arena/inline Arena/inline Arena/inline
             all_reduce premul: Arena/inline Arena/inline Arena/inline
             broadcast: Arena/inline Arena/inline Arena/inline
             reduce: Arena/inline Arena/inline Arena/inline
             all_gather: Arena/inline Arena/inline Arena/inline
             reduce_scatter: Arena/inline Arena/inline Arena/inline
             gather: Arena/inline Arena/inline Arena/inline
             all_to_all: Arena/inline Arena/inline Arena/inline
             barrier: Arena/inline Arena/inline Arena/inline
             monitored_barrier: OwnOnly/before OwnOnly/before OwnOnly/before",
        );
        // An arena and single copy: large blocks go as addresses, small ones
        // through the arena; an all-reduce that fits a round stays there.
        pinned(
            &FakeNet::with_arena(4, SLOT, SINGLE_COPY),
            true,
            "all_reduce: Arena/inline Arena/inline SingleCopy/inline
             all_reduce premul: Arena/inline Arena/inline Arena/inline
             broadcast: Arena/inline Arena/inline SingleCopy/inline
             reduce: Arena/inline Arena/inline Arena/inline
             all_gather: Arena/inline Arena/inline SingleCopy/inline
             reduce_scatter: Arena/inline Arena/inline SingleCopy/inline
             gather: Arena/inline Arena/inline Pairwise/before
             all_to_all: Arena/inline Arena/inline Arena/inline
             barrier: Arena/inline Arena/inline Arena/inline
             monitored_barrier: OwnOnly/before OwnOnly/before OwnOnly/before",
        );
        // Two hosts of two ranks each, with or without an arena on each host
        // (which only the hierarchical algorithms' phases use).
        let two_by_two = "all_reduce: HostsDirect/inline Hierarchical/before Hierarchical/before
             all_reduce premul: HostsDirect/before Hierarchical/before Hierarchical/before
             broadcast: Tree/before Chain/before Chain/before
             reduce: Tree/before Chain/before Chain/before
             all_gather: Hierarchical/before Hierarchical/before Hierarchical/before
             reduce_scatter: Hierarchical/before Hierarchical/before Hierarchical/before
             gather: Pairwise/before Pairwise/before Pairwise/before
             all_to_all: Pairwise/before Pairwise/before Pairwise/before
             barrier: HostsDirect/inline HostsDirect/inline HostsDirect/inline
             monitored_barrier: OwnOnly/before OwnOnly/before OwnOnly/before";
        pinned(&FakeNet::on_hosts(vec![0, 0, 1, 1]), true, two_by_two);
        pinned(&FakeNet::on_hosts_with_arenas(vec![0, 0, 1, 1], SLOT), true, two_by_two);
        // Hosts of unequal sizes: the small exchanges go among all ranks at once.
        pinned(
            &FakeNet::on_hosts(vec![0, 0, 0, 1]),
            true,
            "all_reduce: Direct/inline Hierarchical/before Hierarchical/before
             all_reduce premul: Direct/before Hierarchical/before Hierarchical/before
             broadcast: Tree/before Chain/before Chain/before
             reduce: Tree/before Chain/before Chain/before
             all_gather: Hierarchical/before Hierarchical/before Hierarchical/before
             reduce_scatter: Hierarchical/before Hierarchical/before Hierarchical/before
             gather: Pairwise/before Pairwise/before Pairwise/before
             all_to_all: Pairwise/before Pairwise/before Pairwise/before
             barrier: Direct/inline Direct/inline Direct/inline
             monitored_barrier: OwnOnly/before OwnOnly/before OwnOnly/before",
        );
    }
}
