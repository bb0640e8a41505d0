//! The cxx bridge: typed all the way. The C++ shim translates tensors and
//! options into a `Call` and submits it; the engine calls back to finish ops,
//! to move staged tensors with the shim's device primitives, and to use the
//! Store. Enums are shared with C++ with the core's own values.

use crate::algorithms::RawBuf;
use crate::config::Config;
use crate::dtype;
use crate::engine::{Device, Engine, Event, OpHandle, StagedBuffer, Staging, Waited};
use crate::error::{self, Error, Result};
use crate::ops::{self, Collective, Reduction, SparseGathered};
use crate::rendezvous::Store;
use crate::status::Callback;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[cxx::bridge(namespace = "rustc10d")]
pub mod bridge {
    /// Element type; `Opaque`: one an op only moves (never reduces).
    #[repr(u8)]
    enum DType {
        Float32,
        Float64,
        Float16,
        BFloat16,
        Int8,
        UInt8,
        Int16,
        Int32,
        Int64,
        Bool,
        Opaque = 255,
    }

    /// c10d's RedOpType, same values.
    #[repr(u8)]
    enum ReduceOpCode {
        Sum,
        Avg,
        Product,
        Min,
        Max,
        BAnd,
        BOr,
        BXor,
        PremulSum,
    }

    #[repr(u8)]
    enum OpKind {
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

    #[repr(u8)]
    enum WaitOutcome {
        Done,
        Failed,
        TimedOut,
    }

    /// What went wrong; it picks the Python exception the shim raises.
    #[repr(u8)]
    enum ErrorKind {
        InvalidArgument,
        Unsupported,
        Timeout,
        PeerLost,
        Io,
        Aborted,
        Mismatch,
    }

    /// A contiguous byte range of host memory (a CPU tensor's storage, or a
    /// device tensor's host copy).
    struct TensorDesc {
        ptr: usize,
        nbytes: usize,
        dtype: DType,
    }

    /// A device tensor the op works on through `host`, its pinned host copy.
    struct StagedDesc {
        host: TensorDesc,
        /// The op reads it: bring it to the host first.
        copy_in: bool,
        /// The op writes it: copy it back once the op has succeeded.
        copy_out: bool,
        /// Byte ranges of the host copy are byte ranges of the device tensor.
        contiguous: bool,
    }

    /// One call of a torch.distributed op, as descriptors. Per kind:
    /// AllReduce: `outputs` (in place), one collective each. Reduce,
    /// Broadcast: `outputs[0]`. AllGather: `inputs`, and `outputs` W blocks
    /// per input. Gather: `inputs[0]`, W `outputs` at the root. Scatter: W
    /// `inputs` at the root, `outputs[0]`. ReduceScatter: W `inputs` blocks
    /// per output. AllToAll: W of each. AllReduceSparse: `inputs` = indices,
    /// values. Send: `inputs[0]`; Recv: `outputs[0]`.
    struct Call {
        kind: OpKind,
        inputs: Vec<TensorDesc>,
        outputs: Vec<TensorDesc>,
        /// The root of a rooted collective; the peer of a send or receive (-1: any source).
        root: i64,
        tag: i64,
        reduce: ReduceOpCode,
        /// PREMUL_SUM's factor.
        premul: f64,
        /// Monitored barrier: report every missing rank.
        wait_all: bool,
        /// Sparse all-reduce: bytes per row of indices and of values.
        index_row: usize,
        value_row: usize,
        /// Negative: the group's timeout. A monitored barrier's is rank 0's wait.
        timeout_ms: i64,
        staged: Vec<StagedDesc>,
    }

