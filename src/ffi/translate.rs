//! From a `Call` to the engine's terms: descriptors into buffers and
//! collectives, results back into the shim's completion, and the shim's
//! device primitives as the engine's `Device`.

use super::bridge::{self, Call, OpKind, ReduceOpCode};
use crate::algorithms::call_check::Fingerprint;
use crate::dtype;
use crate::engine::{AfterCopies, Device, Event, HeldCopies, Staging};
use crate::error::{Error, Result};
use crate::locks::{level, Condvar, Mutex};
use crate::ops::RawBuf;
use crate::ops::{self, Collective, Reduction, SparseGathered};
use crate::status::Finisher;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) fn dtype_of(d: bridge::DType) -> Result<dtype::DType> {
    dtype::DType::ALL
        .get(d.repr as usize)
        .copied()
        .ok_or_else(|| Error::unsupported("rustc10d does not support reductions on this dtype yet"))
}

pub(super) fn op_kind(k: OpKind) -> Result<ops::OpKind> {
    ops::OpKind::from_code(k.repr).ok_or_else(|| Error::invalid(format!("rustc10d: unknown op kind {}", k.repr)))
}

/// A timeout from torch's options: negative is unset (torch's kUnsetTimeout,
/// the group's timeout applies); zero is a real, zero timeout.
pub(super) fn timeout(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

pub(super) fn buf(t: &bridge::TensorDesc) -> RawBuf {
    RawBuf::new(t.ptr as *mut u8, t.nbytes)
}

pub(super) fn bufs(ts: &[bridge::TensorDesc]) -> Vec<RawBuf> {
    ts.iter().map(buf).collect()
}

pub(super) fn rank(r: i64, what: &str) -> Result<usize> {
    usize::try_from(r).map_err(|_| Error::invalid(format!("rustc10d: {what} rank {r} is negative")))
}

/// How `t` is reduced by `reduce` (PREMUL_SUM's factor: `premul`). A
/// complex tensor by SUM, AVG or PREMUL_SUM, as the pairs of reals it holds
/// (`dtype::complex_parts`).
pub(super) fn reduction(t: &bridge::TensorDesc, reduce: ReduceOpCode, premul: f64) -> Result<Reduction> {
    let dtype = match dtype::complex_parts(t.dtype.repr) {
        Some(parts) if matches!(reduce, ReduceOpCode::Sum | ReduceOpCode::Avg | ReduceOpCode::PremulSum) => parts,
        Some(_) => {
            let op = dtype::ReduceOp::from_code(reduce.repr)
                .map_or_else(|_| format!("reduce op code {}", reduce.repr), |op| format!("ReduceOp.{}", op.name()));
            return Err(Error::unsupported(format!(
                "rustc10d does not support {op} on complex tensors (SUM, AVG and PREMUL_SUM reduce them)"
            )));
        }
        None => dtype_of(t.dtype)?,
    };
    if reduce == ReduceOpCode::PremulSum {
        return Ok(Reduction { dtype, op: dtype::ReduceOp::Sum, premul: Some(premul) });
    }
    Ok(Reduction::new(dtype, dtype::ReduceOp::from_code(reduce.repr)?))
}

/// The all-reduce of `t` in place by `reduce` (PREMUL_SUM's factor: `premul`).
pub(super) fn all_reduce_of(t: &bridge::TensorDesc, reduce: ReduceOpCode, premul: f64) -> Result<Collective> {
    Ok(Collective::AllReduce { buf: buf(t), red: reduction(t, reduce, premul)? })
}

/// Cut a flat list of `what` into `parts` equal groups (one per coalesced
/// tensor), none empty.
pub(super) fn per_part(
    kind: ops::OpKind,
    what: &str,
    ts: &[bridge::TensorDesc],
    parts: usize,
) -> Result<Vec<Vec<RawBuf>>> {
    if parts == 0 || ts.len() < parts || !ts.len().is_multiple_of(parts) {
        let calls = if parts == 1 { String::new() } else { format!(" for {parts} tensors") };
        return Err(Error::invalid(format!(
            "rustc10d: {}: a list of {} {what}{calls} does not give each tensor one per rank",
            kind.name(),
            ts.len()
        )));
    }
    Ok(ts.chunks(ts.len() / parts).map(bufs).collect())
}

// The shim's dtype codes are `dtype::TypeCode`s: those of types the engine
// only moves start where ours say.
const _: () = assert!(bridge::DType::Opaque.repr == dtype::OPAQUE_BASE);

pub(super) fn first(ts: &[bridge::TensorDesc], what: &str) -> Result<RawBuf> {
    ts.first().map(buf).ok_or_else(|| Error::invalid(format!("rustc10d: the call has no {what} tensor")))
}

/// An op's tensors have one dtype: a reduction reduces them together, and
/// the bytes an op moves from one into another must mean the same there.
pub(super) fn same_dtype(kind: ops::OpKind, ts: impl IntoIterator<Item = bridge::DType>) -> Result<()> {
    let mut ts = ts.into_iter();
    let first = ts.next();
    if ts.any(|d| Some(d) != first) {
        return Err(Error::invalid(format!("rustc10d: {}: all tensors must have the same dtype", kind.name())));
    }
    Ok(())
}

/// The collectives of `call` (see `Call`'s layouts); a sparse all-reduce
/// hands what it gathered to `sparse` (none: the call may not be one).
pub(super) fn collectives(
    call: &Call,
    sparse: Option<&Arc<Mutex<level::SparseGathered, SparseGathered>>>,
) -> Result<Vec<Collective>> {
    let (ins, outs) = (&call.inputs[..], &call.outputs[..]);
    let root = || rank(call.root, "root");
    let kind = op_kind(call.kind)?;
    if kind != ops::OpKind::AllReduceSparse {
        same_dtype(kind, ins.iter().chain(outs).map(|t| t.dtype))?;
    }
    // The dtype of every tensor of the call (none for barriers).
    let dtype = ins.iter().chain(outs).next().map_or(Fingerprint::NONE, |t| t.dtype.repr);
    Ok(match kind {
        ops::OpKind::AllReduce => {
            outs.iter().map(|t| all_reduce_of(t, call.reduce, call.premul)).collect::<Result<_>>()?
        }
        ops::OpKind::Reduce => {
            let t = outs.first().ok_or_else(|| Error::invalid("rustc10d: reduce takes one tensor"))?;
            vec![Collective::Reduce { buf: buf(t), root: root()?, red: reduction(t, call.reduce, call.premul)? }]
        }
        ops::OpKind::Broadcast => vec![Collective::Broadcast { buf: first(outs, "output")?, root: root()?, dtype }],
        ops::OpKind::AllGather => ins
            .iter()
            .zip(per_part(kind, "outputs", outs, ins.len())?)
            .map(|(i, outputs)| Collective::AllGather { input: buf(i), outputs, dtype })
            .collect(),
        ops::OpKind::Gather => {
            vec![Collective::Gather { input: first(ins, "input")?, outputs: bufs(outs), root: root()?, dtype }]
        }
        ops::OpKind::Scatter => {
            vec![Collective::Scatter { inputs: bufs(ins), output: first(outs, "output")?, root: root()?, dtype }]
        }
        ops::OpKind::ReduceScatter => outs
            .iter()
            .zip(per_part(kind, "inputs", ins, outs.len())?)
            .map(|(o, inputs)| {
                Ok(Collective::ReduceScatter { inputs, output: buf(o), red: reduction(o, call.reduce, call.premul)? })
            })
            .collect::<Result<_>>()?,
        ops::OpKind::AllToAll => vec![Collective::AllToAll { inputs: bufs(ins), outputs: bufs(outs), dtype }],
        ops::OpKind::Barrier => vec![Collective::Barrier],
        ops::OpKind::MonitoredBarrier => {
            vec![Collective::MonitoredBarrier { wait_all: call.wait_all, timeout: timeout(call.timeout_ms) }]
        }
        ops::OpKind::AllReduceSparse => {
            let [indices, values] = ins else {
                return Err(Error::invalid("rustc10d: a sparse all-reduce takes indices and values"));
            };
            vec![Collective::AllReduceSparse {
                indices: buf(indices),
                values: buf(values),
                shape: sparse_shape(call)?,
                dtype: dtype_of(values.dtype).unwrap_or(dtype::DType::U8),
                out: sparse.ok_or_else(|| Error::unsupported("rustc10d: a sparse all-reduce cannot run here"))?.clone(),
            }]
        }
        ops::OpKind::Send | ops::OpKind::Recv => unreachable!("point-to-point calls are not collectives"),
    })
}

/// A sparse all-reduce's tensor shape.
fn sparse_shape(call: &Call) -> Result<ops::SparseShape> {
    let sizes = call.sparse_sizes.iter().map(|&s| u64::try_from(s)).collect::<std::result::Result<Vec<_>, _>>();
    let sizes = sizes.ok().filter(|s| call.sparse_dim <= s.len());
    let sizes =
        sizes.ok_or_else(|| Error::invalid("rustc10d: a sparse all-reduce of a tensor without a valid shape"))?;
    let (sparse, dense) = sizes.split_at(call.sparse_dim);
    Ok(ops::SparseShape { sparse_sizes: sparse.to_vec(), dense_sizes: dense.to_vec(), value_row: call.value_row })
}

/// The shim's half of an op (its tensors, future, events), shared by the
/// device primitives that stage its tensors and the finisher that completes
/// it: it lives until the last of them is done, so that a failed op's
/// restore, which runs after the op has completed, still has its tensors.
/// The lock keeps the shim's calls on it one at a time.
pub(super) type SharedCompletion = Arc<Mutex<level::Completion, cxx::UniquePtr<bridge::Completion>>>;

pub(super) fn shared(done: cxx::UniquePtr<bridge::Completion>) -> SharedCompletion {
    Arc::new(Mutex::new(done))
}

/// `f` on the Completion, unless the shim handed none.
fn with<T>(done: &SharedCompletion, f: impl FnOnce(&bridge::Completion) -> T) -> Option<T> {
    let done = done.lock().unwrap_or_else(|e| e.into_inner());
    done.as_ref().map(f)
}

/// Finishing an op completes its torch future; a sparse all-reduce hands
/// over what it gathered, a staged receive first copies its result back to
/// the device (or, failed, leaves it as it was). With `after` (test staging:
/// the host is the consumer), the completion runs once the op's copies back
/// have, and then passes `fence`.
pub(super) fn finish_with(
    done: SharedCompletion,
    sparse: Option<Arc<Mutex<level::SparseGathered, SparseGathered>>>,
    staged_out: Option<Staging>,
    after: Option<(AfterCopies, Arc<Fence>)>,
) -> Finisher {
    // Fields drop in this order: a staging dropped before it settled (the
    // op never ran) settles before the finisher lets go of the Completion.
    struct Finish {
        staged: Option<Staging>,
        sparse: Option<Arc<Mutex<level::SparseGathered, SparseGathered>>>,
        done: SharedCompletion,
    }
    let finish = Finish { staged: staged_out, sparse, done };
    Box::new(move |r: &Result<i64>| {
        let Finish { staged, sparse, done } = finish;
        let r = match staged {
            Some(mut staging) => {
                let out = r.clone().and_then(|n| staging.all_out().map(|()| n));
                staging.settle();
                out
            }
            None => r.clone(),
        };
        match after {
            Some((after, fence)) => {
                let outcome = r.clone().map(|_| ());
                after.then(Box::new(move || {
                    let _ = complete(&done, r, sparse);
                    fence.pass();
                }));
                outcome
            }
            None => complete(&done, r, sparse),
        }
    })
}

/// Complete the shim's half of the op with `r`: settled under the
/// Completion's lock, published without it (`publish` runs torch's
/// callbacks, the user's code, which may issue the next op: locks.rs).
fn complete(
    done: &SharedCompletion,
    r: Result<i64>,
    sparse: Option<Arc<Mutex<level::SparseGathered, SparseGathered>>>,
) -> Result<()> {
    let settled = match (&r, sparse) {
        (Ok(_), Some(out)) => {
            let out = std::mem::take(&mut *out.lock().unwrap());
            with(done, |c| bridge::settle_sparse(c, &out.rows, &out.indices, &out.values))
        }
        (Ok(_), None) => with(done, bridge::settle),
        (Err(_), _) => None,
    };
    let r = match settled.filter(|failed| !failed.is_empty()) {
        Some(failed) => Err(Error::io(failed)),
        None => r.map(|_| ()),
    };
    unlocked(done, |c| match &r {
        Ok(()) => bridge::publish(c, bridge::ErrorKind::Io, ""),
        Err(e) => bridge::publish(c, e.kind.into(), &e.message),
    });
    r
}

/// `f` on the Completion without taking its lock, unless the shim handed
/// none: for `publish` alone.
fn unlocked<T>(done: &SharedCompletion, f: impl FnOnce(&bridge::Completion) -> T) -> Option<T> {
    let completion = done.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|c| c as *const bridge::Completion)?;
    // SAFETY: the UniquePtr in `done` is set when the op is issued and never
    // replaced or reset, and `done`, which the caller holds, keeps it and so
    // the Completion alive through `f`. `publish` touches only what no call
    // made under the lock touches (the future, the hooks, the timing that
    // `settle` wrote before: completion.cc), so it need not take turns.
    Some(f(unsafe { &*completion }))
}

