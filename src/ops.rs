//! What a caller asks of a group: the kinds of op, one collective call with
//! its buffers, and how values combine; and the checks that refuse a bad call
//! before anything is sent. No I/O.

// `RawBuf` is the caller's memory by address: its unsafe code says why.
#![deny(clippy::undocumented_unsafe_blocks)]

use crate::dtype::{DType, ReduceOp, TypeCode};
use crate::error::{Error, Result};
use crate::locks::{level, Mutex};
use std::sync::Arc;
use std::time::Duration;

/// Every kind of op, by the name errors, statistics and RUSTC10D_FAULT use.
/// The discriminant is the op's code (in call fingerprints and at the FFI).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum OpKind {
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    Gather,
    Scatter,
    ReduceScatter,
    AllToAll,
    Barrier,
    MonitoredBarrier,
    AllReduceSparse,
    Send,
    Recv,
}

impl OpKind {
    /// In code order.
    pub const ALL: [OpKind; 13] = [
        OpKind::AllReduce,
        OpKind::Reduce,
        OpKind::Broadcast,
        OpKind::AllGather,
        OpKind::Gather,
        OpKind::Scatter,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
        OpKind::Barrier,
        OpKind::MonitoredBarrier,
        OpKind::AllReduceSparse,
        OpKind::Send,
        OpKind::Recv,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "allreduce",
            OpKind::Reduce => "reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllGather => "allgather",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllToAll => "alltoall",
            OpKind::Barrier => "barrier",
            OpKind::MonitoredBarrier => "monitored_barrier",
            OpKind::AllReduceSparse => "allreduce_sparse",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
        }
    }

    /// The kind of that name; an unknown name is an error listing the known ones.
    pub fn parse(name: &str) -> std::result::Result<OpKind, String> {
        OpKind::ALL.into_iter().find(|k| k.name() == name).ok_or_else(|| {
            let known: Vec<_> = OpKind::ALL.iter().map(|k| k.name()).collect();
            format!("unknown op {name:?} (known: {}, or any)", known.join(", "))
        })
    }

    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<OpKind> {
        OpKind::ALL.get(code as usize).copied()
    }
}

/// How values combine: a reduce op on a dtype, with PREMUL_SUM's factor if any.
#[derive(Clone, Copy, Debug)]
pub struct Reduction {
    pub dtype: DType,
    pub op: ReduceOp,
    /// PREMUL_SUM: every contribution is multiplied by this before summing.
    pub premul: Option<f64>,
}

impl Reduction {
    pub fn new(dtype: DType, op: ReduceOp) -> Reduction {
        Reduction { dtype, op, premul: None }
    }

    fn check(&self) -> Result<()> {
        self.op.check(self.dtype)?;
        if self.premul.is_some() && !self.dtype.is_float() {
            return Err(Error::unsupported(format!(
                "rustc10d does not support ReduceOp.PREMUL_SUM on {} tensors",
                self.dtype.torch_name()
            )));
        }
        Ok(())
    }
}

/// The result of a sparse all-reduce, filled by the op: every rank's rows,
/// checked against the tensor's shape (`SparseShape::check_indices`).
#[derive(Debug, Default)]
pub struct SparseGathered {
    /// Rows each rank contributed, by rank.
    pub rows: Vec<u64>,
    pub indices: Vec<u8>,
    pub values: Vec<u8>,
}

/// The shape of a sparse COO tensor, which every rank's must share: the
/// sizes of its sparse dimensions (a row of indices is one int64 for each)
/// and of its dense ones, whose elements make a row of values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SparseShape {
    pub sparse_sizes: Vec<u64>,
    pub dense_sizes: Vec<u64>,
    /// Bytes of one row of values.
    pub value_row: usize,
}

impl SparseShape {
    /// Bytes of one row of indices.
    pub fn index_row(&self) -> usize {
        self.sparse_sizes.len() * 8
    }

    /// The most rows a coalesced tensor of this shape holds: one per distinct
    /// index (a rank's input is coalesced before it is sent).
    pub fn max_rows(&self) -> u64 {
        self.sparse_sizes.iter().fold(1u64, |n, &s| n.saturating_mul(s))
    }

