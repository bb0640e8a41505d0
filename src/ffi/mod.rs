//! The cxx bridge: typed all the way. The C++ shim translates tensors and
//! options into a `Call` and submits it; the engine calls back to finish ops,
//! to move staged tensors with the shim's device primitives, and to use the
//! Store. Enums are shared with C++ with the core's own values.

mod group;
mod reconfigure;
mod translate;

pub use reconfigure::Membership;

/// `bridge::stream_capturing`.
///
/// # Safety
/// As there.
unsafe fn stream_capturing(stream: usize) -> bool {
    // SAFETY: the caller's contract is `capturing`'s.
    crate::panics::contain("asking whether a stream is captured", || unsafe { crate::cuda::capturing(stream) })
        .ok()
        .flatten()
        .unwrap_or(false)
}

use crate::config::Config;
use crate::dtype;
use crate::engine::{Engine, OpHandle};
use crate::error::{self, Error, Result};
use crate::locks::{level, Mutex};
use crate::ops;
use crate::rendezvous::{connect, Member, Store};
use crate::transport::Transport;
use std::sync::Arc;
use std::time::Duration;

#[cxx::bridge(namespace = "rustc10d")]
pub mod bridge {
    /// Element type; from `Opaque` on, one an op only moves (never
    /// reduces): `Opaque` plus torch's ScalarType (`dtype::TypeCode`).
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
        UInt16,
        UInt32,
        UInt64,
        Opaque = 64,
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
        Resource,
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
        /// Sparse all-reduce: the tensor's sizes, of which the first
        /// `sparse_dim` are its sparse dimensions, and the bytes of a row of values.
        sparse_sizes: Vec<i64>,
        sparse_dim: usize,
        value_row: usize,
        /// Negative: the group's timeout. A monitored barrier's is rank 0's wait.
        timeout_ms: i64,
        staged: Vec<StagedDesc>,
        /// The caller waits for the op as soon as it is issued (torch's
        /// `async_op=False`): it may run on the caller's thread.
        sync_op: bool,
    }

    /// Whether an earlier failure broke the group (later collectives fail
    /// with it), and of what kind: what torch's Backend::getError reports.
    struct BrokenBy {
        broken: bool,
        kind: ErrorKind,
    }

    /// How `Group::all_reduce_direct` ended.
    struct Ended {
        failed: bool,
        /// Of a failure: which, and its message.
        kind: ErrorKind,
        message: String,
    }

    extern "Rust" {
        type Group;
        type Op;
        type Formed;

        /// Whether forming the group failed, and then of what kind and why.
        fn failed(self: &Formed) -> bool;
        fn error_kind(self: &Formed) -> ErrorKind;
        fn error_message(self: &Formed) -> String;
        /// The group formed (an error only where `failed`, which the shim asks first).
        fn formed_group(formed: Box<Formed>) -> Result<Box<Group>>;

        /// Hand a call to the engine. An op refused at once (bad input) comes
        /// back failed, with `failed_at_issue`.
        fn submit(self: &Group, call: &Call, done: UniquePtr<Completion>) -> Box<Op>;
        /// The direct op's all-reduce of `tensor` in place (`rustc10d.all_reduce_`),
        /// ended when this returns: run at once on the caller's thread where the
        /// group is idle, with no Op made, else queued and waited for. The
        /// caller holds the tensor, untouched, until this returns.
        fn all_reduce_direct(self: &Group, tensor: &TensorDesc, reduce: ReduceOpCode) -> Ended;
        fn start_coalescing(self: &Group) -> Result<()>;
        /// One op for every op issued since start_coalescing.
        fn end_coalescing(self: &Group, done: UniquePtr<Completion>) -> Box<Op>;
        fn sequence_number(self: &Group) -> u64;
        fn broken_by(self: &Group) -> BrokenBy;
        fn set_timeout(self: &Group, timeout_ms: i64);
        fn shutdown(self: &Group);
        /// Config::cuda: CUDA tensors are accepted.
        fn cuda_allowed(self: &Group) -> bool;
        /// Config::test_staging: CPU tensors are staged like CUDA tensors.
        fn test_staging(self: &Group) -> bool;
        /// This rank in the group, and the group's size.
        fn rank(self: &Group) -> i32;
        fn size(self: &Group) -> i32;
        /// The timeout of the group's ops, in ms.
        fn timeout_ms(self: &Group) -> i64;
        /// A new group of this group's `ranks`, this rank being `rank` of it
        /// (of `size`), with this group's settings (torch's split_group),
        /// named `group_name`: a channel on this group's connections, or
        /// where there are none to share, joined through `store`
        /// (namespaced for the child).
        fn split(
            self: &Group,
            store: UniquePtr<StoreRef>,
            ranks: &[i32],
            rank: i32,
            size: i32,
            timeout_ms: i64,
            group_name: &str,
        ) -> Box<Formed>;
        /// A new group of this group's ranks but `excluded` (group ranks),
        /// in their order, joined through this group's Store (torch's
        /// shrink_group: only the survivors call it).
        fn shrink(self: &Group, excluded: &[i64], timeout_ms: i64) -> Box<Formed>;
        /// torch named the group (ProcessGroup::setGroupName): Python asks about it by that name.
        fn watch_as(self: &Group, group_name: &str);
        fn membership(self: &Group) -> Box<Membership>;

        type Membership;
        fn reconfigure_handle(self: &Membership, rank: i32) -> String;
        fn cuda_allowed(self: &Membership) -> bool;
        fn test_staging(self: &Membership) -> bool;
        /// Config::cuda_wait is `stream`: CUDA ops complete in stream order.
        fn stream_ordered(self: &Membership) -> bool;
        fn timeout_ms(self: &Membership) -> i64;
        fn set_timeout(self: &Membership, timeout_ms: i64);
        fn check_handles(self: &Membership, rank: i32, handles: &Vec<String>, ordered: bool) -> Result<()>;
        fn reconfigure(
            self: &Membership,
            rank: i32,
            uuid: i64,
            handles: Vec<String>,
            ordered: bool,
            timeout_ms: i64,
            group_name: &str,
        ) -> Box<Formed>;

        /// Whether the CUDA stream with native handle `stream` is being
        /// captured into a graph, asked of the driver (for a torch whose
        /// headers cannot say); false where the driver cannot say either.
        ///
        /// # Safety
        /// `stream` must be 0 or a live CUDA stream whose context is current.
        unsafe fn stream_capturing(stream: usize) -> bool;

        fn is_done(self: &Op) -> bool;
        fn failed_at_issue(self: &Op) -> bool;
        fn wait(self: &Op, timeout_ms: i64) -> WaitOutcome;
        fn error_kind(self: &Op) -> ErrorKind;
        fn error_message(self: &Op) -> String;
        fn source_rank(self: &Op) -> i64;
        fn seq(self: &Op) -> u64;
    }

    // SAFETY: the declarations match cpp/shim.h (cxx checks the types on
    // both sides); those not marked unsafe are safe for every argument: the
    // shim checks indices and ranges (TORCH_CHECK, as exceptions), and
    // references and UniquePtrs are valid by type. Those that take a raw
    // address or handle as an integer are unsafe fns.
    unsafe extern "C++" {
        include!("rustc10d/cpp/shim.h");
        type StoreRef;
        type Completion;

        fn store_set(store: &StoreRef, key: &str, value: &[u8]) -> Result<()>;
        fn store_get(store: &StoreRef, key: &str, timeout_ms: i64) -> Result<Vec<u8>>;
        fn store_add(store: &StoreRef, key: &str, delta: i64) -> Result<i64>;
        fn store_delete(store: &StoreRef, key: &str) -> Result<bool>;
        fn store_host(store: &StoreRef) -> String;
        /// Another handle on the same Store.
        fn store_clone(store: &StoreRef) -> UniquePtr<StoreRef>;
        /// # Safety
        /// `pyobject` must be a live `PyObject*` of a torch Store, and the
        /// caller must hold the GIL.
        unsafe fn store_from_python(pyobject: usize) -> Result<UniquePtr<StoreRef>>;

        /// The op succeeded: its outputs' copies back and events. Returns
        /// the error it fails with instead (empty: none).
        fn settle(done: &Completion) -> String;
        /// The same for a sparse all-reduce, given every rank's rows
        /// (checked against the tensor's shape), to be added up.
        fn settle_sparse(done: &Completion, rows: &[u64], indices: &[u8], values: &[u8]) -> String;
        /// Finish the op: its future, its Work (error empty: success), then
        /// its hooks; torch's callbacks, the user's code, run in here. Its
        /// tensors go with the Completion.
        fn publish(done: &Completion, kind: ErrorKind, error: &str);

        /// Device primitives on staged buffer `buffer` (by index into Call::staged).
        /// Queue bytes [start, start + len) to the host after the caller's
        /// queued work; the event marks it done.
        fn to_host(done: &Completion, buffer: usize, start: usize, len: usize) -> Result<u64>;
        fn wait_event(done: &Completion, event: u64) -> Result<()>;
        /// Queue bytes [start, start + len) back to the device.
        fn to_device(done: &Completion, buffer: usize, start: usize, len: usize) -> Result<()>;
        /// The CUDA device the op's staged tensors are on; -1: not a CUDA device.
        fn staged_device(done: &Completion) -> i32;
        /// Stream-ordered completion: queue bytes [start, start + len) back to
        /// the device on stream `held` (a native handle, behind the op's
        /// gate queued there), after the op's copies in; the op's Work then
        /// orders its consumers after `held`, and its future through `side`.
        ///
        /// # Safety
        /// `held` and `side` must be live CUDA streams of the staged tensors'
        /// device (native handles; `DeviceGate::streams`).
        unsafe fn to_device_held(
            done: &Completion,
            held: usize,
            side: usize,
            buffer: usize,
            start: usize,
            len: usize,
        ) -> Result<()>;
        /// Copy bytes [start, start + len) from the device to the host copy
        /// now, on stream `restore` (nothing else uses it), after the
        /// caller's work queued before the op, and wait for the copy.
        ///
        /// # Safety
        /// As for `to_device_held`, of `restore`.
        unsafe fn restore(done: &Completion, restore: usize, buffer: usize, start: usize, len: usize) -> Result<()>;

        fn backend_to_python(group: Box<Group>, rank: i32, size: i32) -> Result<usize>;
        fn unformed_backend_to_python(membership: Box<Membership>, rank: i32, size: i32) -> Result<usize>;
    }
}

