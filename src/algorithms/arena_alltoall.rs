//! All-to-all in the shared arena. A first round checks the call and
//! shows every rank every pair's sizes (each rank writes how much it sends
//! to and expects from each rank into its slot), so that a pair that
//! disagrees fails on every rank, and every rank knows the largest block.
//! Where every block is large enough to go as its address (single copy), the
//! pairs then exchange directly, one copy per byte; otherwise each further
//! round takes up to 1/W of a slot from each block, at the same offset in
//! each: every rank copies its parts for the others into its slot, part p
//! at p/W of it, and after one stage copies part `rank` of every other
//! rank's slot into place, and its own block's part straight across.
//! Nothing of the caller's is written before a round's stage.
//!
//! Bytes copied (`Cost`), per rank, through the arena: 2 per byte sent to
//! another rank, 1 per byte of its own block (0 in place).
//! Stages: 1, and 1 per slot / W of the largest block.

use super::call_check::Fingerprint;
use super::in_arena::{part, part_mut, round};
use super::{pairwise_alltoall, OpCtx};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::group::arena::{Arena, Shape};

/// Whether a slot holds a rank's sizes (16 bytes per peer), and 16 bytes
/// of a block for each rank per round.
pub fn fits(arena: &Arena, world: usize) -> bool {
    arena.slot_bytes() >= 16 * world
}

/// `inputs[p]` goes to rank p (this rank's own is `own`, or in place (None)
/// what `outputs[rank]` holds), `outputs[p]` comes from rank p (sizes may
/// differ per pair).
pub fn arena_alltoall(
    ctx: &OpCtx,
    arena: &Arena,
    inputs: &[&[u8]],
    own: Option<&[u8]>,
    outputs: &mut [&mut [u8]],
    fp: &Fingerprint,
) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    // The sizes and each round's parts are laid out for exactly world blocks each way.
    assert!(inputs.len() == world && outputs.len() == world, "arena_alltoall: one block per rank each way");
    let deadline = ctx.deadline;
    let input_len = |p: usize, outputs: &[&mut [u8]]| match p == rank {
        true => own.map_or(outputs[rank].len(), <[u8]>::len),
        false => inputs[p].len(),
    };
    let (mut largest, mut smallest) = (0, usize::MAX);
    {
        let mut r = round(ctx, arena, fp, 0, Shape::Gather, deadline)?;
        // This rank's sizes: what it sends each rank, then what it expects from each.
        let mine = (0..world).map(|p| input_len(p, outputs)).chain(outputs.iter().map(|o| o.len()));
        for (word, n) in r.own()[..16 * world].chunks_exact_mut(8).zip(mine) {
            word.copy_from_slice(&(n as u64).to_le_bytes());
        }
        r.stage()?;
        // Any bytes are a size: what a peer wrote is only compared and counted,
        // never used as an index.
        let size = |p: usize, i: usize| u64::from_le_bytes(r.slot(p)[8 * i..][..8].try_into().expect("8 bytes"));
        for (p, q) in (0..world).flat_map(|p| (0..world).map(move |q| (p, q))) {
            // What p sends q, and what q expects from p.
            let (sent, expected) = (size(p, q), size(q, world + p));
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
        return pairwise_alltoall(ctx, inputs, own, outputs);
    }
    let per_block = arena.slot_bytes() / world;
    // Block c's part in a slot: world * per_block <= slot bytes.
    let at = |c: usize, len: usize| c * per_block..c * per_block + len;
    for k in 0..largest.div_ceil(per_block) {
        let mut r = round(ctx, arena, fp, 1 + k as u64, Shape::Gather, deadline)?;
        let slot = r.own();
        for c in (0..world).filter(|&c| c != rank) {
            let src = &inputs[c][part(inputs[c].len(), per_block, k)];
            ctx.copy_into(&mut slot[at(c, src.len())], src);
        }
        r.stage()?;
        for (p, out) in outputs.iter_mut().enumerate() {
            let dst = part_mut(out, per_block, k);
            if p != rank {
                ctx.copy_into(dst, &r.slot(p)[at(rank, dst.len())]);
            } else if let Some(own) = own {
                // Its own block, as long as its output (the sizes agreed above).
                ctx.copy_into(dst, &own[part(own.len(), per_block, k)]);
            }
        }
    }
    Ok(())
}