    /// How many rows `indices` and `values` hold, if they agree.
    pub fn rows(&self, indices: &RawBuf, values: &RawBuf) -> Option<usize> {
        let of = |b: &RawBuf, row: usize| b.len.checked_div(row).filter(|_| b.len.is_multiple_of(row));
        match (of(indices, self.index_row()), of(values, self.value_row)) {
            (Some(i), Some(v)) => (i == v).then_some(i),
            (Some(i), None) => (values.len == 0).then_some(i),
            (None, Some(v)) => (indices.len == 0).then_some(v),
            // Neither has bytes in a row: nothing to add up.
            (None, None) => (indices.len == 0 && values.len == 0).then_some(0),
        }
    }

    /// The first row of `indices` (native-endian int64s, `index_row()` bytes
    /// a row) with an index outside the sizes, as (row, index).
    pub fn index_out_of_range(&self, indices: &[u8]) -> Option<(usize, i64)> {
        let dims = self.sparse_sizes.len();
        if dims == 0 {
            return None;
        }
        indices.chunks_exact(8).enumerate().find_map(|(i, b)| {
            let index = i64::from_ne_bytes(b.try_into().expect("chunks of 8"));
            let size = self.sparse_sizes[i % dims];
            (index < 0 || index as u64 >= size).then_some((i / dims, index))
        })
    }

    /// 64 bits that differ between shapes (FNV-1a), for the call check.
    pub fn digest(&self) -> u64 {
        let words = [self.sparse_sizes.len() as u64].into_iter().chain(self.sparse_sizes.iter().copied());
        let words = words.chain([self.dense_sizes.len() as u64]).chain(self.dense_sizes.iter().copied());
        words
            .flat_map(u64::to_le_bytes)
            .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    }

    /// "[4, 3] (sparse) x [2] (dense)".
    pub fn describe(&self) -> String {
        format!("{:?} (sparse) x {:?} (dense)", self.sparse_sizes, self.dense_sizes)
    }
}

/// A caller-owned byte range (a tensor's storage) that outlives the op.
///
/// The engine lends an op's buffers to its algorithm as slices, once
/// (`engine::lend`), after making them apart (`engine::apart`); that unsafe
/// code rests on what follows:
/// - The op's buffers (the `Collective`'s) are valid for reads and writes of
///   `len` bytes until the op is done, and the caller does not touch them
///   meanwhile (`Engine::submit`'s contract).
/// - Two buffers of one op do not overlap (`engine::apart` makes sure of
///   it), but where an input is exactly the block this rank keeps of its own
///   (all-gather's `outputs[rank]`, all-to-all's, reduce-scatter's output as
///   `inputs[rank]`: in place), the form torch's in-place ops give.
/// - Ranges are computed inside the buffer (`slice` and `slice_mut` assert it).
#[derive(Clone, Copy, Debug)]
pub struct RawBuf {
    pub ptr: *mut u8,
    pub len: usize,
}
// SAFETY: a RawBuf is a pointer and a length; touching the memory is unsafe
// (`slice`, `slice_mut`, the transfers), and the op's owner keeps it alive
// until the op finishes, whichever thread runs it (the engine's worker, a
// pipelined phase's thread, the reactor for transfers).
unsafe impl Send for RawBuf {}
// SAFETY: sharing the descriptor between an op's threads only copies the
// pointer; each phase of an op touches ranges of its own (see above).
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// Empty tensors may have no storage (a null pointer); slices still need
    /// an aligned non-null one.
    pub fn new(ptr: *mut u8, len: usize) -> RawBuf {
        let ptr = if len == 0 { std::ptr::NonNull::<u64>::dangling().as_ptr().cast() } else { ptr };
        RawBuf { ptr, len }
    }

    /// The bytes [off, off + len) (inside the buffer: asserted).
    ///
    /// # Safety
    /// The range must be valid and not written by anyone else while the slice lives.
    pub unsafe fn slice<'a>(&self, off: usize, len: usize) -> &'a [u8] {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len));
        // SAFETY: [off, off + len) lies inside the buffer (asserted), whose
        // pointer is non-null and, being bytes, aligned (`RawBuf::new`); the
        // caller promises the range is valid and unwritten while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }

    /// The bytes [off, off + len) (inside the buffer: asserted), to write.
    ///
    /// # Safety
    /// The range must be valid and not accessed by anyone else while the slice lives.
    pub unsafe fn slice_mut<'a>(&self, off: usize, len: usize) -> &'a mut [u8] {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len));
        // SAFETY: as in `slice`; the caller promises nobody else touches the
        // range while this mutable slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