    extern "Rust" {
        type Group;
        type Op;

        /// Hand a call to the engine. An op refused at once (bad input) comes
        /// back failed, with `failed_at_issue`.
        fn submit(self: &Group, call: &Call, done: UniquePtr<Completion>) -> Box<Op>;
        fn start_coalescing(self: &Group) -> Result<()>;
        /// One op for every op issued since start_coalescing.
        fn end_coalescing(self: &Group, done: UniquePtr<Completion>) -> Box<Op>;
        fn sequence_number(self: &Group) -> u64;
        fn set_timeout(self: &Group, timeout_ms: i64);
        fn shutdown(self: &Group);
        /// Config::cuda: CUDA tensors are accepted.
        fn cuda_allowed(self: &Group) -> bool;
        /// Config::test_staging: CPU tensors are staged like CUDA tensors.
        fn test_staging(self: &Group) -> bool;

        fn is_done(self: &Op) -> bool;
        fn failed_at_issue(self: &Op) -> bool;
        fn wait(self: &Op, timeout_ms: i64) -> WaitOutcome;
        fn error_kind(self: &Op) -> ErrorKind;
        fn error_message(self: &Op) -> String;
        fn source_rank(self: &Op) -> i64;
        fn seq(self: &Op) -> u64;
    }

    unsafe extern "C++" {
        include!("rustc10d/cpp/shim.h");
        type StoreRef;
        type Completion;

        fn store_set(store: &StoreRef, key: &str, value: &[u8]) -> Result<()>;
        fn store_get(store: &StoreRef, key: &str, timeout_ms: i64) -> Result<Vec<u8>>;
        fn store_add(store: &StoreRef, key: &str, delta: i64) -> Result<i64>;
        fn store_host(store: &StoreRef) -> String;
        fn store_from_python(pyobject: usize) -> Result<UniquePtr<StoreRef>>;

        /// Finish the op: its future, its Work, its tensors (error empty: success).
        fn complete(done: UniquePtr<Completion>, kind: ErrorKind, error: &str);
        /// Finish a sparse all-reduce: every rank's rows, to be added up.
        fn complete_sparse(done: UniquePtr<Completion>, rows: &[u64], indices: &[u8], values: &[u8]);

        /// Device primitives on staged buffer `buffer` (by index into Call::staged).
        /// Queue bytes [start, start + len) to the host after the caller's
        /// queued work; the event marks it done.
        fn to_host(done: &Completion, buffer: usize, start: usize, len: usize) -> Result<u64>;
        fn wait_event(done: &Completion, event: u64) -> Result<()>;
        /// Queue bytes [start, start + len) back to the device.
        fn to_device(done: &Completion, buffer: usize, start: usize, len: usize) -> Result<()>;

        fn backend_to_python(group: Box<Group>, rank: i32, size: i32) -> Result<usize>;
    }
}

use bridge::{Call, OpKind, ReduceOpCode, WaitOutcome};

// Torch's Store and the tensors a Completion holds are safe to use and
// release from any thread.
unsafe impl Send for bridge::Completion {}
unsafe impl Send for bridge::StoreRef {}
unsafe impl Sync for bridge::StoreRef {}

pub use bridge::{backend_to_python, store_from_python, store_host, StoreRef};

impl Store for StoreRef {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        bridge::store_set(self, key, value).map_err(|e| Error::io(format!("store set {key}: {e}")))
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        bridge::store_get(self, key, timeout.as_millis() as i64)
            .map_err(|e| Error::timeout(format!("store get {key}: {e}")))
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        bridge::store_add(self, key, delta).map_err(|e| Error::io(format!("store add {key}: {e}")))
    }
}

/// A process group's engine and the settings the shim asks about.
pub struct Group {
    pub engine: Engine,
    pub cfg: Config,
}

pub struct Op {
    handle: OpHandle,
    at_issue: bool,
}

impl From<error::ErrorKind> for bridge::ErrorKind {
    fn from(k: error::ErrorKind) -> Self {
        use error::ErrorKind as K;
        match k {
            K::InvalidArgument => Self::InvalidArgument,
            K::Unsupported => Self::Unsupported,
            K::Timeout => Self::Timeout,
            K::PeerLost => Self::PeerLost,
            K::Io => Self::Io,
            K::Aborted => Self::Aborted,
            K::Mismatch => Self::Mismatch,
        }
    }
}

