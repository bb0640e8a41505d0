//! Allreduce for small messages: every rank sends its buffer to every other
//! rank and reduces all of them locally, in rank order, so all ranks end
//! bit-identical. One exchange instead of 2(W-1) ring steps.
//!
//! Bytes copied (`Cost`), per rank, for n bytes: 2n (its own into its slot,
//! the first slot into the buffer) + (W-1)n received + (W-1)n folded +
//! (W-1)n sent through the rings (small messages never go as addresses).

use super::call_check::{Agreement, Fingerprint};
use super::OpCtx;
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
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    check: Option<&Fingerprint>,
) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let len = buf.len();
    let mut scratch = ctx.scratch(len * world);
    let key = ctx.key(0);
    // Data arrives from every peer before the check: check every peer's call.
    let mut agreement = check.map(|mine| Agreement::new(mine, true));
    // The exchange: the buffer sent to every peer, a slot of the scratch
    // received from each. The buffer is written only once the scope is over.
    ctx.with_transfers(|tr| {
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
        for (p, slot) in scratch.bytes_mut().chunks_mut(len).enumerate().filter(|&(p, _)| p != rank) {
            // Given back with the scope, once `wait_all` says it is filled.
            let _lent = tr.recv(p, key, slot).map_err(|e| explained(tr, e))?;
        }
        for p in ctx.peers() {
            tr.send(p, key, buf).map_err(|e| explained(tr, e))?;
        }
        // The calls agree, and everything is received and our buffer sent, before it is overwritten.
        agreed(tr)?;
        tr.wait_all()
    })?;
    if world == 1 || len == 0 {
        return Ok(());
    }
    // Folded in rank order, on every rank the same: slot p holds rank p's buffer.
    let mut slots: Vec<&mut [u8]> = scratch.bytes_mut().chunks_mut(len).collect();
    ctx.copy_into(slots[rank], buf);
    ctx.copy_into(buf, slots[0]);
    for slot in &slots[1..] {
        ctx.reduce_into(dtype, op, buf, slot);
    }
    if op == ReduceOp::Avg {
        divide_by(dtype, buf, world);
    }
    Ok(())
}