use bridge::{OpKind, ReduceOpCode};

// SAFETY: a Completion holds tensors, a future and CUDA events, all of which
// torch lets any thread use and release; the engine hands it from the
// issuing thread to whichever finishes the op, one at a time.
unsafe impl Send for bridge::Completion {}
// SAFETY: a StoreRef holds an intrusive_ptr to a c10d::Store, which torch
// lets any thread use and release.
unsafe impl Send for bridge::StoreRef {}
// SAFETY: c10d::Store's methods are thread-safe (torch's stores lock or talk
// to a server); shared references only call them.
unsafe impl Sync for bridge::StoreRef {}

pub use bridge::{backend_to_python, store_from_python, store_host, unformed_backend_to_python, StoreRef};

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
    fn delete(&self, key: &str) -> Result<bool> {
        bridge::store_delete(self, key).map_err(|e| Error::io(format!("store delete {key}: {e}")))
    }
}

impl Group {
    /// Rendezvous through `store` as `member` and start the group's engine.
    pub fn join(store: GroupStore, member: &Member, cfg: Config) -> Result<Group> {
        let mesh: Arc<dyn Transport> = Arc::new(connect(&store, member, &cfg)?);
        Group::over(mesh, store, cfg, member.timeout)
    }

    /// A group that sends over `transport`: connections of its own, or a
    /// channel on another group's (`Transport::open_channel`). `store` is
    /// where it was made, kept for a shrink.
    pub fn over(transport: Arc<dyn Transport>, store: GroupStore, cfg: Config, timeout: Duration) -> Result<Group> {
        let engine = Engine::new(transport, &cfg, timeout)?;
        Ok(Group {
            engine,
            cfg,
            store,
            shrinks: Default::default(),
            name: Default::default(),
            host_gates: Default::default(),
            gates: Default::default(),
            batch: Default::default(),
        })
    }
}