fn dtype_of(d: bridge::DType) -> Result<dtype::DType> {
    dtype::DType::ALL
        .get(d.repr as usize)
        .copied()
        .ok_or_else(|| Error::unsupported("rustc10d does not support reductions on this dtype yet"))
}

fn op_kind(k: OpKind) -> Result<ops::OpKind> {
    ops::OpKind::from_code(k.repr).ok_or_else(|| Error::invalid(format!("rustc10d: unknown op kind {}", k.repr)))
}

/// A timeout from torch's options: negative is unset (torch's kUnsetTimeout,
/// the group's timeout applies); zero is a real, zero timeout.
fn timeout(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

fn buf(t: &bridge::TensorDesc) -> RawBuf {
    RawBuf::new(t.ptr as *mut u8, t.nbytes)
}

fn bufs(ts: &[bridge::TensorDesc]) -> Vec<RawBuf> {
    ts.iter().map(buf).collect()
}

fn rank(r: i64, what: &str) -> Result<usize> {
    usize::try_from(r).map_err(|_| Error::invalid(format!("rustc10d: {what} rank {r} is negative")))
}

fn reduction(t: &bridge::TensorDesc, call: &Call) -> Result<Reduction> {
    let dtype = dtype_of(t.dtype)?;
    if call.reduce == ReduceOpCode::PremulSum {
        return Ok(Reduction { dtype, op: dtype::ReduceOp::Sum, premul: Some(call.premul) });
    }
    Ok(Reduction::new(dtype, dtype::ReduceOp::from_code(call.reduce.repr)?))
}

/// Cut a flat list into `parts` equal groups (one per coalesced tensor).
fn per_part(ts: &[bridge::TensorDesc], parts: usize) -> Result<Vec<Vec<RawBuf>>> {
    if parts == 0 || !ts.len().is_multiple_of(parts) {
        return Err(Error::invalid(format!("rustc10d: {} tensors do not split into {parts} calls", ts.len())));
    }
    Ok(ts.chunks(ts.len() / parts).map(bufs).collect())
}

fn first(ts: &[bridge::TensorDesc], what: &str) -> Result<RawBuf> {
    ts.first().map(buf).ok_or_else(|| Error::invalid(format!("rustc10d: the call has no {what} tensor")))
}

/// A reduction reduces tensors of one dtype.
fn same_dtype(kind: ops::OpKind, ts: impl IntoIterator<Item = bridge::DType>) -> Result<()> {
    let mut ts = ts.into_iter();
    let first = ts.next();
    if ts.any(|d| Some(d) != first) {
        return Err(Error::invalid(format!("rustc10d: {}: all tensors must have the same dtype", kind.name())));
    }
    Ok(())
}

/// The collectives of a call (see `Call`'s layouts).
fn collectives(call: &Call, sparse: &Arc<Mutex<SparseGathered>>) -> Result<Vec<Collective>> {
    let (ins, outs) = (&call.inputs[..], &call.outputs[..]);
    let root = || rank(call.root, "root");
    let kind = op_kind(call.kind)?;
    if matches!(kind, ops::OpKind::AllReduce | ops::OpKind::ReduceScatter) {
        same_dtype(kind, ins.iter().chain(outs).map(|t| t.dtype))?;
    }
    Ok(match kind {
        ops::OpKind::AllReduce => outs
            .iter()
            .map(|t| Ok(Collective::AllReduce { buf: buf(t), red: reduction(t, call)? }))
            .collect::<Result<_>>()?,
        ops::OpKind::Reduce => {
            let t = outs.first().ok_or_else(|| Error::invalid("rustc10d: reduce takes one tensor"))?;
            vec![Collective::Reduce { buf: buf(t), root: root()?, red: reduction(t, call)? }]
        }
        ops::OpKind::Broadcast => vec![Collective::Broadcast { buf: first(outs, "output")?, root: root()? }],
        ops::OpKind::AllGather => ins
            .iter()
            .zip(per_part(outs, ins.len())?)
            .map(|(i, outputs)| Collective::AllGather { input: buf(i), outputs })
            .collect(),
        ops::OpKind::Gather => {
            vec![Collective::Gather { input: first(ins, "input")?, outputs: bufs(outs), root: root()? }]
        }
        ops::OpKind::Scatter => {
            vec![Collective::Scatter { inputs: bufs(ins), output: first(outs, "output")?, root: root()? }]
        }
        ops::OpKind::ReduceScatter => outs
            .iter()
            .zip(per_part(ins, outs.len())?)
            .map(|(o, inputs)| Ok(Collective::ReduceScatter { inputs, output: buf(o), red: reduction(o, call)? }))
            .collect::<Result<_>>()?,
        ops::OpKind::AllToAll => vec![Collective::AllToAll { inputs: bufs(ins), outputs: bufs(outs) }],
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
                index_row: call.index_row,
                value_row: call.value_row,
                dtype: dtype_of(values.dtype).unwrap_or(dtype::DType::U8),
                out: sparse.clone(),
            }]
        }
        ops::OpKind::Send | ops::OpKind::Recv => unreachable!("point-to-point calls are not collectives"),
    })
}

