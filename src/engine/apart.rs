//! An op whose buffers share memory, made into one whose buffers do not.
//! torch lets a caller pass views of one tensor as several buffers of an
//! op: `all_to_all_single(t, t)`, an all-gather's input cut from its output
//! at another rank's block, one tensor twice in an output list. The
//! algorithms would then send bytes a receive has already overwritten, or
//! fold into an input they still read, and return wrong numbers without a
//! word (Gloo does, for the first). Here an output that shares memory with
//! another output is received into scratch and copied out once the op has
//! succeeded, in list order (so the last one wins, as in Gloo); an input
//! that shares memory with an output is copied before the op starts. This
//! rank's own block alone may be the very memory of its input (in place:
//! the form every algorithm expects, and the one torch's in-place ops make).
//! The op then computes what it would on separate tensors, and the slices
//! engine lends its algorithm (`lend.rs`) never alias one another. An
//! op that shares nothing, the common case, costs a sort and copies nothing.

use crate::algorithms::{take_front, OpCtx, Scratch};
use crate::ops::{Collective, RawBuf};

/// `part` made apart (see the top of this file): the op to run, and the
/// outputs to copy out once it has succeeded (`copy_out`).
pub struct Apart {
    pub part: Collective,
    /// (scratch the op writes, the caller's output), in list order.
    out: Vec<(RawBuf, RawBuf)>,
}

impl Apart {
    /// `part` with no buffer sharing memory with another (but its own block
    /// in place), its copies in `scratch`; None where it has none to share.
    pub fn of<'a>(scratch: &mut Scratch<'a>, ctx: &OpCtx<'a>, part: &Collective) -> Option<Apart> {
        use Collective::*;
        let rank = ctx.transport.rank();
        // The inputs, the outputs, and which input may be which output in place.
        let (inputs, outputs, own) = match part {
            AllGather { input, outputs, .. } => (std::slice::from_ref(input), &outputs[..], (0, rank)),
            Gather { input, outputs, root, .. } => (std::slice::from_ref(input), &outputs[..], (0, *root)),
            Scatter { inputs, output, root, .. } => (&inputs[..], std::slice::from_ref(output), (*root, 0)),
            ReduceScatter { inputs, output, .. } => (&inputs[..], std::slice::from_ref(output), (rank, 0)),
            AllToAll { inputs, outputs, .. } => (&inputs[..], &outputs[..], (rank, rank)),
            _ => return None,
        };
        let moved_out = overlapping_each_other(outputs);
        // Outputs that stay where they are; the moved ones get scratch of their own.
        let staying: Vec<RawBuf> = outputs
            .iter()
            .enumerate()
            .map(|(j, &o)| if moved_out.contains(&j) { RawBuf::new(o.ptr, 0) } else { o })
            .collect();
        let in_place = |i: usize| i == own.0 && own.1 < outputs.len() && same(inputs[i], outputs[own.1]);
        let copied_in: Vec<usize> = (0..inputs.len())
            .filter(|&i| match in_place(i) && !moved_out.contains(&own.1) {
                true => staying.iter().enumerate().any(|(j, &o)| j != own.1 && overlap(inputs[i], o)),
                false => staying.iter().any(|&o| overlap(inputs[i], o)),
            })
            .collect();
        if moved_out.is_empty() && copied_in.is_empty() {
            return None;
        }
        let bytes = moved_out.iter().map(|&j| outputs[j].len).chain(copied_in.iter().map(|&i| inputs[i].len));
        *scratch = ctx.scratch(bytes.sum());
        let mut rest = scratch.bytes_mut();
        let (mut new_inputs, mut new_outputs, mut out) = (inputs.to_vec(), outputs.to_vec(), Vec::new());
        for &j in &moved_out {
            let piece = take_front(&mut rest, outputs[j].len);
            new_outputs[j] = RawBuf::new(piece.as_mut_ptr(), piece.len());
            out.push((new_outputs[j], outputs[j]));
        }
        for &i in &copied_in {
            let piece = take_front(&mut rest, inputs[i].len);
            // SAFETY: the op's input block, only read, before the op starts.
            ctx.copy_into(piece, unsafe { inputs[i].slice(0, inputs[i].len) });
            new_inputs[i] = RawBuf::new(piece.as_mut_ptr(), piece.len());
        }
        let part = match part {
            AllGather { dtype, .. } => AllGather { input: new_inputs[0], outputs: new_outputs, dtype: *dtype },
            Gather { root, dtype, .. } => {
                Gather { input: new_inputs[0], outputs: new_outputs, root: *root, dtype: *dtype }
            }
            Scatter { root, dtype, .. } => {
                Scatter { inputs: new_inputs, output: new_outputs[0], root: *root, dtype: *dtype }
            }
            ReduceScatter { red, .. } => ReduceScatter { inputs: new_inputs, output: new_outputs[0], red: *red },
            AllToAll { dtype, .. } => AllToAll { inputs: new_inputs, outputs: new_outputs, dtype: *dtype },
            _ => unreachable!("only ops with inputs and outputs get here"),
        };
        Some(Apart { part, out })
    }

    /// Copy the outputs the op wrote into scratch to the caller's, in list order.
    pub fn copy_out(&self, ctx: &OpCtx) {
        for &(written, output) in &self.out {
            // SAFETY: after the op: its scratch and the caller's output are this
            // rank's alone, and other memory (the scratch is new); the same length.
            let (written, output) = unsafe { (written.slice(0, written.len), output.slice_mut(0, output.len)) };
            ctx.copy_into(output, written);
        }
    }
}

