//! Where an op's memory becomes slices: the caller's buffers (`RawBuf`,
//! by address) made apart (`apart.rs`), then lent to the op's algorithm as
//! slices the borrow checker keeps (`OpBufs`), once; outputs that shared
//! memory are copied out after the op. The algorithms hold no unsafe code.

// The conversion is the unsafe code of the op's entry: each block says why.
#![deny(clippy::undocumented_unsafe_blocks)]

use super::apart::Apart;
use crate::algorithms::{self, call_check::Fingerprint, OpBufs, OpCtx, Plan, Scratch};
use crate::error::Result;
use crate::ops::{Collective, RawBuf};

/// Run `part` as `plan` says, on its buffers lent as slices.
pub fn run(ctx: &OpCtx, part: &Collective, plan: &Plan, fp: &Fingerprint) -> Result<()> {
    // Buffers that share memory (views of one tensor) run apart.
    let mut copies = Scratch::new(0);
    let apart = Apart::of(&mut copies, ctx, part);
    let part = apart.as_ref().map_or(part, |a| &a.part);
    // SAFETY: the op's buffers, valid and the op's alone until it ends
    // (`Engine::submit`'s contract), now apart (or copies of their own); the
    // algorithm is all that touches them until `run` returns.
    let bufs = unsafe { lent(part, ctx.transport.rank()) };
    algorithms::run(ctx, part, bufs, plan, fp)?;
    if let Some(apart) = &apart {
        apart.copy_out(ctx);
    }
    Ok(())
}

/// `part`'s buffers on `rank`, as slices.
///
/// # Safety
/// They are the op's buffers (see `RawBuf`), made apart (`Apart`), and
/// nothing else touches them while the slices live.
unsafe fn lent<'a>(part: &Collective, rank: usize) -> OpBufs<'a> {
    use Collective::*;
    let none = || OpBufs { inputs: Vec::new(), own: None, outputs: Vec::new() };
    // The input that is not the output it would be in place (`Apart`:
    // the same bytes, or none of them).
    let own = |input: RawBuf, output: Option<&RawBuf>| match output {
        Some(o) if o.ptr == input.ptr && o.len == input.len => None,
        _ => Some(input),
    };
    let (inputs, own, outputs): (&[RawBuf], Option<RawBuf>, &[RawBuf]) = match part {
        AllReduce { buf, .. } | Reduce { buf, .. } | Broadcast { buf, .. } => (&[], None, std::slice::from_ref(buf)),
        AllGather { input, outputs, .. } => (&[], own(*input, outputs.get(rank)), outputs),
        Gather { input, outputs, root, .. } => (&[], own(*input, outputs.get(*root)), outputs),
        Scatter { inputs, output, root, .. } => {
            (inputs, inputs.get(*root).and_then(|i| own(*i, Some(output))), std::slice::from_ref(output))
        }
        ReduceScatter { inputs, output, .. } => (inputs, own(inputs[rank], Some(output)), std::slice::from_ref(output)),
        AllToAll { inputs, outputs, .. } => (inputs, own(inputs[rank], outputs.get(rank)), outputs),
        AllReduceSparse { indices, values, .. } => {
            // SAFETY: the caller's promise; they are only read.
            return unsafe {
                OpBufs { inputs: vec![indices.slice(0, indices.len), values.slice(0, values.len)], ..none() }
            };
        }
        _ => return none(),
    };
    // The own block of a list of inputs is `own`, whichever rank's it is.
    let own_at = match part {
        Scatter { root, .. } => *root,
        _ => rank,
    };
    // SAFETY: the caller's promise. The outputs share no byte with one
    // another, nor with an input but the in-place one, which is in no
    // slice here (left empty, and `own` None); inputs may share bytes
    // with inputs, being only read.
    unsafe {
        OpBufs {
            inputs: inputs
                .iter()
                .enumerate()
                .map(|(p, b)| if p == own_at { &[][..] } else { b.slice(0, b.len) })
                .collect(),
            own: own.map(|b| b.slice(0, b.len)),
            outputs: outputs.iter().map(|b| b.slice_mut(0, b.len)).collect(),
        }
    }
}
