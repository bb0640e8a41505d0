//! The progress engine of one process group. Collectives run one at a time on
//! a worker thread in issue order (the same order on every rank); point-to-point
//! ops go straight to the transport, so they never queue behind collectives.
//! The engine owns every op until it finishes; a handle only observes it.

use crate::algorithms::{ring_allreduce, ring_broadcast, segment_bytes, OpCtx, RawBuf, Scratch};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, ErrorKind, Result};
use crate::status::{Callback, Status};
use crate::transport::{Key, Transport};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub struct Engine {
    shared: Arc<Shared>,
    queue: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    transport: Arc<dyn Transport>,
    timeout: Duration,
    segment_bytes: usize,
    next_seq: AtomicU64,
    stopping: AtomicBool,
    /// Set by the first collective that fails: later ones fail at once with it,
    /// since the ranks can no longer be assumed to agree on the sequence.
    broken: Mutex<Option<Error>>,
}

enum Collective {
    AllReduce { buf: RawBuf, dtype: DType, op: ReduceOp },
    Broadcast { buf: RawBuf, root: usize },
    Barrier,
}

impl Collective {
    fn name(&self) -> &'static str {
        match self {
            Collective::AllReduce { .. } => "allreduce",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Barrier => "barrier",
        }
    }
}

struct Job {
    seq: u64,
    op: Collective,
    timeout: Duration,
    status: Arc<Status>,
}

/// What a Work sees of its op.
pub struct OpHandle {
    status: Arc<Status>,
    seq: u64,
    source_rank: i64,
    /// For p2p ops the waiter enforces the op's timeout (collectives enforce
    /// their own on the worker).
    expiry: Option<Expiry>,
}

struct Expiry {
    deadline: Instant,
    transport: Arc<dyn Transport>,
    peer: usize,
    recv_key: Option<Key>,
    message: String,
}

/// Outcome of `OpHandle::wait`.
#[derive(Debug, PartialEq, Eq)]
pub enum Waited {
    Done,
    Failed(String),
    /// The caller's own timeout passed; the op goes on.
    TimedOut,
}

impl Engine {
    pub fn new(transport: Arc<dyn Transport>, timeout: Duration) -> Engine {
        let shared = Arc::new(Shared {
            transport,
            timeout,
            segment_bytes: segment_bytes(),
            next_seq: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
            broken: Mutex::new(None),
        });
        let (tx, rx) = channel::<Job>();
        let s = shared.clone();
        let worker = std::thread::Builder::new()
            .name("rustc10d-engine".into())
            .spawn(move || {
                for job in rx {
                    s.run(job);
                }
            })
            .expect("spawn engine thread");
        Engine { shared, queue: Mutex::new(Some(tx)), worker: Mutex::new(Some(worker)) }
    }

    pub fn rank(&self) -> usize {
        self.shared.transport.rank()
    }

    pub fn size(&self) -> usize {
        self.shared.transport.size()
    }

    /// In-place allreduce of `buf`.
    ///
    /// # Safety
    /// `buf` must stay valid, and untouched by the caller, until `done` has run.
    pub unsafe fn all_reduce(
        &self,
        buf: RawBuf,
        dtype: DType,
        op: ReduceOp,
        timeout: Option<Duration>,
        done: Callback,
    ) -> Result<OpHandle> {
        op.check(dtype)?;
        self.check_elements(buf, dtype)?;
        self.submit(Collective::AllReduce { buf, dtype, op }, timeout, done)
    }

    /// # Safety
    /// As for `all_reduce`.
    pub unsafe fn broadcast(&self, buf: RawBuf, root: usize, timeout: Option<Duration>, done: Callback) -> Result<OpHandle> {
        self.check_rank("broadcast", "root", root)?;
        self.submit(Collective::Broadcast { buf, root }, timeout, done)
    }

    pub fn barrier(&self, timeout: Option<Duration>, done: Callback) -> Result<OpHandle> {
        self.submit(Collective::Barrier, timeout, done)
    }

