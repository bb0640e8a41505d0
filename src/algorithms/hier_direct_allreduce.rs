//! All-reduce of small messages on several hosts of L ranks each: the direct
//! exchange among each host's ranks leaves all of them with the host's sum;
//! then the i-th ranks of all hosts exchange those sums directly. Two
//! exchanges, as the one over all W ranks is, but each rank sends H-1
//! messages across hosts instead of W-L, and L-1 through shared memory: at
//! 2 hosts of 4, 4 messages cross the link each way per op instead of 16,
//! and each rank handles 4 messages instead of 7.
//!
//! On hosts whose ranks share an arena (`Hosts::arena`), the exchange on the
//! host is the arena's all-reduce instead: one stage, in which each rank
//! writes its buffer once and reads every other rank's.
//!
//! Every rank of a host folds the same sums in the same order, and so does
//! every rank across hosts: all ranks end bit-identical (summed host by
//! host, which is another order than the flat exchange's).
//!
//! With the call check inline, every rank sends its fingerprint at once to
//! its host's ranks, its counterparts and its right neighbour (the one the
//! ring algorithms' check sends to, so that a rank that took another
//! algorithm is caught too), and checks theirs before it sends its host's
//! sum on; where the host's ranks share an arena, they compare their calls
//! there, and the fingerprints go only to the counterparts and the
//! neighbour. The sums are made in scratch memory: a failed op leaves the
//! caller's buffer as it was.
//!
//! Bytes copied (`Cost`), per rank, for n bytes: 2n (in and out of scratch)
//! and those of the two direct exchanges, of L and H ranks (the arena's
//! all-reduce of L ranks for the first).

use super::arena_allreduce::{arena_allreduce, Reducing};
use super::call_check::{Agreement, Fingerprint};
use super::hosts::Hosts;
use super::{direct_allreduce, OpCtx};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;
use crate::transport::group::subgroup::Subgroup;

/// `hosts` must hold as many ranks each (`Hosts::per_host`); `check`: the
/// call, if checked here; `fp`: the call, for the arena's round to compare.
pub fn hierarchical_direct_allreduce(
    ctx: &OpCtx,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    hosts: &Hosts,
    check: Option<&Fingerprint>,
    fp: &Fingerprint,
) -> Result<()> {
    let (host, i) = hosts.locate(ctx.transport.rank());
    let (mates, counterparts) = (&hosts.members[host], hosts.counterparts(i));
    let on_host = Subgroup::new(ctx.transport, mates.clone());
    let across = Subgroup::new(ctx.transport, counterparts.clone());
    let arena = Hosts::arena(&on_host);
    let mut scratch = ctx.scratch(buf.len());
    let sums = scratch.bytes_mut();
    let told = if arena.is_some() { counterparts.clone() } else { [mates.as_slice(), &counterparts].concat() };
    let mut agreement = check.map(|mine| Agreement::among(mine, ctx, &told));
    let tr = &mut ctx.transfers();
    if let Some(a) = &mut agreement {
        a.post(ctx, tr);
    }
    // `tr` holds only the agreement's own messages: the buffer and the sums
    // are in no transfer of it.
    ctx.copy_into(sums, buf);
    // An average divides once, by W, after the sums across hosts.
    let sum = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    let host_sum = match &arena {
        Some(arena) => {
            let how = Reducing { dtype, op: sum, premul: None, root: None };
            arena_allreduce(&ctx.phase(&on_host, 1), arena, sums, &how, fp)
        }
        None => direct_allreduce(&ctx.phase(&on_host, 1), sums, dtype, sum, None),
    };
    // A mismatch explains a failed exchange better than what it broke.
    if let Some(a) = &agreement {
        a.check(ctx, tr)?;
    }
    host_sum?;
    direct_allreduce(&ctx.phase(&across, 2), sums, dtype, sum, None)?;
    tr.wait_all()?;
    if op == ReduceOp::Avg {
        divide_by(dtype, sums, ctx.transport.size());
    }
    ctx.copy_into(buf, sums);
    Ok(())
}