/// Whether two buffers share a byte.
fn overlap(a: RawBuf, b: RawBuf) -> bool {
    let (a0, b0) = (a.ptr as usize, b.ptr as usize);
    a.len > 0 && b.len > 0 && a0 < b0 + b.len && b0 < a0 + a.len
}

/// Whether two buffers are the very same bytes.
fn same(a: RawBuf, b: RawBuf) -> bool {
    a.ptr == b.ptr && a.len == b.len
}

/// The buffers that share a byte with another of `bufs`: sorted by start,
/// each overlaps the one before it exactly when it starts before the
/// furthest end so far.
fn overlapping_each_other(bufs: &[RawBuf]) -> Vec<usize> {
    let mut by_start: Vec<usize> = (0..bufs.len()).filter(|&j| bufs[j].len > 0).collect();
    by_start.sort_unstable_by_key(|&j| bufs[j].ptr as usize);
    let mut found = vec![false; bufs.len()];
    let mut reach: Option<(usize, usize)> = None; // (furthest end so far, whose)
    for &j in &by_start {
        let (start, end) = (bufs[j].ptr as usize, bufs[j].ptr as usize + bufs[j].len);
        match reach {
            Some((far, whose)) if start < far => {
                (found[j], found[whose]) = (true, true);
                if end > far {
                    reach = Some((end, j));
                }
            }
            _ => reach = Some((end, j)),
        }
    }
    (0..bufs.len()).filter(|&j| found[j]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: &mut [u8], off: usize, len: usize) -> RawBuf {
        RawBuf::new(base[off..].as_mut_ptr(), len)
    }

    #[test]
    fn buffers_that_share_a_byte_are_found_whatever_their_order() {
        let mut mem = [0u8; 64];
        let bufs =
            [at(&mut mem, 0, 8), at(&mut mem, 8, 8), at(&mut mem, 20, 30), at(&mut mem, 24, 4), at(&mut mem, 60, 4)];
        assert_eq!(overlapping_each_other(&bufs), vec![2, 3]);
        let twice = [at(&mut mem, 16, 8), at(&mut mem, 0, 8), at(&mut mem, 16, 8)];
        assert_eq!(overlapping_each_other(&twice), vec![0, 2]);
        // One long buffer reaches past a short one to a third.
        let long = [at(&mut mem, 0, 40), at(&mut mem, 4, 4), at(&mut mem, 30, 4)];
        assert_eq!(overlapping_each_other(&long), vec![0, 1, 2]);
        let empty = [at(&mut mem, 0, 0), at(&mut mem, 0, 8)];
        assert!(overlapping_each_other(&empty).is_empty());
        assert!(overlap(at(&mut mem, 0, 9), at(&mut mem, 8, 1)) && !overlap(at(&mut mem, 0, 8), at(&mut mem, 8, 1)));
    }
}
