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
use crate::error::Result;
use crate::reduce::divide_by;

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
    let slot = |p: usize| RawBuf::new(unsafe { slots.ptr.add(p * len) }, len);
    let key = ctx.key(0);
    // Data arrives from every peer before the check: check every peer's call.
    let mut agreement = check.map(|mine| Agreement::new(mine, true));
    let tr = &mut ctx.transfers();
    if let Some(a) = &mut agreement {
        a.post(ctx, tr)?;
    }
    let agreed = |tr: &crate::transport::Transfers| agreement.as_ref().map_or(Ok(()), |a| a.check(ctx, tr));
    if world == 1 || len == 0 {
        return agreed(tr).and_then(|()| tr.wait_all());
    }
    for p in ctx.peers() {
        unsafe { tr.recv(p, key, slot(p).ptr, len)? };
    }
    for p in ctx.peers() {
        unsafe { tr.send(p, key, buf.slice(0, len))? };
    }
    // The calls agree, everything is received, and our buffer sent, before it is overwritten.
    agreed(tr)?;
    tr.wait_all()?;
    unsafe {
        ctx.copy(slot(rank), buf);
        ctx.copy(buf, slot(0));
    }
    let acc = unsafe { buf.slice_mut(0, len) };
    for p in 1..world {
        ctx.reduce_into(dtype, op, acc, unsafe { slot(p).slice(0, len) });
    }
    if op == ReduceOp::Avg {
        divide_by(dtype, acc, world);
    }
    Ok(())
}