/// The Store a group joined through, under its namespace there: kept, so
/// that a shrink can re-form the group through it.
pub struct GroupStore {
    store: cxx::UniquePtr<StoreRef>,
    prefix: String,
}

impl GroupStore {
    pub fn new(store: cxx::UniquePtr<StoreRef>) -> Result<GroupStore> {
        if store.is_null() {
            return Err(Error::invalid("rustc10d: no Store to join through"));
        }
        Ok(GroupStore { store, prefix: String::new() })
    }

    /// Another handle on the same Store, under `namespace` within this one's.
    pub fn within(&self, namespace: &str) -> GroupStore {
        GroupStore { store: bridge::store_clone(&self.store), prefix: format!("{}{namespace}/", self.prefix) }
    }

    /// The same Store under the same namespace.
    pub fn again(&self) -> GroupStore {
        GroupStore { store: bridge::store_clone(&self.store), prefix: self.prefix.clone() }
    }

    pub fn host(&self) -> String {
        bridge::store_host(&self.store)
    }
}

impl Store for GroupStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.store.set(&format!("{}{key}", self.prefix), value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.store.get(&format!("{}{key}", self.prefix), timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.store.add(&format!("{}{key}", self.prefix), delta)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.store.delete(&format!("{}{key}", self.prefix))
    }
}

