//! The cxx bridge: the C++ shim translates tensors into `TensorDesc`s and
//! calls the engine; the engine calls back to finish ops and to use the Store.

use crate::algorithms::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::engine::{Engine, OpHandle, Waited};
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

    extern "Rust" {
        type Group;
        type Op;

        fn all_reduce(self: &Group, t: TensorDesc, op: u8, timeout_ms: i64, done: UniquePtr<Completion>) -> Result<Box<Op>>;
        fn broadcast(self: &Group, t: TensorDesc, root: i64, timeout_ms: i64, done: UniquePtr<Completion>) -> Result<Box<Op>>;
        fn barrier(self: &Group, timeout_ms: i64, done: UniquePtr<Completion>) -> Result<Box<Op>>;
        fn send(self: &Group, t: TensorDesc, dst: i64, tag: i64, timeout_ms: i64, done: UniquePtr<Completion>)
            -> Result<Box<Op>>;
        fn recv(self: &Group, t: TensorDesc, src: i64, tag: i64, timeout_ms: i64, done: UniquePtr<Completion>)
            -> Result<Box<Op>>;
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
        fn store_host(store: &StoreRef) -> String;
        fn store_from_python(pyobject: usize) -> Result<UniquePtr<StoreRef>>;
        fn complete(done: UniquePtr<Completion>, error: &str);
        fn backend_to_python(group: Box<Group>, rank: i32, size: i32, timeout_ms: i64) -> Result<usize>;
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
        bridge::store_get(self, key, timeout.as_millis() as i64).map_err(|e| Error::timeout(format!("store get {key}: {e}")))
    }
}

pub struct Group(pub Engine);
pub struct Op(OpHandle);

fn timeout(ms: i64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms as u64))
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

// Safety of the raw buffers below: the Completion owns the tensors and is
// dropped only when the engine finishes the op.
impl Group {
    fn all_reduce(&self, t: bridge::TensorDesc, op: u8, timeout_ms: i64, done: cxx::UniquePtr<bridge::Completion>) -> Result<Box<Op>> {
        let (dtype, op) = (DType::from_code(t.dtype)?, ReduceOp::from_code(op)?);
        let h = unsafe { self.0.all_reduce(buf(&t), dtype, op, timeout(timeout_ms), finish_with(done))? };
        Ok(Box::new(Op(h)))
    }

    fn broadcast(&self, t: bridge::TensorDesc, root: i64, timeout_ms: i64, done: cxx::UniquePtr<bridge::Completion>) -> Result<Box<Op>> {
        let h = unsafe { self.0.broadcast(buf(&t), rank(root, "root")?, timeout(timeout_ms), finish_with(done))? };
        Ok(Box::new(Op(h)))
    }

    fn barrier(&self, timeout_ms: i64, done: cxx::UniquePtr<bridge::Completion>) -> Result<Box<Op>> {
        Ok(Box::new(Op(self.0.barrier(timeout(timeout_ms), finish_with(done))?)))
    }

    fn send(&self, t: bridge::TensorDesc, dst: i64, tag: i64, timeout_ms: i64, done: cxx::UniquePtr<bridge::Completion>) -> Result<Box<Op>> {
        let h = unsafe { self.0.send(buf(&t), rank(dst, "destination")?, tag, timeout(timeout_ms), finish_with(done))? };
        Ok(Box::new(Op(h)))
    }

    fn recv(&self, t: bridge::TensorDesc, src: i64, tag: i64, timeout_ms: i64, done: cxx::UniquePtr<bridge::Completion>) -> Result<Box<Op>> {
        let h = unsafe { self.0.recv(buf(&t), rank(src, "source")?, tag, timeout(timeout_ms), finish_with(done))? };
        Ok(Box::new(Op(h)))
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
