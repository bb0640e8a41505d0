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
use super::{take_front, OpCtx};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;

/// `fp`: the call, for a host's arena to compare.
pub fn tree_reduce(
    ctx: &OpCtx,
    buf: &mut [u8],
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
    let len = buf.len();
    // One slot per child, and the sum for a rank that passes one on or
    // gets its host's from the arena (the root's buffer waits for the end).
    let head = on_host.as_ref().is_some_and(HostHop::is_head);
    let own_sum = (parent.is_some() && !children.is_empty()) || head;
    let mut scratch = ctx.scratch(len * (children.len() + own_sum as usize));
    // An average divides once, by W, at the root.
    let fold = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    ctx.with_transfers(|tr| {
        let mut rest = scratch.bytes_mut();
        let mut slots = Vec::with_capacity(children.len());
        for &child in &children {
            slots.push(tr.recv(child, ctx.key(0), take_front(&mut rest, len))?);
        }
        // The sum starts as this rank's buffer, or a copy of it (`out`: where
        // the root's goes at the end).
        let (sum, out) = match own_sum {
            true => {
                let sum = take_front(&mut rest, len);
                ctx.copy_into(sum, buf);
                (sum, Some(buf))
            }
            false => (buf, None),
        };
        if let Some(hop) = &on_host {
            let how = Reducing { dtype, op: fold, premul: None, root: Some(hop.head) };
            arena_allreduce(&ctx.phase(&hop.view, 1), &hop.arena, sum, &how, fp)?;
            if !head {
                return Ok(());
            }
        }
        for slot in slots {
            ctx.reduce_into(dtype, fold, sum, tr.give_back(slot)?);
        }
        match parent {
            None => {
                if op == ReduceOp::Avg {
                    divide_by(dtype, sum, world);
                }
                if let Some(out) = out {
                    ctx.copy_into(out, sum);
                }
            }
            Some(parent) => {
                tr.send(parent, ctx.key(0), sum)?;
            }
        }
        tr.wait_all()
    })
}
