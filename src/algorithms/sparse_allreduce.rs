//! SUM of sparse COO tensors, as Gloo does it: every rank learns every
//! rank's row count, then gathers every rank's rows (indices, then values);
//! the caller adds up rows with equal indices. The three rounds are pieces
//! of one op, with keys of their own.
//!
//! Row counts and indices come from peers, so neither is trusted: a count
//! must fit a coalesced tensor of the shape every rank agreed on (the call
//! check compares shapes) before it sizes anything, the sizes are summed
//! with checked arithmetic, and every gathered index must lie inside the
//! tensor before the caller builds a tensor from it. A bad one fails the op
//! naming the rank that sent it.

use super::{ring_allgather, OpCtx, RawBuf};
use crate::error::{Error, Result};
use crate::ops::{SparseGathered, SparseShape};

/// Gather every rank's rows of `indices` and `values` (this rank's: `rows`
/// of `shape`) into a `SparseGathered`.
pub fn sparse_allreduce(
    ctx: &OpCtx,
    indices: RawBuf,
    values: RawBuf,
    rows: usize,
    shape: &SparseShape,
) -> Result<SparseGathered> {
    let world = ctx.transport.size();
    let round = |piece: u64| OpCtx { piece, what: format!("{} (sparse round {piece})", ctx.what), ..*ctx };
    let mut counts = vec![0u64; world];
    let mine = [rows as u64];
    let as_buf = |v: &mut [u64]| RawBuf::new(v.as_mut_ptr().cast(), v.len() * 8);
    let blocks: Vec<RawBuf> = counts.chunks_mut(1).map(as_buf).collect();
    ring_allgather(&round(0), RawBuf::new(mine.as_ptr() as *mut u8, 8), &blocks)?;
    let layout = RowLayout::of(&counts, shape).map_err(|e| bad_peer(ctx, e))?;

    let gather = |piece: u64, input: RawBuf, row: usize| -> Result<Vec<u8>> {
        let mut all = vec![0u8; layout.total * row];
        let base = all.as_mut_ptr();
        let blocks: Vec<RawBuf> = layout
            .starts
            .iter()
            .zip(&counts)
            // SAFETY: `RowLayout::of` checked that the blocks (start + count
            // rows of `row` bytes each) lie end to end inside `total` rows.
            .map(|(&start, &n)| RawBuf::new(unsafe { base.add(start * row) }, n as usize * row))
            .collect();
        ring_allgather(&round(piece), input, &blocks)?;
        Ok(all)
    };
    let gathered_indices = gather(1, indices, shape.index_row())?;
    for (peer, (&start, &n)) in layout.starts.iter().zip(&counts).enumerate() {
        let row = shape.index_row();
        let theirs = &gathered_indices[start * row..(start + n as usize) * row];
        if let Some((at, index)) = shape.index_out_of_range(theirs) {
            return Err(bad_peer(
                ctx,
                BadRows { peer, why: format!("row {at} has index {index}, outside sizes {}", shape.describe()) },
            ));
        }
    }
    let gathered_values = gather(2, values, shape.value_row)?;
    Ok(SparseGathered { rows: counts, indices: gathered_indices, values: gathered_values })
}

/// Where each rank's rows go in the gathered buffers.
#[derive(Debug, PartialEq, Eq)]
struct RowLayout {
    /// The first row of each rank's block.
    starts: Vec<usize>,
    /// Rows in all; `total * row` fits in memory for both kinds of row.
    total: usize,
}

/// A rank that sent row counts or rows that cannot be right.
#[derive(Debug, PartialEq, Eq)]
struct BadRows {
    peer: usize,
    why: String,
}

impl RowLayout {
    /// Check every rank's row count against `shape` before it sizes anything.
    fn of(counts: &[u64], shape: &SparseShape) -> std::result::Result<RowLayout, BadRows> {
        let most = shape.max_rows();
        let row = shape.index_row().max(shape.value_row).max(1);
        let (mut starts, mut total) = (Vec::with_capacity(counts.len()), 0usize);
        for (peer, &n) in counts.iter().enumerate() {
            let bad = |why: String| BadRows { peer, why };
            if n > most {
                return Err(bad(format!(
                    "sent a count of {n} rows; a tensor of sizes {} holds at most {most}",
                    shape.describe()
                )));
            }
            starts.push(total);
            total = usize::try_from(n)
                .ok()
                .and_then(|n| total.checked_add(n))
                .filter(|&t| t.checked_mul(row).is_some_and(|b| b <= isize::MAX as usize))
                .ok_or_else(|| {
                    bad(format!("sent a count of {n} rows, more than this rank can hold with the others'"))
                })?;
        }
        Ok(RowLayout { starts, total })
    }
}

fn bad_peer(ctx: &OpCtx, bad: BadRows) -> Error {
    Error::io(format!("rustc10d: {}: rank {} {}", ctx.what, bad.peer, bad.why))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(sparse: &[u64], value_row: usize) -> SparseShape {
        SparseShape { sparse_sizes: sparse.to_vec(), dense_sizes: vec![], value_row }
    }

    #[test]
    fn counts_lay_out_end_to_end() {
        let l = RowLayout::of(&[2, 0, 3], &shape(&[4, 3], 4)).unwrap();
        assert_eq!(l, RowLayout { starts: vec![0, 2, 2], total: 5 });
    }

    #[test]
    fn a_count_larger_than_the_tensor_names_its_rank() {
        let err = RowLayout::of(&[2, 13, 0], &shape(&[4, 3], 4)).unwrap_err();
        assert_eq!(err.peer, 1);
        assert!(err.why.contains("13 rows") && err.why.contains("at most 12"), "{}", err.why);
    }

    #[test]
    fn counts_whose_bytes_overflow_are_refused_not_wrapped() {
        // Every count fits the shape, but their bytes do not fit memory.
        let huge = shape(&[u64::MAX], 8);
        let err = RowLayout::of(&[1, u64::MAX / 4, u64::MAX / 4], &huge).unwrap_err();
        assert_eq!(err.peer, 1);
        let err = RowLayout::of(&[1 << 59, 1 << 60], &huge).unwrap_err();
        assert_eq!(err.peer, 1, "2^59 rows of 8 bytes fit, 2^59 + 2^60 do not");
    }

    #[test]
    fn indices_outside_the_sizes_are_found() {
        let s = shape(&[4, 3], 0);
        let rows = |v: &[i64]| v.iter().flat_map(|i| i.to_ne_bytes()).collect::<Vec<u8>>();
        assert_eq!(s.index_out_of_range(&rows(&[0, 0, 3, 2])), None);
        assert_eq!(s.index_out_of_range(&rows(&[0, 0, 3, 3])), Some((1, 3)));
        assert_eq!(s.index_out_of_range(&rows(&[4, 0])), Some((0, 4)));
        assert_eq!(s.index_out_of_range(&rows(&[1, -1])), Some((0, -1)));
    }
}
