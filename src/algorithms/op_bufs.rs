//! An op's buffers as slices, made once where its algorithm starts: the
//! one place where the caller's memory (`RawBuf`) becomes memory the
//! borrow checker keeps. `Apart` has made the buffers apart first (no two
//! share a byte, but this rank's own block in place), so the outputs can
//! be mutable slices, each its own, beside the inputs.

use super::RawBuf;
use crate::ops::Collective;

/// The buffers of one collective, as its algorithm takes them.
pub struct OpBufs<'a> {
    /// The input blocks, one per rank, where the op has one per rank
    /// (reduce-scatter, all-to-all, scatter at the root), with this rank's
    /// own left empty: it is `own`. The sparse all-reduce's indices and
    /// values. Empty otherwise.
    pub inputs: Vec<&'a [u8]>,
    /// This rank's own input block, or its one input (all-gather, gather);
    /// None where it is in place, the very memory of its output block
    /// (`outputs[rank]`, or the one output), or where it has none.
    pub own: Option<&'a [u8]>,
    /// The output blocks, one per rank (all-gather, all-to-all, gather at
    /// the root), or the one output (reduce-scatter, scatter), or the one
    /// buffer (all-reduce, reduce, broadcast). Empty where it has none.
    pub outputs: Vec<&'a mut [u8]>,
}

impl<'a> OpBufs<'a> {
    /// `part`'s buffers on `rank`.
    ///
    /// # Safety
    /// They are the op's buffers (see `RawBuf`), made apart (`Apart`), and
    /// nothing else touches them while the slices live.
    pub unsafe fn of(part: &Collective, rank: usize) -> OpBufs<'a> {
        use Collective::*;
        let none = || OpBufs { inputs: Vec::new(), own: None, outputs: Vec::new() };
        // The input that is not the output it would be in place (`Apart`:
        // the same bytes, or none of them).
        let own = |input: RawBuf, output: Option<&RawBuf>| match output {
            Some(o) if o.ptr == input.ptr && o.len == input.len => None,
            _ => Some(input),
        };
        let (inputs, own, outputs): (&[RawBuf], Option<RawBuf>, &[RawBuf]) = match part {
            AllReduce { buf, .. } | Reduce { buf, .. } | Broadcast { buf, .. } => {
                (&[], None, std::slice::from_ref(buf))
            }
            AllGather { input, outputs, .. } => (&[], own(*input, outputs.get(rank)), outputs),
            Gather { input, outputs, root, .. } => (&[], own(*input, outputs.get(*root)), outputs),
            Scatter { inputs, output, root, .. } => {
                (inputs, inputs.get(*root).and_then(|i| own(*i, Some(output))), std::slice::from_ref(output))
            }
            ReduceScatter { inputs, output, .. } => {
                (inputs, own(inputs[rank], Some(output)), std::slice::from_ref(output))
            }
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
}