/// A process group's engine and the settings the shim asks about.
pub struct Group {
    pub engine: Engine,
    pub cfg: Config,
    /// Where it joined, for a shrink; and how many shrinks it has made.
    store: GroupStore,
    shrinks: std::sync::atomic::AtomicU64,
    /// torch's name of the group, the same on every member, once torch
    /// has given it: a shrink on shared connections names its channel after it.
    pub name: Mutex<level::GroupName, String>,
    /// Under test staging: the held stream the group's copies back run on,
    /// and its gates, made with the first staged op.
    host_gates: Mutex<level::HostGates, Option<(crate::engine::HostStream, Arc<crate::engine::StreamGates>)>>,
    /// With `cuda_wait=stream`: each CUDA device's gates, made with its first op.
    gates: Mutex<level::DeviceGates, std::collections::HashMap<i32, group::DeviceGates>>,
    /// The fences of the ops issued in the open coalescing batch.
    batch: Mutex<level::CoalescedFences, Vec<Arc<translate::Fence>>>,
}

/// A group that split, shrink or reconfigure formed, or the error it failed
/// with: cxx's `Result` would keep only its message, and the shim raises
/// the exception of its kind, as for every op.
pub struct Formed(Result<Box<Group>>);

impl Formed {
    fn failed(&self) -> bool {
        self.0.is_err()
    }

    fn error_kind(&self) -> bridge::ErrorKind {
        self.0.as_ref().err().map_or(bridge::ErrorKind::Io, |e| e.kind.into())
    }

    fn error_message(&self) -> String {
        self.0.as_ref().err().map(|e| e.message.clone()).unwrap_or_default()
    }
}

// Boxed: the shim holds a Formed only as cxx's rust::Box.
#[allow(clippy::boxed_local)]
fn formed_group(formed: Box<Formed>) -> Result<Box<Group>> {
    formed.0
}

pub struct Op {
    handle: OpHandle,
    /// Refused at once (bad input): the shim raises instead of returning a Work.
    at_issue: bool,
    /// Test staging: what `wait` and `is_done` also wait for (the op's
    /// completion, once its copies back have run; a batch's, every op's).
    fences: Vec<Arc<translate::Fence>>,
    /// How long `wait` waits for them, at most, once the op has ended.
    fence_bound: Duration,
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
            K::Resource => Self::Resource,
        }
    }
}

// The shared enums carry the core's values (checked when the shim is built).
const _: () = {
    use dtype::{DType as D, ReduceOp as R};
    use ops::OpKind as K;
    assert!(bridge::DType::Float32.repr == D::F32 as u8 && bridge::DType::Bool.repr == D::Bool as u8);
    assert!(bridge::DType::BFloat16.repr == D::BF16 as u8 && bridge::DType::Int64.repr == D::I64 as u8);
    assert!(bridge::DType::UInt16.repr == D::U16 as u8 && bridge::DType::UInt64.repr == D::U64 as u8);
    assert!(ReduceOpCode::Sum.repr == R::Sum as u8 && ReduceOpCode::BXor.repr == R::BXor as u8);
    assert!(OpKind::AllReduce.repr == K::AllReduce as u8 && OpKind::Recv.repr == K::Recv as u8);
    assert!(OpKind::AllReduceSparse.repr == K::AllReduceSparse as u8);
};
