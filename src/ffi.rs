//! The cxx bridge: the C++ shim translates tensors into `TensorDesc`s and
//! calls the engine; the engine calls back to finish ops and to use the Store.

use crate::algorithms::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::engine::{Collective, Engine, OpHandle, Reduction, Staging, Waited};
use crate::error::{Error, Result};
use crate::rendezvous::Store;
use crate::status::Callback;
use std::time::Duration;

#[cxx::bridge(namespace = "rustc10d")]
pub mod bridge {
    /// A contiguous CPU tensor's storage; `dtype` is a `DType` code.
    struct TensorDesc {
        ptr: usize,
        nbytes: usize,
        dtype: u8,
    }

    /// A reduce op as torch names it: `op` is c10d's RedOpType code;
    /// `premul` is PREMUL_SUM's factor (op 8).
    struct ReduceSpec {
        op: u8,
        premul: f64,
    }

    extern "Rust" {
        type Group;
        type Op;

        // Collectives. Lists are flattened: `parts` coalesced calls of the same
        // kind, with `world` blocks per part where an op has one per rank.
        fn all_reduce(
            self: &Group,
            tensors: &[TensorDesc],
            spec: ReduceSpec,
            timeout_ms: i64,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;
        fn reduce(
            self: &Group,
            t: TensorDesc,
            root: i64,
            spec: ReduceSpec,
            timeout_ms: i64,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;
        fn broadcast(
            self: &Group,
            t: TensorDesc,
            root: i64,
            timeout_ms: i64,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;
        fn all_gather(
            self: &Group,
            inputs: &[TensorDesc],
            outputs: &[TensorDesc],
            timeout_ms: i64,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;
        fn gather(
            self: &Group,
            input: TensorDesc,
            outputs: &[TensorDesc],
            root: i64,
            timeout_ms: i64,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;
        fn scatter(
            self: &Group,
            inputs: &[TensorDesc],
            output: TensorDesc,
            root: i64,
            timeout_ms: i64,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;
        fn reduce_scatter(
            self: &Group,
            inputs: &[TensorDesc],
            outputs: &[TensorDesc],
            spec: ReduceSpec,
            timeout_ms: i64,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;
        fn all_to_all(
            self: &Group,
            inputs: &[TensorDesc],
            outputs: &[TensorDesc],
            timeout_ms: i64,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;
        fn barrier(self: &Group, timeout_ms: i64, done: UniquePtr<Completion>) -> Result<Box<Op>>;
        fn monitored_barrier(
            self: &Group,
            wait_all: bool,
            timeout_ms: i64,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;

        // Point to point.
        /// `staged`: the tensor's bytes are on the host only once
        /// `await_staged` returns (the sending thread calls it).
        fn send(
            self: &Group,
            t: TensorDesc,
            dst: i64,
            tag: i64,
            timeout_ms: i64,
            staged: bool,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;
        fn recv(
            self: &Group,
            t: TensorDesc,
            src: i64,
            tag: i64,
            timeout_ms: i64,
            done: UniquePtr<Completion>,
        ) -> Result<Box<Op>>;

        fn sequence_number(self: &Group) -> u64;
        fn set_timeout(self: &Group, timeout_ms: i64);
        fn shutdown(self: &Group);

        fn is_done(self: &Op) -> bool;
        /// 0: done, 1: failed (see error_message), 2: `timeout_ms` passed first.
        fn wait(self: &Op, timeout_ms: i64) -> i32;
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
        fn complete(done: UniquePtr<Completion>, error: &str);
        /// Bring a CUDA op's inputs to the host (in stream order) and wait for
        /// them; nothing to do for CPU ops.
        fn stage_inputs(done: &Completion) -> Result<()>;
        /// Start bringing the op's one staged buffer to the host in pieces of
        /// `bytes`; false if the op has no such buffer.
        fn stage_pieces(done: &Completion, bytes: usize) -> Result<bool>;
        /// Wait until piece `i` is on the host.
        fn piece_in(done: &Completion, i: usize) -> Result<()>;
        /// Queue the copy of piece `i` back to the device.
        fn piece_out(done: &Completion, i: usize) -> Result<()>;
        /// Wait until a send's tensor, whose copy was queued at issue, is on the host.
        fn await_staged(done: &Completion) -> Result<()>;
        fn backend_to_python(group: Box<Group>, rank: i32, size: i32) -> Result<usize>;
    }
}

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

pub struct Group(pub Engine);
pub struct Op(OpHandle);

/// A timeout from torch's options: negative is unset (torch's kUnsetTimeout,
/// the group's timeout applies); zero is a real, zero timeout.
fn timeout(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

fn buf(t: &bridge::TensorDesc) -> RawBuf {
    RawBuf::new(t.ptr as *mut u8, t.nbytes)
}

fn rank(r: i64, what: &str) -> Result<usize> {
    usize::try_from(r).map_err(|_| Error::invalid(format!("rustc10d: {what} rank {r} is negative")))
}

/// Finishing an op completes its torch future (and releases its tensors).
fn finish_with(done: cxx::UniquePtr<bridge::Completion>) -> Callback {
    Box::new(move |r: &Result<i64>| match r {
        Ok(_) => bridge::complete(done, ""),
        Err(e) => bridge::complete(done, &e.message),
    })
}

/// Staged ops run in pieces of this many bytes where they can (one large
/// all_reduce or broadcast of a CUDA tensor): the device copies of one piece
/// overlap the network transfer of the others. 0: whole tensors.
pub const ENV_STAGE_PIECE_BYTES: &str = "RUSTC10D_STAGE_PIECE_BYTES";
const DEFAULT_STAGE_PIECE_BYTES: usize = 8 << 20;

fn stage_piece_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        std::env::var(ENV_STAGE_PIECE_BYTES).ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_STAGE_PIECE_BYTES)
    })
}

/// The shim's staging of an op's tensors (nothing to do for CPU tensors), on
/// the engine thread: a device copy is then ordered after the previous op's
/// copy back (both on the group's stream) and the caller never blocks on it.
struct ShimStaging(*const bridge::Completion);

// The Completion lives in the op's callback, which runs only after the staging is done with
// (for a send: after `ready`).
unsafe impl Send for ShimStaging {}

impl ShimStaging {
    fn of(done: &cxx::UniquePtr<bridge::Completion>) -> ShimStaging {
        ShimStaging(done.as_ref().map_or(std::ptr::null(), |c| c as *const _))
    }

    fn with<T: Default>(
        &self,
        f: impl FnOnce(&bridge::Completion) -> std::result::Result<T, cxx::Exception>,
    ) -> Result<T> {
        match unsafe { self.0.as_ref() } {
            Some(c) => f(c).map_err(|e| Error::io(e.what().to_string())),
            None => Ok(T::default()),
        }
    }
}

impl Staging for ShimStaging {
    fn all_in(&mut self) -> Result<()> {
        self.with(bridge::stage_inputs)
    }
    fn piece_bytes(&self) -> usize {
        stage_piece_bytes()
    }
    fn start_pieces(&mut self, bytes: usize) -> Result<bool> {
        self.with(|c| bridge::stage_pieces(c, bytes))
    }
    fn piece_in(&mut self, i: usize) -> Result<()> {
        self.with(|c| bridge::piece_in(c, i))
    }
    fn piece_out(&mut self, i: usize) -> Result<()> {
        self.with(|c| bridge::piece_out(c, i))
    }
}

fn reduction(t: &bridge::TensorDesc, spec: &bridge::ReduceSpec) -> Result<Reduction> {
    let dtype = DType::from_code(t.dtype)?;
    if spec.op == PREMUL_SUM {
        return Ok(Reduction { dtype, op: ReduceOp::Sum, premul: Some(spec.premul) });
    }
    Ok(Reduction::new(dtype, ReduceOp::from_code(spec.op)?))
}

/// c10d's RedOpType::PREMUL_SUM.
const PREMUL_SUM: u8 = 8;

fn bufs(ts: &[bridge::TensorDesc]) -> Vec<RawBuf> {
    ts.iter().map(buf).collect()
}

/// Cut a flat list into `parts` equal groups (one per coalesced call).
fn per_part(ts: &[bridge::TensorDesc], parts: usize) -> Result<Vec<Vec<RawBuf>>> {
    if parts == 0 || !ts.len().is_multiple_of(parts) {
        return Err(Error::invalid(format!("rustc10d: {} tensors do not split into {parts} calls", ts.len())));
    }
    Ok(ts.chunks(ts.len() / parts).map(bufs).collect())
}

// Safety of the raw buffers below: the Completion owns the tensors and is
// dropped only when the engine finishes the op.
impl Group {
    fn run(
        &self,
        parts: Vec<Collective>,
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        let staging = Box::new(ShimStaging::of(&done));
        Ok(Box::new(Op(unsafe { self.0.submit_staged(parts, timeout(timeout_ms), Some(staging), finish_with(done))? })))
    }

    fn all_reduce(
        &self,
        ts: &[bridge::TensorDesc],
        spec: bridge::ReduceSpec,
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        let parts = ts
            .iter()
            .map(|t| Ok(Collective::AllReduce { buf: buf(t), red: reduction(t, &spec)? }))
            .collect::<Result<_>>()?;
        self.run(parts, timeout_ms, done)
    }

    fn reduce(
        &self,
        t: bridge::TensorDesc,
        root: i64,
        spec: bridge::ReduceSpec,
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        let part = Collective::Reduce { buf: buf(&t), root: rank(root, "root")?, red: reduction(&t, &spec)? };
        self.run(vec![part], timeout_ms, done)
    }

    fn broadcast(
        &self,
        t: bridge::TensorDesc,
        root: i64,
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        self.run(vec![Collective::Broadcast { buf: buf(&t), root: rank(root, "root")? }], timeout_ms, done)
    }

    fn all_gather(
        &self,
        inputs: &[bridge::TensorDesc],
        outputs: &[bridge::TensorDesc],
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        let parts = inputs
            .iter()
            .zip(per_part(outputs, inputs.len())?)
            .map(|(i, outputs)| Collective::AllGather { input: buf(i), outputs })
            .collect();
        self.run(parts, timeout_ms, done)
    }

    fn gather(
        &self,
        input: bridge::TensorDesc,
        outputs: &[bridge::TensorDesc],
        root: i64,
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        self.run(
            vec![Collective::Gather { input: buf(&input), outputs: bufs(outputs), root: rank(root, "root")? }],
            timeout_ms,
            done,
        )
    }

    fn scatter(
        &self,
        inputs: &[bridge::TensorDesc],
        output: bridge::TensorDesc,
        root: i64,
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        self.run(
            vec![Collective::Scatter { inputs: bufs(inputs), output: buf(&output), root: rank(root, "root")? }],
            timeout_ms,
            done,
        )
    }

    fn reduce_scatter(
        &self,
        inputs: &[bridge::TensorDesc],
        outputs: &[bridge::TensorDesc],
        spec: bridge::ReduceSpec,
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        let parts = outputs
            .iter()
            .zip(per_part(inputs, outputs.len())?)
            .map(|(o, inputs)| Ok(Collective::ReduceScatter { inputs, output: buf(o), red: reduction(o, &spec)? }))
            .collect::<Result<_>>()?;
        self.run(parts, timeout_ms, done)
    }

    fn all_to_all(
        &self,
        inputs: &[bridge::TensorDesc],
        outputs: &[bridge::TensorDesc],
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        self.run(vec![Collective::AllToAll { inputs: bufs(inputs), outputs: bufs(outputs) }], timeout_ms, done)
    }

    fn barrier(&self, timeout_ms: i64, done: cxx::UniquePtr<bridge::Completion>) -> Result<Box<Op>> {
        self.run(vec![Collective::Barrier], timeout_ms, done)
    }

    fn monitored_barrier(
        &self,
        wait_all: bool,
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        // Only rank 0 waits with the barrier's timeout; the op itself runs
        // with the group's, as torch's monitored barrier does.
        self.run(vec![Collective::MonitoredBarrier { wait_all, timeout: timeout(timeout_ms) }], -1, done)
    }

    fn send(
        &self,
        t: bridge::TensorDesc,
        dst: i64,
        tag: i64,
        timeout_ms: i64,
        staged: bool,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        let dst = rank(dst, "destination")?;
        let h = if staged {
            let staging = ShimStaging::of(&done);
            let ready = Box::new(move || {
                staging.with(bridge::await_staged).map_err(|e| e.context("rustc10d: send could not stage its tensor"))
            });
            unsafe { self.0.send_after(buf(&t), dst, tag, timeout(timeout_ms), ready, finish_with(done))? }
        } else {
            unsafe { self.0.send(buf(&t), dst, tag, timeout(timeout_ms), finish_with(done))? }
        };
        Ok(Box::new(Op(h)))
    }

    fn recv(
        &self,
        t: bridge::TensorDesc,
        src: i64,
        tag: i64,
        timeout_ms: i64,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<Box<Op>> {
        // src < 0: any source (torch's recvAnysource).
        let src = if src < 0 { None } else { Some(rank(src, "source")?) };
        let h = unsafe { self.0.recv(buf(&t), src, tag, timeout(timeout_ms), finish_with(done))? };
        Ok(Box::new(Op(h)))
    }

    fn sequence_number(&self) -> u64 {
        self.0.sequence_number()
    }

    fn set_timeout(&self, timeout_ms: i64) {
        self.0.set_timeout(Duration::from_millis(timeout_ms.max(0) as u64));
    }

    fn shutdown(&self) {
        self.0.shutdown();
    }
}

impl Op {
    fn is_done(&self) -> bool {
        self.0.is_done()
    }

    fn wait(&self, timeout_ms: i64) -> i32 {
        match self.0.wait((timeout_ms >= 0).then(|| Duration::from_millis(timeout_ms as u64))) {
            Waited::Done => 0,
            Waited::Failed(_) => 1,
            Waited::TimedOut => 2,
        }
    }

    fn error_message(&self) -> String {
        self.0.error().map(|e| e.message).unwrap_or_default()
    }

    fn source_rank(&self) -> i64 {
        self.0.source_rank()
    }

    fn seq(&self) -> u64 {
        self.0.seq()
    }
}