    /// # Safety
    /// `buf` must stay valid and unchanged until `done` has run.
    pub unsafe fn send(&self, buf: RawBuf, dst: usize, tag: i64, timeout: Option<Duration>, done: Callback) -> Result<OpHandle> {
        self.check_peer("send", dst)?;
        let timeout = timeout.unwrap_or(self.shared.timeout);
        let t = &self.shared.transport;
        let status = Status::with_callback(done);
        let deadline = Instant::now() + timeout;
        let message = format!(
            "rustc10d: send to {} (tag {tag}) on rank {} timed out after {} ms",
            t.describe_peer(dst),
            self.rank(),
            timeout.as_millis()
        );
        t.send(dst, Key::p2p(tag), buf.ptr, buf.len, status.clone(), deadline)
            .map_err(|e| e.context(format!("rustc10d: send to rank {dst} (tag {tag}) on rank {}", self.rank())))?;
        let expiry = Expiry { deadline, transport: t.clone(), peer: dst, recv_key: None, message };
        Ok(OpHandle { status, seq: 0, source_rank: -1, expiry: Some(expiry) })
    }

    /// # Safety
    /// `buf` must stay valid, and not be read, until `done` has run.
    pub unsafe fn recv(&self, buf: RawBuf, src: usize, tag: i64, timeout: Option<Duration>, done: Callback) -> Result<OpHandle> {
        self.check_peer("recv", src)?;
        let timeout = timeout.unwrap_or(self.shared.timeout);
        let t = &self.shared.transport;
        let rank = self.rank();
        let describe = t.describe_peer(src);
        // Name the op in errors that come from the transport, too.
        let status = Status::with_callback(Box::new(move |r: &Result<i64>| match r {
            Ok(_) => done(r),
            Err(e) => done(&Err(e.clone().context(format!("rustc10d: recv from {describe} (tag {tag}) on rank {rank}")))),
        }));
        let message = format!(
            "rustc10d: recv from {} (tag {tag}) on rank {rank} timed out after {} ms waiting for data",
            t.describe_peer(src),
            timeout.as_millis()
        );
        let key = Key::p2p(tag);
        t.recv(src, key, buf.ptr, buf.len, status.clone())?;
        let expiry = Expiry { deadline: Instant::now() + timeout, transport: t.clone(), peer: src, recv_key: Some(key), message };
        Ok(OpHandle { status, seq: 0, source_rank: src as i64, expiry: Some(expiry) })
    }

    /// Fail what is pending, close connections, stop the worker. Idempotent.
    pub fn shutdown(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.transport.shutdown();
        drop(self.queue.lock().unwrap().take());
        if let Some(w) = self.worker.lock().unwrap().take() {
            let _ = w.join();
        }
    }

    fn submit(&self, op: Collective, timeout: Option<Duration>, done: Callback) -> Result<OpHandle> {
        let queue = self.queue.lock().unwrap();
        let Some(tx) = queue.as_ref() else {
            return Err(Error::aborted(format!("rustc10d: {} after the process group was shut down", op.name())));
        };
        let seq = self.shared.next_seq.fetch_add(1, Ordering::SeqCst);
        let status = Status::with_callback(done);
        let job = Job { seq, op, timeout: timeout.unwrap_or(self.shared.timeout), status: status.clone() };
        if let Err(e) = tx.send(job) {
            e.0.status.finish(Err(Error::aborted("rustc10d: the engine has stopped")));
        }
        Ok(OpHandle { status, seq, source_rank: -1, expiry: None })
    }

    fn check_elements(&self, buf: RawBuf, dtype: DType) -> Result<()> {
        if buf.len % dtype.size() != 0 {
            return Err(Error::invalid(format!("rustc10d: {} bytes is not a whole number of {} elements", buf.len, dtype.torch_name())));
        }
        Ok(())
    }

    fn check_rank(&self, op: &str, what: &str, r: usize) -> Result<()> {
        if r >= self.size() {
            return Err(Error::invalid(format!("rustc10d: {op}: {what} rank {r} is out of range for a group of size {}", self.size())));
        }
        Ok(())
    }

