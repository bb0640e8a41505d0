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

use super::{ring_allgather, take_front, OpCtx};
use crate::alloc::zeroed;
use crate::error::{Error, Result};
use crate::ops::{SparseGathered, SparseShape};
use crate::reduce::bytes_of_words;

/// Gather every rank's rows of `indices` and `values` (this rank's: `rows`
/// of `shape`) into a `SparseGathered`.
pub fn sparse_allreduce(
    ctx: &OpCtx,
    indices: &[u8],
    values: &[u8],
    rows: usize,
    shape: &SparseShape,
) -> Result<SparseGathered> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let round = |piece: u64| OpCtx { piece, what: ctx.what.within("sparse round", piece), ..*ctx };
    let mut counts = vec![0u64; world];
    let mut blocks: Vec<&mut [u8]> = bytes_of_words(&mut counts).chunks_mut(8).collect();
    ring_allgather(&round(0), Some(&(rows as u64).to_ne_bytes()), &mut blocks)?;
    let layout = RowLayout::of(&counts, shape).map_err(|e| bad_peer(ctx, e))?;

    let gather = |piece: u64, input: &[u8], row: usize| -> Result<Vec<u8>> {
        // The counts fit the shape, which may still be far more than memory
        // holds: an allocation that fails fails the op (`vec!` would abort
        // the process), blaming the rank that sent the most rows.
        let mut all = zeroed(layout.total * row).ok_or_else(|| bad_peer(ctx, layout.too_many(&counts, rank, row)))?;
        // `RowLayout::of` checked that the blocks (count rows of `row` bytes
        // each) lie end to end inside `total` rows.
        let mut rest = &mut all[..];
        let mut blocks: Vec<&mut [u8]> = counts.iter().map(|&n| take_front(&mut rest, n as usize * row)).collect();
        ring_allgather(&round(piece), Some(input), &mut blocks)?;
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

impl RowLayout {
    /// The rank (other than `me`) that sent the most rows, when all ranks'
    /// rows of `row` bytes cannot be allocated.
    fn too_many(&self, counts: &[u64], me: usize, row: usize) -> BadRows {
        // Another rank first (this rank's own rows are in memory already).
        let (peer, &n) = counts.iter().enumerate().max_by_key(|&(p, &n)| (p != me, n)).unwrap_or((me, &0));
        let bytes = self.total as u128 * row as u128;
        BadRows {
            peer,
            why: format!("sent a count of {n} rows: this rank cannot allocate the {bytes} bytes of all ranks' rows"),
        }
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

    #[test]
    fn zeroed_memory_or_none_never_an_abort() {
        assert_eq!(zeroed(0), Some(vec![]));
        assert_eq!(zeroed(4096), Some(vec![0u8; 4096]));
        // More than any machine has: refused, not aborted.
        assert_eq!(zeroed(1 << 62), None);
        assert_eq!(zeroed(usize::MAX), None);
    }

    /// A count: small ones, those near the limits a shape sets, any.
    fn count() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        prop_oneof![0u64..8, (0u32..64).prop_map(|k| 1u64 << k), (0u32..64).prop_map(|k| (1u64 << k) - 1), any::<u64>()]
    }

    // Row counts and indices are peers' words. Whatever they are, laying
    // the rows out never panics: either every count fits the shape and all
    // of them lie end to end within `total` rows whose bytes fit memory's
    // address space, or the first count that does not is named, with its
    // rank. Finding an index outside the sizes never panics either, and
    // finds the first one.
    proptest::proptest! {
        #[test]
        fn row_layouts_take_any_counts(counts in proptest::collection::vec(count(), 0..6),
                                       sizes in proptest::collection::vec(count(), 0..4),
                                       value_row in proptest::prop_oneof![0usize..64, proptest::prelude::any::<usize>()]) {
            let s = shape(&sizes, value_row);
            let row = s.index_row().max(s.value_row).max(1);
            match RowLayout::of(&counts, &s) {
                Ok(l) => {
                    let mut at = 0usize;
                    for (&start, &n) in l.starts.iter().zip(&counts) {
                        proptest::prop_assert!(n <= s.max_rows());
                        proptest::prop_assert_eq!(start, at);
                        at += n as usize;
                    }
                    proptest::prop_assert_eq!(l.starts.len(), counts.len());
                    proptest::prop_assert_eq!(l.total, at);
                    proptest::prop_assert!(l.total.checked_mul(row).is_some_and(|b| b <= isize::MAX as usize));
                }
                Err(bad) => {
                    proptest::prop_assert!(bad.peer < counts.len());
                    proptest::prop_assert!(RowLayout::of(&counts[..bad.peer], &s).is_ok(), "the first bad count is named");
                    proptest::prop_assert!(bad.why.contains(&format!("a count of {} rows", counts[bad.peer])), "{}", bad.why);
                }
            }
        }

        #[test]
        fn indices_out_of_range_are_found_in_any_bytes(sizes in proptest::collection::vec(count(), 0..4),
                                                       indices in proptest::collection::vec(proptest::prelude::any::<i64>(), 0..12),
                                                       small in proptest::prelude::any::<bool>()) {
            // Small indices too, that fall inside small sizes.
            let indices: Vec<i64> = if small { indices.iter().map(|i| i % 5).collect() } else { indices };
            let s = shape(&sizes, 8);
            let bytes: Vec<u8> = indices.iter().flat_map(|i| i.to_ne_bytes()).collect();
            let outside = |i: usize| indices[i] < 0 || indices[i] as u64 >= sizes[i % sizes.len()];
            let first = if sizes.is_empty() { None } else { (0..indices.len()).find(|&i| outside(i)) };
            proptest::prop_assert_eq!(s.index_out_of_range(&bytes), first.map(|i| (i / sizes.len(), indices[i])));
            // A ragged end (a peer's short message) is no panic either.
            let _ = s.index_out_of_range(&bytes[..bytes.len().saturating_sub(3)]);
        }
    }
}