/// Where an op's completion waits for its copies back (test staging), the
/// op's Work waits for it too: passed once the completion has run.
#[derive(Default)]
pub(crate) struct Fence {
    state: Mutex<level::Fence, FenceState>,
    changed: Condvar,
}

#[derive(Default)]
struct FenceState {
    passed: bool,
    then: Vec<Job>,
}

impl Fence {
    pub(crate) fn pass(&self) {
        let then = {
            let mut state = self.state.lock().unwrap();
            state.passed = true;
            std::mem::take(&mut state.then)
        };
        self.changed.notify_all();
        then.into_iter().for_each(|f| f());
    }

    pub(crate) fn passed(&self) -> bool {
        self.state.lock().unwrap().passed
    }

    /// Whether it passed by `until`.
    pub(crate) fn wait(&self, until: Instant) -> bool {
        let state = self.state.lock().unwrap();
        let wait = until.saturating_duration_since(Instant::now());
        self.changed.wait_timeout_while(state, wait, |s| !s.passed).unwrap().0.passed
    }

    /// Run `f` once every one of `all` has passed (here and now if they have).
    pub(crate) fn after_all(all: &[Arc<Fence>], f: Job) {
        // How many have yet to pass, and `f` until it runs.
        let left = Arc::new(Mutex::<level::FencesLeft, _>::new((all.len(), Some(f))));
        let one_passed = move |left: &Mutex<level::FencesLeft, (usize, Option<Job>)>| {
            let mut left = left.lock().unwrap();
            left.0 = left.0.saturating_sub(1);
            let f = if left.0 == 0 { left.1.take() } else { None };
            drop(left);
            if let Some(f) = f {
                f();
            }
        };
        if all.is_empty() {
            left.lock().unwrap().0 = 1;
            return one_passed(&left);
        }
        for fence in all {
            let left = left.clone();
            let mut state = fence.state.lock().unwrap();
            if state.passed {
                drop(state);
                one_passed(&left);
            } else {
                state.then.push(Box::new(move || one_passed(&left)));
            }
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// The shim's device primitives for one op's staged buffers; with
/// `streams` (held, side, restore), for copies back held behind a gate too.
#[derive(Clone)]
pub(super) struct ShimDevice {
    pub(super) done: SharedCompletion,
    pub(super) streams: Option<[crate::cuda::Stream; 3]>,
}

impl ShimDevice {
    fn call<T>(&self, f: impl FnOnce(&bridge::Completion) -> std::result::Result<T, cxx::Exception>) -> Result<T> {
        let called = with(&self.done, f).ok_or_else(|| Error::invalid("rustc10d: a staged op without a Completion"))?;
        called.map_err(|e| Error::io(e.what().to_string()))
    }

    fn streams(&self) -> Result<[usize; 3]> {
        let streams = self.streams.ok_or_else(|| Error::invalid("rustc10d: a held copy back without streams"))?;
        Ok(streams.map(|s| s.0))
    }
}

impl Device for ShimDevice {
    fn to_host(&mut self, index: usize, start: usize, len: usize) -> Result<Event> {
        self.call(|c| bridge::to_host(c, index, start, len))
    }
    fn wait(&mut self, event: Event) -> Result<()> {
        self.call(|c| bridge::wait_event(c, event))
    }
    fn to_device(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        self.call(|c| bridge::to_device(c, index, start, len))
    }
}

impl HeldCopies for ShimDevice {
    fn to_device_held(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        let [held, side, _] = self.streams()?;
        // SAFETY: both are streams of this op's device's DeviceGate
        // (`Group::gates`), which are never destroyed.
        self.call(|c| unsafe { bridge::to_device_held(c, held, side, index, start, len) })
    }
    fn restore(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        let [_, _, restore] = self.streams()?;
        // SAFETY: the restore stream of this op's device's DeviceGate, never destroyed.
        self.call(|c| unsafe { bridge::restore(c, restore, index, start, len) })
    }
}
