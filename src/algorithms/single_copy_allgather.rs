//! All-gather in one step when every rank reads the others' memory
//! (`Transport::single_copy_bytes`): every rank sends its block to every
//! other as its address, and reads every other rank's block straight into
//! its place, all at once, instead of W-1 steps around the ring. The calls
//! are checked with every rank before any data moves (see call_check).
//!
//! Bytes copied per rank: its own block once, and every other rank's block
//! once (the ring also copies W-1 blocks out: 2W-1 blocks, or W with single
//! copy, in W-1 steps).

use super::call_check::{agree_with_all, Fingerprint};
use super::{OpCtx, RawBuf};
use crate::error::Result;

/// `outputs[i]` receives rank i's `input` (`outputs[rank]` has `input.len` bytes).
pub fn single_copy_allgather(ctx: &OpCtx, input: RawBuf, outputs: &[RawBuf], check: &Fingerprint) -> Result<()> {
    let tr = &mut ctx.transfers();
    agree_with_all(ctx, tr, check)?;
    for p in ctx.peers() {
        // SAFETY: outputs[p], p != rank, the op's buffer: filled by this receive
        // alone (each peer's block is received once).
        unsafe { tr.recv_raw(p, ctx.key(0), outputs[p].ptr, outputs[p].len)? };
    }
    for p in ctx.peers() {
        // SAFETY: the op's input, only read by the sends; it is in no receive (at
        // most it is outputs[rank], in place, which nothing receives into).
        unsafe { tr.send_raw(p, ctx.key(0), input.slice(0, input.len))? };
    }
    // SAFETY: outputs[rank] is in no transfer; the input is only read (in
    // place the same memory, which `copy` skips).
    unsafe { ctx.copy(outputs[ctx.transport.rank()], input) };
    tr.wait_all()
}