/// Finishing an op completes its torch future (and releases its tensors);
/// a sparse all-reduce hands over what it gathered, a staged receive first
/// queues its result back to the device.
fn finish_with(
    done: cxx::UniquePtr<bridge::Completion>,
    sparse: Option<Arc<Mutex<SparseGathered>>>,
    staged_out: Option<Staging>,
) -> Callback {
    Box::new(move |r: &Result<i64>| {
        let r = match (r, staged_out) {
            (Ok(_), Some(mut staging)) => staging.all_out().map(|()| 0),
            (r, _) => r.clone(),
        };
        match (r, sparse) {
            (Ok(_), Some(out)) => {
                let out = std::mem::take(&mut *out.lock().unwrap());
                bridge::complete_sparse(done, &out.rows, &out.indices, &out.values)
            }
            (Ok(_), None) => bridge::complete(done, bridge::ErrorKind::Io, ""),
            (Err(e), _) => bridge::complete(done, e.kind.into(), &e.message),
        }
    })
}

/// The shim's device primitives for one op's staged buffers.
struct ShimDevice(*const bridge::Completion);

// The Completion lives in the op's callback, which runs only after staging is
// done with (for a send: after its ready).
unsafe impl Send for ShimDevice {}

impl ShimDevice {
    fn call<T>(&self, f: impl FnOnce(&bridge::Completion) -> std::result::Result<T, cxx::Exception>) -> Result<T> {
        f(unsafe { &*self.0 }).map_err(|e| Error::io(e.what().to_string()))
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

impl Group {
    fn staging(&self, call: &Call, done: &cxx::UniquePtr<bridge::Completion>) -> Option<Staging> {
        let completion = done.as_ref()? as *const bridge::Completion;
        (!call.staged.is_empty()).then(|| Staging {
            buffers: call
                .staged
                .iter()
                .map(|s| StagedBuffer {
                    host: buf(&s.host),
                    copy_in: s.copy_in,
                    copy_out: s.copy_out,
                    contiguous: s.contiguous,
                })
                .collect(),
            device: Box::new(ShimDevice(completion)),
            piece_bytes: self.cfg.stage_piece_bytes,
        })
    }

    // Safety of the raw buffers: the Completion owns the tensors and is
    // dropped only when the engine finishes the op.
    fn issue(&self, call: &Call, done: cxx::UniquePtr<bridge::Completion>) -> Result<OpHandle> {
        let staging = self.staging(call, &done);
        let e = &self.engine;
        match op_kind(call.kind)? {
            ops::OpKind::Send => {
                let ready = staging.map(|s| s.send_in()).transpose()?;
                let ready = ready.map(|wait| -> crate::transport::Ready {
                    Box::new(move || wait().map_err(|e| e.context("rustc10d: send could not stage its tensor")))
                });
                let dst = rank(call.root, "destination")?;
                let input = first(&call.inputs, "input")?;
                unsafe { e.send(input, dst, call.tag, timeout(call.timeout_ms), ready, finish_with(done, None, None)) }
            }
            ops::OpKind::Recv => {
                // A negative source: any source (torch's recvAnysource).
                let src = if call.root < 0 { None } else { Some(rank(call.root, "source")?) };
                let out = first(&call.outputs, "output")?;
                unsafe { e.recv(out, src, call.tag, timeout(call.timeout_ms), finish_with(done, None, staging)) }
            }
            _ => {
                let sparse = Arc::new(Mutex::new(SparseGathered::default()));
                let parts = collectives(call, &sparse)?;
                let is_sparse = call.kind == OpKind::AllReduceSparse;
                // A monitored barrier's timeout is rank 0's wait; the op runs with the group's.
                let op_timeout = if call.kind == OpKind::MonitoredBarrier { None } else { timeout(call.timeout_ms) };
                let done = finish_with(done, is_sparse.then_some(sparse), None);
                unsafe { e.submit(parts, op_timeout, staging, done) }
            }
        }
    }

    fn submit(&self, call: &Call, done: cxx::UniquePtr<bridge::Completion>) -> Box<Op> {
        Box::new(match self.issue(call, done) {
            Ok(handle) => Op { handle, at_issue: false },
            Err(e) => Op { handle: OpHandle::failed(e), at_issue: true },
        })
    }

    fn start_coalescing(&self) -> Result<()> {
        self.engine.start_coalescing()
    }

    fn end_coalescing(&self, done: cxx::UniquePtr<bridge::Completion>) -> Box<Op> {
        Box::new(match self.engine.end_coalescing(finish_with(done, None, None)) {
            Ok(handle) => Op { handle, at_issue: false },
            Err(e) => Op { handle: OpHandle::failed(e), at_issue: true },
        })
    }

    fn sequence_number(&self) -> u64 {
        self.engine.sequence_number()
    }

    fn set_timeout(&self, timeout_ms: i64) {
        self.engine.set_timeout(Duration::from_millis(timeout_ms.max(0) as u64));
    }

    fn shutdown(&self) {
        self.engine.shutdown();
    }

    fn cuda_allowed(&self) -> bool {
        self.cfg.cuda
    }

    fn test_staging(&self) -> bool {
        self.cfg.test_staging
    }
}

impl Op {
    fn is_done(&self) -> bool {
        self.handle.is_done()
    }

    fn failed_at_issue(&self) -> bool {
        self.at_issue
    }

    fn wait(&self, timeout_ms: i64) -> WaitOutcome {
        match self.handle.wait(timeout(timeout_ms)) {
            Waited::Done => WaitOutcome::Done,
            Waited::Failed(_) => WaitOutcome::Failed,
            Waited::TimedOut => WaitOutcome::TimedOut,
        }
    }

    fn error_kind(&self) -> bridge::ErrorKind {
        self.handle.error().map_or(bridge::ErrorKind::Io, |e| e.kind.into())
    }

    fn error_message(&self) -> String {
        self.handle.error().map(|e| e.message).unwrap_or_default()
    }

    fn source_rank(&self) -> i64 {
        self.handle.source_rank()
    }

    fn seq(&self) -> u64 {
        self.handle.seq()
    }
}

// The shared enums carry the core's values (checked when the shim is built).
const _: () = {
    use dtype::{DType as D, ReduceOp as R};
    use ops::OpKind as K;
    assert!(bridge::DType::Float32.repr == D::F32 as u8 && bridge::DType::Bool.repr == D::Bool as u8);
    assert!(bridge::DType::BFloat16.repr == D::BF16 as u8 && bridge::DType::Int64.repr == D::I64 as u8);
    assert!(ReduceOpCode::Sum.repr == R::Sum as u8 && ReduceOpCode::BXor.repr == R::BXor as u8);
    assert!(OpKind::AllReduce.repr == K::AllReduce as u8 && OpKind::Recv.repr == K::Recv as u8);
    assert!(OpKind::AllReduceSparse.repr == K::AllReduceSparse as u8);
};
