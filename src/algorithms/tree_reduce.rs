//! Tree reduce, for small messages: `tree_broadcast`'s tree, the other way.
//! On several hosts each rank of a host other than the root's sends its
//! buffer to its host's lowest rank, which folds them into its own and sends
//! that to the root; the root's host mates send to the root directly. Two
//! hops at most instead of the chain's W-1, and each host's link carries the
//! message once. On one host every rank sends to the root. Only the root's
//! buffer is written, once everything has arrived.
//!
//! Bytes copied (`Cost`), for n bytes: a rank with nothing to fold n (sent);
//! a host's lowest rank n per rank it hears from (received) and as much
//! folded, n copied and n sent; the root n per rank it hears from received
//! and as much folded.

use super::hosts::Hosts;
use super::tree_broadcast::tree;
use super::{OpCtx, RawBuf};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::divide_by;

pub fn tree_reduce(
    ctx: &OpCtx,
    buf: RawBuf,
    root: usize,
    dtype: DType,
    op: ReduceOp,
    hosts: Option<&Hosts>,
) -> Result<()> {
    let world = ctx.transport.size();
    if world == 1 {
        return Ok(());
    }
    let (parent, children) = tree(ctx, root, hosts);
    let len = buf.len;
    // One slot per child, and, for a rank that passes a sum on, the sum.
    let passes_on = parent.is_some() && !children.is_empty();
    let mut scratch = ctx.scratch(len * (children.len() + passes_on as usize));
    let slots = scratch.raw();
    let slot = |c: usize| RawBuf::new(unsafe { slots.ptr.add(c * len) }, len);
    let tr = &mut ctx.transfers();
    for (c, &child) in children.iter().enumerate() {
        unsafe { tr.recv(child, ctx.key(0), slot(c).ptr, len)? };
    }
    tr.wait_all()?;
    // The root folds into its buffer; a rank that passes a sum on, into scratch.
    let sum = if passes_on { slot(children.len()) } else { buf };
    unsafe { ctx.copy(sum, buf) };
    for c in 0..children.len() {
        ctx.reduce_into(dtype, op, unsafe { sum.slice_mut(0, len) }, unsafe { slot(c).slice(0, len) });
    }
    match parent {
        // An average divides once, by W, at the root.
        None if op == ReduceOp::Avg => divide_by(dtype, unsafe { buf.slice_mut(0, len) }, world),
        None => {}
        Some(parent) => unsafe {
            tr.send(parent, ctx.key(0), sum.slice(0, len))?;
        },
    }
    tr.wait_all()
}
