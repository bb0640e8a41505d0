//! Allreduce for small messages: every rank sends its buffer to every other
//! rank and reduces all of them locally, in rank order, so all ranks end
//! bit-identical. One exchange instead of 2(W-1) ring steps.
//!
//! Bytes copied (`Cost`), per rank, for n bytes: 2n (its own into its slot,
//! the first slot into the buffer) + (W-1)n received + (W-1)n folded +
//! (W-1)n sent through the rings (small messages never go as addresses).

use super::call_check::{Agreement, Fingerprint};
use super::{OpCtx, RawBuf};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::divide_by;
use crate::transport::Transfers;

/// Groups up to this size may take the direct path (each rank receives W-1 copies).
const SMALL_MAX_WORLD: usize = 16;

/// Whether `direct_allreduce` is the better algorithm for this op
/// (`threshold`: Config::small_allreduce_bytes).
pub fn prefers_direct(bytes: usize, world: usize, threshold: usize) -> bool {
    bytes <= threshold && world <= SMALL_MAX_WORLD
}

/// With `check`, the call check (see call_check) runs alongside the exchange,
/// against every peer, instead of before it: one round trip less.
pub fn direct_allreduce(
    ctx: &OpCtx,
    buf: RawBuf,
    dtype: DType,
    op: ReduceOp,
    check: Option<&Fingerprint>,
) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let len = buf.len;
    let mut scratch = ctx.scratch(len * world);
    let slots = scratch.raw();
    // SAFETY: p < world and the scratch holds len * world bytes: slot p lies
    // inside it.
    let slot = |p: usize| RawBuf::new(unsafe { slots.ptr.add(p * len) }, len);
    let key = ctx.key(0);
    // Data arrives from every peer before the check: check every peer's call.
    let mut agreement = check.map(|mine| Agreement::new(mine, true));
    let tr = &mut ctx.transfers();
    if let Some(a) = &mut agreement {
        a.post(ctx, tr);
    }
    let agreed = |tr: &Transfers| agreement.as_ref().map_or(Ok(()), |a| a.check(ctx, tr));
    // A failure before the check may come of a mismatch (a peer that saw it left): say so if it does.
    let explained = |tr: &Transfers, e: Error| match &agreement {
        Some(a) => a.explain(ctx, tr, e),
        None => e,
    };
    if world == 1 || len == 0 {
        return agreed(tr).and_then(|()| tr.wait_all());
    }
    for p in ctx.peers() {
        // SAFETY: slot p (p != rank) of the scratch, which outlives `tr`, filled
        // by this receive alone: each peer has a slot of its own.
        unsafe { tr.recv_raw(p, key, slot(p).ptr, len) }.map_err(|e| explained(tr, e))?;
    }
    for p in ctx.peers() {
        // SAFETY: the op's buffer, only read by the sends; nothing writes it until
        // `tr.wait_all` below says every send is done.
        unsafe { tr.send_raw(p, key, buf.slice(0, len)) }.map_err(|e| explained(tr, e))?;
    }
    // The calls agree, everything is received, and our buffer sent, before it is overwritten.
    agreed(tr)?;
    tr.wait_all()?;
    // SAFETY: every transfer is done (`wait_all`): the buffer and the slots
    // are this rank's alone; slot(rank) and slot(0) are scratch, the
    // buffer is the op's, so neither copy overlaps.
    unsafe {
        ctx.copy(slot(rank), buf);
        ctx.copy(buf, slot(0));
    }
    // SAFETY: the op's buffer, with every transfer done: nothing else
    // touches it while the folds run.
    let acc = unsafe { buf.slice_mut(0, len) };
    for p in 1..world {
        // SAFETY: a scratch slot, filled by a receive waited for above; other
        // memory than `acc`.
        ctx.reduce_into(dtype, op, acc, unsafe { slot(p).slice(0, len) });
    }
    if op == ReduceOp::Avg {
        divide_by(dtype, acc, world);
    }
    Ok(())
}
