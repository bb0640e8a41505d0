//! All-to-all in the shared arena. A first round checks the call and
//! shows every rank every pair's sizes (each rank writes how much it sends
//! to and expects from each rank into its slot), so that a pair that
//! disagrees fails on every rank, and every rank knows the largest block.
//! Where every block is large enough to go as its address (single copy), the
//! pairs then exchange directly, one copy per byte; otherwise each further
//! round takes up to 1/W of a slot from each block, at the same offset in
//! each: every rank copies its parts into its slot, part p at p/W of it,
//! and after one stage copies part `rank` of every rank's slot into place.
//! Nothing of the caller's is written before a round's stage.
//!
//! Bytes copied (`Cost`), per rank, through the arena: 2 per byte sent.
//! Stages: 1, and 1 per slot / W of the largest block.

use super::call_check::Fingerprint;
use super::in_arena::{part, round};
use super::{pairwise_alltoall, OpCtx, RawBuf};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::group::arena::Arena;

/// Whether a slot holds a rank's sizes (16 bytes per peer), and 16 bytes
/// of a block for each rank per round.
pub fn fits(arena: &Arena, world: usize) -> bool {
    arena.slot_bytes() >= 16 * world
}

/// `inputs[p]` goes to rank p, `outputs[p]` comes from rank p (sizes may differ per pair).
pub fn arena_alltoall(
    ctx: &OpCtx,
    arena: &Arena,
    inputs: &[RawBuf],
    outputs: &[RawBuf],
    fp: &Fingerprint,
) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    // The sizes and each round's parts are laid out for exactly world blocks each way.
    assert!(inputs.len() == world && outputs.len() == world, "arena_alltoall: one block per rank each way");
    let deadline = ctx.deadline;
    let (mut largest, mut smallest) = (0, usize::MAX);
    {
        let mut r = round(ctx, arena, fp, 0, deadline)?;
        let slots: Vec<*mut u64> = (0..world).map(|p| r.slot(p, 16 * world).ptr.cast()).collect();
        let sizes = |p: usize| slots[p];
        let mine: Vec<u64> = inputs.iter().chain(outputs).map(|b| b.len as u64).collect();
        // SAFETY: this rank's slot, 16 * world >= 8 * 2 * world bytes long (`fits`:
        // `slot` asserts it) and aligned for u64 (`arena::SLOT_ALIGN`), written by
        // it alone before the stage; `mine` holds 2 * world u64 (asserted above).
        unsafe { std::ptr::copy_nonoverlapping(mine.as_ptr(), sizes(rank), 2 * world) };
        r.stage()?;
        // SAFETY: after the stage slot p is only read; it holds 2 * world aligned
        // u64 (any bytes are a u64: what a peer wrote is only compared and
        // counted, never used as an index).
        let of = |p: usize| unsafe { std::slice::from_raw_parts(sizes(p), 2 * world).to_vec() };
        let all: Vec<Vec<u64>> = (0..world).map(of).collect();
        for (p, q) in (0..world).flat_map(|p| (0..world).map(move |q| (p, q))) {
            // What p sends q, and what q expects from p.
            let (sent, expected) = (all[p][q], all[q][world + p]);
            if sent != expected {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    format!(
                        "rustc10d: {} does not match the calls of its peers: rank {p} sends {sent} bytes to rank {q}, which expects {expected}",
                        ctx.what
                    ),
                ));
            }
            largest = largest.max(sent as usize);
            smallest = smallest.min(sent as usize);
        }
    }
    if ctx.transport.single_copy_bytes().is_some_and(|from| smallest >= from) {
        return pairwise_alltoall(ctx, inputs, outputs);
    }
    let per_block = arena.slot_bytes() / world;
    for k in 0..largest.div_ceil(per_block) {
        let mut r = round(ctx, arena, fp, 1 + k as u64, deadline)?;
        let slots: Vec<RawBuf> = (0..world).map(|p| r.slot(p, arena.slot_bytes())).collect();
        // c < world (asserted above) and len <= per_block (`part`), and
        // world * per_block <= slot bytes: the part lies inside slot p.
        let at = |p: usize, c: usize, len: usize| slots[p].sub(c * per_block, len);
        for (c, block) in inputs.iter().enumerate() {
            let src = part(*block, per_block, k);
            // SAFETY: before the stage this rank writes only its own slot, which no
            // rank reads yet; `src` lies in the op's input block, only read.
            unsafe { ctx.copy(at(rank, c, src.len), src) };
        }
        r.stage()?;
        for (p, out) in outputs.iter().enumerate() {
            let dst = part(*out, per_block, k);
            // SAFETY: after the stage the slots are only read; `dst` lies in the op's
            // output block, touched by nothing else.
            unsafe { ctx.copy(dst, at(p, rank, dst.len)) };
        }
    }
    Ok(())
}