/// One collective call. Buffers are the caller's (see `Engine::submit`).
pub enum Collective {
    AllReduce {
        buf: RawBuf,
        red: Reduction,
    },
    /// In place at the root; other ranks' buffers are left as they were.
    Reduce {
        buf: RawBuf,
        root: usize,
        red: Reduction,
    },
    /// `dtype` (like every data-moving op's) is the tensors' element type
    /// (`dtype::TypeCode`): bytes move as they are, but ranks must agree on
    /// what they mean.
    Broadcast {
        buf: RawBuf,
        root: usize,
        dtype: TypeCode,
    },
    /// `outputs[i]` receives rank i's input; sizes may differ per rank.
    AllGather {
        input: RawBuf,
        outputs: Vec<RawBuf>,
        dtype: TypeCode,
    },
    /// `outputs` only at the root.
    Gather {
        input: RawBuf,
        outputs: Vec<RawBuf>,
        root: usize,
        dtype: TypeCode,
    },
    /// `inputs` only at the root.
    Scatter {
        inputs: Vec<RawBuf>,
        output: RawBuf,
        root: usize,
        dtype: TypeCode,
    },
    /// `inputs[i]` is this rank's contribution to rank i's `output`.
    ReduceScatter {
        inputs: Vec<RawBuf>,
        output: RawBuf,
        red: Reduction,
    },
    /// `inputs[i]` goes to rank i, `outputs[i]` comes from rank i.
    AllToAll {
        inputs: Vec<RawBuf>,
        outputs: Vec<RawBuf>,
        dtype: TypeCode,
    },
    Barrier,
    /// `timeout`: how long rank 0 waits for the others (None: the op's).
    MonitoredBarrier {
        wait_all: bool,
        timeout: Option<Duration>,
    },
    /// SUM of sparse COO tensors, as Gloo does it: every rank's rows (indices
    /// and values, rows of `shape`) gathered into `out`; the caller adds up
    /// rows with equal indices.
    AllReduceSparse {
        indices: RawBuf,
        values: RawBuf,
        shape: SparseShape,
        dtype: DType,
        out: Arc<Mutex<level::SparseGathered, SparseGathered>>,
    },
}

impl Collective {
    pub fn kind(&self) -> OpKind {
        match self {
            Collective::AllReduce { .. } => OpKind::AllReduce,
            Collective::Reduce { .. } => OpKind::Reduce,
            Collective::Broadcast { .. } => OpKind::Broadcast,
            Collective::AllGather { .. } => OpKind::AllGather,
            Collective::Gather { .. } => OpKind::Gather,
            Collective::Scatter { .. } => OpKind::Scatter,
            Collective::ReduceScatter { .. } => OpKind::ReduceScatter,
            Collective::AllToAll { .. } => OpKind::AllToAll,
            Collective::Barrier => OpKind::Barrier,
            Collective::MonitoredBarrier { .. } => OpKind::MonitoredBarrier,
            Collective::AllReduceSparse { .. } => OpKind::AllReduceSparse,
        }
    }

    /// The bytes the call passed (statistics).
    pub fn bytes(&self) -> u64 {
        let total = |bufs: &[RawBuf]| bufs.iter().map(|b| b.len as u64).sum::<u64>();
        match self {
            Collective::AllReduce { buf, .. } | Collective::Reduce { buf, .. } | Collective::Broadcast { buf, .. } => {
                buf.len as u64
            }
            Collective::AllGather { outputs, .. } => total(outputs),
            Collective::Gather { input, .. } => input.len as u64,
            Collective::Scatter { output, .. } | Collective::ReduceScatter { output, .. } => output.len as u64,
            Collective::AllToAll { inputs, .. } => total(inputs),
            Collective::Barrier | Collective::MonitoredBarrier { .. } => 0,
            Collective::AllReduceSparse { indices, values, .. } => (indices.len + values.len) as u64,
        }
    }

    /// A failed monitored barrier only reports who is missing; anything else
    /// leaves the ranks out of step.
    pub fn failure_breaks_group(&self) -> bool {
        !matches!(self, Collective::MonitoredBarrier { .. })
    }