    fn check_peer(&self, op: &str, peer: usize) -> Result<()> {
        self.check_rank(op, "peer", peer)?;
        if peer == self.rank() {
            return Err(Error::unsupported(format!("rustc10d: {op} to or from the own rank ({peer}) is not supported")));
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Shared {
    fn run(&self, job: Job) {
        let what = format!("{} #{} on rank {}", job.op.name(), job.seq, self.transport.rank());
        let broken = self.broken.lock().unwrap().clone();
        let result = if self.stopping.load(Ordering::SeqCst) {
            Err(Error::aborted(format!("rustc10d: {what} was cancelled: the process group was shut down")))
        } else if let Some(cause) = broken {
            Err(Error::new(cause.kind, format!("rustc10d: {what} cannot run: the process group is broken by an earlier failure: {}", cause.message)))
        } else {
            let ctx = OpCtx { transport: &*self.transport, seq: job.seq, timeout: job.timeout, what: what.clone(), segment_bytes: self.segment_bytes };
            let r = execute(&ctx, &job.op);
            if let Err(e) = &r {
                if !matches!(e.kind, ErrorKind::InvalidArgument | ErrorKind::Unsupported) {
                    self.break_group(e);
                }
            }
            r
        };
        job.status.finish(result.map(|()| 0));
    }
}

impl Shared {
    /// A collective failed: the ranks no longer agree on where they are. Close
    /// every connection so that peers blocked in this or later collectives
    /// fail within moments instead of at their timeout; the failure spreads
    /// around the ring the same way.
    fn break_group(&self, cause: &Error) {
        self.broken.lock().unwrap().get_or_insert_with(|| cause.clone());
        let me = self.transport.rank();
        for peer in (0..self.transport.size()).filter(|&p| p != me) {
            self.transport.break_peer(peer, cause);
        }
    }
}

fn execute(ctx: &OpCtx, op: &Collective) -> Result<()> {
    match *op {
        Collective::AllReduce { buf, dtype, op } => ring_allreduce(ctx, buf, dtype, op),
        Collective::Broadcast { buf, root } => ring_broadcast(ctx, buf, root),
        // An allreduce of one byte: nobody finishes before everybody has arrived.
        Collective::Barrier => {
            let mut one = Scratch::new(1);
            let buf = RawBuf { ptr: one.raw().ptr, len: 1 };
            ring_allreduce(ctx, buf, DType::U8, ReduceOp::BOr)
        }
    }
}

impl OpHandle {
    pub fn is_done(&self) -> bool {
        self.status.is_done()
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    pub fn source_rank(&self) -> i64 {
        self.source_rank
    }

    /// The op's error, once it has failed.
    pub fn error(&self) -> Option<Error> {
        self.status.result().and_then(|r| r.err())
    }

    /// Block until the op finishes or `timeout` (None: the op's own bound) passes.
    pub fn wait(&self, timeout: Option<Duration>) -> Waited {
        let mine = timeout.map(|t| Instant::now() + t);
        let bound = match (&self.expiry, mine) {
            (Some(e), Some(m)) => Some(e.deadline.min(m)),
            (Some(e), None) => Some(e.deadline),
            (None, m) => m,
        };
        let outcome = |r: Result<i64>| match r {
            Ok(_) => Waited::Done,
            Err(e) => Waited::Failed(e.message),
        };
        if let Some(r) = self.status.wait(bound) {
            return outcome(r);
        }
        match &self.expiry {
            Some(e) if Instant::now() >= e.deadline => {
                self.expire(e);
                outcome(self.status.wait(None).expect("finished"))
            }
            _ => Waited::TimedOut,
        }
    }

    /// The op ran past its timeout: withdraw it, or break the connection that holds it.
    fn expire(&self, e: &Expiry) {
        let err = Error::timeout(e.message.clone());
        if let Some(key) = e.recv_key {
            if e.transport.cancel_recv(e.peer, key, &self.status) {
                self.status.finish(Err(err));
                return;
            }
        }
        if self.status.wait(Some(Instant::now() + Duration::from_millis(200))).is_none() {
            e.transport.break_peer(e.peer, &err);
        }
    }
}
