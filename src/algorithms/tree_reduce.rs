//! Tree reduce, for small messages: `tree_broadcast`'s tree, the other way.
//! On several hosts each rank of a host other than the root's sends its
//! buffer to its host's lowest rank, which folds them into its own and sends
//! that to the root; the root's host mates send to the root directly. Two
//! hops at most instead of the chain's W-1, and each host's link carries the
//! message once. On one host every rank sends to the root. Where a host's
//! ranks share an arena (`Hosts::arena`), the hop on that host is the
//! arena's reduce to the rank that sums the host's part: one stage. Only the
//! root's buffer is written, once everything has arrived.
//!
//! Bytes copied (`Cost`), for n bytes: a rank with nothing to fold n (sent);
//! a host's lowest rank n per rank it hears from (received) and as much
//! folded, n copied and n sent; the root n per rank it hears from received
//! and as much folded. In a host's arena, every rank n into its slot and the
//! rank that sums n per rank folded (see the arena's all-reduce).

use super::arena_allreduce::{arena_allreduce, Reducing};
use super::call_check::Fingerprint;
use super::hosts::Hosts;
use super::tree_broadcast::{tree, HostHop};
use super::{OpCtx, RawBuf};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;

/// `fp`: the call, for a host's arena to compare.
pub fn tree_reduce(
    ctx: &OpCtx,
    buf: RawBuf,
    root: usize,
    dtype: DType,
    op: ReduceOp,
    hosts: Option<&Hosts>,
    fp: &Fingerprint,
) -> Result<()> {
    let world = ctx.transport.size();
    if world == 1 {
        return Ok(());
    }
    let on_host = hosts.and_then(|h| HostHop::of(ctx, h, root));
    let (parent, children) = tree(ctx, root, hosts, on_host.is_some());
    let len = buf.len;
    // One slot per child, and the sum for a rank that passes one on or
    // gets its host's from the arena (the root's buffer waits for the end).
    let head = on_host.as_ref().is_some_and(HostHop::is_head);
    let own_sum = (parent.is_some() && !children.is_empty()) || head;
    let mut scratch = ctx.scratch(len * (children.len() + own_sum as usize));
    // A slot per child, and one more where `own_sum`.
    let slots = scratch.raw();
    let slot = |c: usize| slots.sub(c * len, len);
    let sum = if own_sum { slot(children.len()) } else { buf };
    // An average divides once, by W, at the root.
    let fold = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    let tr = &mut ctx.transfers();
    for (c, &child) in children.iter().enumerate() {
        // SAFETY: slot c of the scratch (taken before `tr`), filled by this
        // receive alone: each child has a slot of its own.
        unsafe { tr.recv_raw(child, ctx.key(0), slot(c).ptr, len)? };
    }
    match &on_host {
        Some(hop) => {
            // The rank that sums reads its buffer from `sum` and gets the host's sum there.
            if head {
                // SAFETY: `sum` is the scratch slot after the children's, in no transfer;
                // the buffer is the op's, only read.
                unsafe { ctx.copy(sum, buf) };
            }
            let how = Reducing { dtype, op: fold, premul: None, root: Some(hop.head) };
            arena_allreduce(&ctx.phase(&hop.view, 1), &hop.arena, if head { sum } else { buf }, &how, fp)?;
            if !head {
                return Ok(());
            }
            tr.wait_all()?;
        }
        None => {
            tr.wait_all()?;
            // SAFETY: every receive is done; `sum` is the buffer itself (then `copy`
            // skips it) or a scratch slot no transfer touches.
            unsafe { ctx.copy(sum, buf) };
        }
    }
    for c in 0..children.len() {
        // SAFETY: after every receive is done: `sum` (the buffer or its own
        // scratch slot) and slot c are different memory, and no transfer
        // touches either.
        ctx.reduce_into(dtype, fold, unsafe { sum.slice_mut(0, len) }, unsafe { slot(c).slice(0, len) });
    }
    match parent {
        None => {
            if op == ReduceOp::Avg {
                // SAFETY: the root's `sum`: no transfer touches it (the root sends nothing).
                divide_by(dtype, unsafe { sum.slice_mut(0, len) }, world);
            }
            // SAFETY: the root's buffer and `sum`, neither in a transfer (in place the
            // same memory: `copy` skips it).
            unsafe { ctx.copy(buf, sum) };
        }
        // SAFETY: `sum` is only read by the send and not written again before
        // `tr` is done.
        Some(parent) => unsafe {
            tr.send_raw(parent, ctx.key(0), sum.slice(0, len))?;
        },
    }
    tr.wait_all()
}