    /// Refuse what cannot work before anything goes on the wire.
    pub fn check(&self, rank: usize, world: usize) -> Result<()> {
        let name = self.kind().name();
        let bad = |msg: String| Err(Error::invalid(format!("rustc10d: {name}: {msg}")));
        let root_ok = |root: usize| {
            if root < world {
                Ok(())
            } else {
                bad(format!("root rank {root} is out of range for a group of size {world}"))
            }
        };
        let whole = |b: &RawBuf, red: &Reduction| {
            if b.len.is_multiple_of(red.dtype.size()) {
                Ok(())
            } else {
                bad(format!("{} bytes is not a whole number of {} elements", b.len, red.dtype.torch_name()))
            }
        };
        let blocks = |what: &str, bufs: &[RawBuf], want: usize| {
            if bufs.len() != world {
                return bad(format!("expected {world} {what} (one per rank), got {}", bufs.len()));
            }
            match bufs.iter().position(|b| b.len != want) {
                Some(i) => bad(format!("{what} {i} has {} bytes, expected {want} like the others", bufs[i].len)),
                None => Ok(()),
            }
        };
        match self {
            Collective::AllReduce { buf, red } => {
                red.check()?;
                whole(buf, red)
            }
            Collective::Reduce { buf, root, red } => {
                red.check()?;
                root_ok(*root)?;
                whole(buf, red)
            }
            Collective::Broadcast { root, .. } => root_ok(*root),
            Collective::AllGather { input, outputs, .. } => {
                // Blocks may differ per rank (all-gather-v); ours must fit our input.
                if outputs.len() != world {
                    return bad(format!("expected {world} outputs (one per rank), got {}", outputs.len()));
                }
                if outputs[rank].len != input.len {
                    return bad(format!(
                        "output {rank} has {} bytes but the input has {}",
                        outputs[rank].len, input.len
                    ));
                }
                Ok(())
            }
            Collective::Gather { input, outputs, root, .. } => {
                root_ok(*root)?;
                if rank == *root {
                    blocks("outputs", outputs, input.len)
                } else {
                    Ok(())
                }
            }
            Collective::Scatter { inputs, output, root, .. } => {
                root_ok(*root)?;
                if rank == *root {
                    blocks("inputs", inputs, output.len)
                } else {
                    Ok(())
                }
            }
            Collective::ReduceScatter { inputs, output, red } => {
                red.check()?;
                whole(output, red)?;
                blocks("inputs", inputs, output.len)
            }
            Collective::AllToAll { inputs, outputs, .. } => {
                if inputs.len() != world || outputs.len() != world {
                    return bad(format!(
                        "expected {world} input and output blocks, got {} and {}",
                        inputs.len(),
                        outputs.len()
                    ));
                }
                // The block a rank sends itself: both ends are here.
                if inputs[rank].len != outputs[rank].len {
                    return bad(format!(
                        "this rank sends itself {} bytes (input block {rank}) into an output block of {}",
                        inputs[rank].len, outputs[rank].len
                    ));
                }
                Ok(())
            }
            Collective::Barrier | Collective::MonitoredBarrier { .. } => Ok(()),
            Collective::AllReduceSparse { indices, values, shape, .. } => match shape.rows(indices, values) {
                Some(rows) if rows as u64 <= shape.max_rows() => Ok(()),
                Some(rows) => bad(format!("{rows} rows do not fit a coalesced tensor of sizes {}", shape.describe())),
                None => bad(format!(
                    "{} index bytes in rows of {} and {} value bytes in rows of {} do not agree",
                    indices.len,
                    shape.index_row(),
                    values.len,
                    shape.value_row
                )),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_names_round_trip_and_unknown_ones_are_listed() {
        for (i, k) in OpKind::ALL.into_iter().enumerate() {
            assert_eq!(k.code() as usize, i);
            assert_eq!(OpKind::parse(k.name()), Ok(k));
            assert_eq!(OpKind::from_code(k.code()), Some(k));
        }
        let err = OpKind::parse("allreduse").unwrap_err();
        assert!(err.contains("unknown op \"allreduse\"") && err.contains("reduce_scatter"), "{err}");
    }
}
