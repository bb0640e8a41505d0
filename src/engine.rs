//! The progress engine of one process group. Collectives run one at a time on
//! a worker thread in issue order (the same order on every rank); point-to-point
//! ops go straight to the transport, so they never queue behind collectives.
//! The engine owns every op until it finishes; a handle only observes it.

use crate::algorithms::{
    copy_buf, direct_allreduce, direct_gather, direct_scatter, monitored_barrier, pairwise_alltoall, prefers_direct,
    ring_allgather, ring_allreduce, ring_broadcast, ring_reduce, ring_reduce_scatter, segment_bytes,
    small_allreduce_bytes, OpCtx, RawBuf, Scratch, ScratchPool,
};
use crate::call_check::{agree, Fingerprint};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, ErrorKind, Result};
use crate::fault::{Action, Faults, ENV_FAULT};
use crate::reduce::scale;
use crate::stats::Stats;
use crate::status::{Callback, Status};
use crate::transport::{Key, Ready, Transport};
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
    timeout_ms: AtomicU64,
    segment_bytes: usize,
    small_allreduce_bytes: usize,
    next_seq: AtomicU64,
    stopping: AtomicBool,
    /// Set by the first collective that fails: later ones fail at once with it,
    /// since the ranks can no longer be assumed to agree on the sequence.
    broken: Mutex<Option<Error>>,
    faults: Faults,
    stats: Arc<Stats>,
    pool: ScratchPool,
    sends: AtomicU64,
    recvs: AtomicU64,
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
    Broadcast {
        buf: RawBuf,
        root: usize,
    },
    /// `outputs[i]` receives rank i's input; sizes may differ per rank.
    AllGather {
        input: RawBuf,
        outputs: Vec<RawBuf>,
    },
    /// `outputs` only at the root.
    Gather {
        input: RawBuf,
        outputs: Vec<RawBuf>,
        root: usize,
    },
    /// `inputs` only at the root.
    Scatter {
        inputs: Vec<RawBuf>,
        output: RawBuf,
        root: usize,
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
    },
    Barrier,
    /// `timeout`: how long rank 0 waits for the others (None: the op's).
    MonitoredBarrier {
        wait_all: bool,
        timeout: Option<Duration>,
    },
}

impl Collective {
    fn name(&self) -> &'static str {
        match self {
            Collective::AllReduce { .. } => "allreduce",
            Collective::Reduce { .. } => "reduce",
            Collective::Broadcast { .. } => "broadcast",
            Collective::AllGather { .. } => "allgather",
            Collective::Gather { .. } => "gather",
            Collective::Scatter { .. } => "scatter",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::AllToAll { .. } => "alltoall",
            Collective::Barrier => "barrier",
            Collective::MonitoredBarrier { .. } => "monitored_barrier",
        }
    }

    /// The one buffer of an op that can run piece by piece, each piece a
    /// smaller op of the same kind: elementwise all-reduces and broadcasts.
    fn piece_buffer(&self) -> Option<RawBuf> {
        match self {
            Collective::AllReduce { buf, .. } | Collective::Broadcast { buf, .. } => Some(*buf),
            _ => None,
        }
    }

    /// `want` rounded down to whole elements, if this op is worth cutting
    /// into pieces of that size (0: never).
    fn piece_bytes(&self, want: usize) -> Option<usize> {
        let unit = match self {
            Collective::AllReduce { red, .. } => red.dtype.size(),
            _ => 1,
        };
        let bytes = want / unit * unit;
        let buf = self.piece_buffer()?;
        (bytes > 0 && buf.len > bytes).then_some(bytes)
    }

    /// Bytes [start, start + len) of `piece_buffer`, as an op of its own.
    fn piece(&self, start: usize, len: usize) -> Collective {
        let sub = |b: &RawBuf| {
            assert!(start + len <= b.len);
            RawBuf::new(unsafe { b.ptr.add(start) }, len)
        };
        match self {
            Collective::AllReduce { buf, red } => Collective::AllReduce { buf: sub(buf), red: *red },
            Collective::Broadcast { buf, root } => Collective::Broadcast { buf: sub(buf), root: *root },
            _ => unreachable!("only ops with a piece_buffer run in pieces"),
        }
    }

    /// Refuse what cannot work before anything goes on the wire.
    fn check(&self, rank: usize, world: usize) -> Result<()> {
        let name = self.name();
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
            Collective::AllGather { input, outputs } => {
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
            Collective::Gather { input, outputs, root } => {
                root_ok(*root)?;
                if rank == *root {
                    blocks("outputs", outputs, input.len)
                } else {
                    Ok(())
                }
            }
            Collective::Scatter { inputs, output, root } => {
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
            Collective::AllToAll { inputs, outputs } => {
                if inputs.len() != world || outputs.len() != world {
                    return bad(format!(
                        "expected {world} input and output blocks, got {} and {}",
                        inputs.len(),
                        outputs.len()
                    ));
                }
                Ok(())
            }
            Collective::Barrier | Collective::MonitoredBarrier { .. } => Ok(()),
        }
    }

    /// How this rank was called, for `call_check::agree`.
    fn fingerprint(&self) -> Fingerprint {
        const NONE: u8 = Fingerprint::NONE;
        let reduce = |red: &Reduction| if red.premul.is_some() { 8 } else { red.op as u8 };
        let total = |bufs: &[RawBuf]| bufs.iter().map(|b| b.len as u64).sum::<u64>();
        let (dtype, op, root, bytes) = match self {
            Collective::AllReduce { buf, red } => (red.dtype as u8, reduce(red), None, buf.len as u64),
            Collective::Reduce { buf, root, red } => (red.dtype as u8, reduce(red), Some(*root), buf.len as u64),
            Collective::Broadcast { buf, root } => (NONE, NONE, Some(*root), buf.len as u64),
            Collective::AllGather { outputs, .. } => (NONE, NONE, None, total(outputs)),
            Collective::Gather { input, root, .. } => (NONE, NONE, Some(*root), input.len as u64),
            Collective::Scatter { output, root, .. } => (NONE, NONE, Some(*root), output.len as u64),
            Collective::ReduceScatter { output, red, .. } => (red.dtype as u8, reduce(red), None, output.len as u64),
            // Block sizes legitimately differ per rank.
            Collective::AllToAll { .. } => (NONE, NONE, None, 0),
            Collective::Barrier | Collective::MonitoredBarrier { .. } => (NONE, NONE, None, 0),
        };
        Fingerprint { op: self.name(), dtype, reduce: op, root: root.map_or(u32::MAX, |r| r as u32), bytes, piece: 0 }
    }

    /// A failed monitored barrier only reports who is missing; anything else
    /// leaves the ranks out of step.
    fn failure_breaks_group(&self) -> bool {
        !matches!(self, Collective::MonitoredBarrier { .. })
    }
}

struct Job {
    /// Parts run in order; part i has sequence number first_seq + i.
    first_seq: u64,
    parts: Vec<Collective>,
    timeout: Duration,
    staging: Option<Box<dyn Staging>>,
    status: Arc<Status>,
}

/// Moves a job's tensors between the device and the host buffers the engine
/// works on (the shim's CUDA staging, in stream order). Called on the engine
/// thread: either `all_in` before the parts, or, for one large all_reduce or
/// broadcast, `start_pieces` and then `piece_in`/`piece_out` around each
/// piece, so that the device copies of one piece overlap the network
/// transfer of another.
pub trait Staging: Send {
    /// Bring every input to the host before the op runs.
    fn all_in(&mut self) -> Result<()>;
    /// The piece size this staging would like (0: no pieces).
    fn piece_bytes(&self) -> usize;
    /// Start bringing the op's one buffer to the host in pieces of `bytes`;
    /// false if the op cannot be staged that way (then `all_in` follows).
    fn start_pieces(&mut self, bytes: usize) -> Result<bool>;
    /// Piece `i` is on the host once this returns.
    fn piece_in(&mut self, i: usize) -> Result<()>;
    /// Piece `i` holds its result: start copying it back.
    fn piece_out(&mut self, i: usize) -> Result<()>;
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

/// `OpHandle::source_rank` of an any-source receive before it has matched.
const ANY_SOURCE: i64 = -2;

struct Expiry {
    deadline: Instant,
    transport: Arc<dyn Transport>,
    /// None for an any-source receive.
    peer: Option<usize>,
    recv_key: Option<Key>,
    /// The op's error when it expires.
    timed_out: Error,
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
    /// An engine over `transport`, with faults from `RUSTC10D_FAULT`.
    pub fn new(transport: Arc<dyn Transport>, timeout: Duration) -> Result<Engine> {
        Ok(Engine::with_faults(transport, timeout, Faults::from_env()?))
    }

    pub fn with_faults(transport: Arc<dyn Transport>, timeout: Duration, faults: Faults) -> Engine {
        let shared = Arc::new(Shared {
            transport,
            timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
            segment_bytes: segment_bytes(),
            small_allreduce_bytes: small_allreduce_bytes(),
            next_seq: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
            broken: Mutex::new(None),
            faults,
            stats: Arc::default(),
            pool: ScratchPool::default(),
            sends: AtomicU64::new(0),
            recvs: AtomicU64::new(0),
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

    /// The group's per-op counters.
    pub fn stats(&self) -> Arc<Stats> {
        self.shared.stats.clone()
    }

    /// How bytes reach `peer` ("shm" or "tcp"), once connected.
    pub fn link_kind(&self, peer: usize) -> Option<&'static str> {
        self.shared.transport.link_kind(peer)
    }

    pub fn rank(&self) -> usize {
        self.shared.transport.rank()
    }

    pub fn size(&self) -> usize {
        self.shared.transport.size()
    }

    /// Queue collectives that run back to back as one op (several parts for
    /// the coalesced variants); `done` runs once all have finished.
    ///
    /// # Safety
    /// Every buffer must stay valid until `done` has run; the caller must not
    /// touch output buffers, nor change input buffers, before that.
    pub unsafe fn submit(&self, parts: Vec<Collective>, timeout: Option<Duration>, done: Callback) -> Result<OpHandle> {
        self.submit_staged(parts, timeout, None, done)
    }

    /// `submit`, with `staging` moving the buffers' contents in and out on
    /// the engine thread; if it fails, the job fails and the group breaks
    /// (the peers are in the op).
    ///
    /// # Safety
    /// As for `submit`; the contents need to be valid only once `staging` has
    /// brought them in.
    pub unsafe fn submit_staged(
        &self,
        parts: Vec<Collective>,
        timeout: Option<Duration>,
        staging: Option<Box<dyn Staging>>,
        done: Callback,
    ) -> Result<OpHandle> {
        let (rank, world) = (self.rank(), self.size());
        parts.iter().try_for_each(|p| p.check(rank, world))?;
        let queue = self.queue.lock().unwrap();
        let Some(tx) = queue.as_ref() else {
            return Err(Error::aborted("rustc10d: the process group was shut down"));
        };
        let first_seq = self.shared.next_seq.fetch_add(parts.len().max(1) as u64, Ordering::SeqCst);
        let status = Status::with_callback(done);
        let timeout = timeout.unwrap_or_else(|| self.shared.timeout());
        let job = Job { first_seq, parts, timeout, staging, status: status.clone() };
        if let Err(e) = tx.send(job) {
            e.0.status.finish(Err(Error::aborted("rustc10d: the engine has stopped")));
        }
        Ok(OpHandle { status, seq: first_seq, source_rank: -1, expiry: None })
    }

    /// Collectives issued so far (the group's sequence number).
    pub fn sequence_number(&self) -> u64 {
        self.shared.next_seq.load(Ordering::SeqCst)
    }

    /// The default timeout of later ops.
    pub fn set_timeout(&self, timeout: Duration) {
        self.shared.timeout_ms.store(timeout.as_millis() as u64, Ordering::SeqCst);
    }

    /// # Safety
    /// `buf` must stay valid and unchanged until `done` has run.
    pub unsafe fn send(
        &self,
        buf: RawBuf,
        dst: usize,
        tag: i64,
        timeout: Option<Duration>,
        done: Callback,
    ) -> Result<OpHandle> {
        self.send_with(buf, dst, tag, timeout, None, done)
    }

    /// `send` of a buffer that `ready` fills (a device tensor's copy to the
    /// host): it runs on the sending thread, so the caller does not wait.
    ///
    /// # Safety
    /// As for `send`, from the time `ready` returns.
    pub unsafe fn send_after(
        &self,
        buf: RawBuf,
        dst: usize,
        tag: i64,
        timeout: Option<Duration>,
        ready: Ready,
        done: Callback,
    ) -> Result<OpHandle> {
        self.send_with(buf, dst, tag, timeout, Some(ready), done)
    }

    unsafe fn send_with(
        &self,
        buf: RawBuf,
        dst: usize,
        tag: i64,
        timeout: Option<Duration>,
        ready: Option<Ready>,
        done: Callback,
    ) -> Result<OpHandle> {
        self.check_peer("send", dst)?;
        let seq = self.shared.sends.fetch_add(1, Ordering::SeqCst);
        self.shared.p2p_fault("send", seq, dst)?;
        let timeout = timeout.unwrap_or_else(|| self.shared.timeout());
        let t = &self.shared.transport;
        let status = Status::with_callback(self.shared.recorded("send", buf.len, done));
        let deadline = Instant::now() + timeout;
        let op = format!("send #{seq} to {} (tag {tag}) on rank {}", t.describe_peer(dst), self.rank());
        let timed_out = Error::timed_out(timeout, format_args!("{op} was still waiting to write its data"));
        t.send(dst, Key::p2p(tag), buf.ptr, buf.len, status.clone(), deadline, ready)
            .map_err(|e| e.context(format_args!("rustc10d: {op}")))?;
        let expiry = Expiry { deadline, transport: t.clone(), peer: Some(dst), recv_key: None, timed_out };
        Ok(OpHandle { status, seq, source_rank: -1, expiry: Some(expiry) })
    }

    /// Receive from `src`, or from whichever peer sends first when `src` is None.
    ///
    /// # Safety
    /// `buf` must stay valid, and not be read, until `done` has run.
    pub unsafe fn recv(
        &self,
        buf: RawBuf,
        src: Option<usize>,
        tag: i64,
        timeout: Option<Duration>,
        done: Callback,
    ) -> Result<OpHandle> {
        if let Some(src) = src {
            self.check_peer("recv", src)?;
        }
        let seq = self.shared.recvs.fetch_add(1, Ordering::SeqCst);
        self.shared.p2p_fault("recv", seq, src.unwrap_or(usize::MAX))?;
        let done = self.shared.recorded("recv", buf.len, done);
        let timeout = timeout.unwrap_or_else(|| self.shared.timeout());
        let t = &self.shared.transport;
        let rank = self.rank();
        let from = src.map_or_else(|| "any rank".to_string(), |s| t.describe_peer(s));
        let op = format!("recv #{seq} from {from} (tag {tag}) on rank {rank}");
        let timed_out = Error::timed_out(timeout, format_args!("{op} was waiting for data"));
        let what = format!("rustc10d: {op}");
        // Name the op in errors that come from the transport, too.
        let status = Status::with_callback(Box::new(move |r: &Result<i64>| match r {
            Ok(_) => done(r),
            Err(e) => done(&Err(e.clone().context(&what))),
        }));
        let key = Key::p2p(tag);
        match src {
            Some(src) => t.recv(src, key, buf.ptr, buf.len, None, status.clone())?,
            None => t.recv_any(key, buf.ptr, buf.len, status.clone())?,
        }
        let expiry = Expiry {
            deadline: Instant::now() + timeout,
            transport: t.clone(),
            peer: src,
            recv_key: Some(key),
            timed_out,
        };
        Ok(OpHandle { status, seq, source_rank: src.map_or(ANY_SOURCE, |s| s as i64), expiry: Some(expiry) })
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

    fn check_rank(&self, op: &str, what: &str, r: usize) -> Result<()> {
        if r >= self.size() {
            return Err(Error::invalid(format!(
                "rustc10d: {op}: {what} rank {r} is out of range for a group of size {}",
                self.size()
            )));
        }
        Ok(())
    }

    fn check_peer(&self, op: &str, peer: usize) -> Result<()> {
        self.check_rank(op, "peer", peer)?;
        if peer == self.rank() {
            return Err(Error::unsupported(format!(
                "rustc10d: {op} to or from the own rank ({peer}) is not supported"
            )));
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
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::SeqCst))
    }

    fn run(&self, mut job: Job) {
        let pieces = match job.staging.as_deref_mut().map(|s| stage(&job.parts, s)).transpose() {
            Ok(pieces) => pieces.flatten(),
            Err(e) => {
                let name = job.parts.first().map_or("op", |p| p.name());
                let e = Error::new(
                    e.kind,
                    format!(
                        "rustc10d: {name} #{} on rank {} could not stage its tensors: {}",
                        job.first_seq,
                        self.transport.rank(),
                        e.message
                    ),
                );
                self.break_group(&e);
                job.status.finish(Err(e));
                return;
            }
        };
        let result = match (pieces, job.staging.as_deref_mut()) {
            (Some(bytes), Some(staging)) => {
                self.run_part(job.first_seq, &job.parts[0], job.timeout, Some(Pieces { bytes, staging }))
            }
            _ => job
                .parts
                .iter()
                .enumerate()
                .try_for_each(|(i, part)| self.run_part(job.first_seq + i as u64, part, job.timeout, None)),
        };
        job.status.finish(result.map(|()| 0));
    }

    fn run_part(&self, seq: u64, part: &Collective, timeout: Duration, pieces: Option<Pieces>) -> Result<()> {
        let what = format!("{} #{seq} on rank {}", part.name(), self.transport.rank());
        if self.stopping.load(Ordering::SeqCst) {
            return Err(Error::aborted(format!("rustc10d: {what} was cancelled: the process group was shut down")));
        }
        let broken = self.broken.lock().unwrap().clone();
        if let Some(cause) = broken {
            return Err(Error::new(
                cause.kind,
                format!(
                    "rustc10d: {what} cannot run: the process group is broken by an earlier failure: {}",
                    cause.message
                ),
            ));
        }
        let start = Instant::now();
        let fingerprint = Fingerprint { piece: pieces.as_ref().map_or(0, |p| p.bytes as u64), ..part.fingerprint() };
        let ctx = OpCtx {
            transport: &*self.transport,
            seq,
            timeout,
            what,
            segment_bytes: self.segment_bytes,
            small_allreduce_bytes: self.small_allreduce_bytes,
            pool: &self.pool,
            piece: 0,
        };
        // The smallest all-reduces (and barriers) check the call alongside
        // their one exchange; PREMUL_SUM scales the caller's buffer first, so
        // it checks before, as does an op run in pieces.
        let check_inline = pieces.is_none()
            && match part {
                Collective::AllReduce { buf, red } => {
                    red.premul.is_none() && prefers_direct(buf.len, ctx.transport.size(), ctx.small_allreduce_bytes)
                }
                Collective::Barrier => prefers_direct(1, ctx.transport.size(), ctx.small_allreduce_bytes),
                _ => false,
            };
        let r = match self.faults.hit(self.transport.rank(), part.name(), seq) {
            // An injected failure behaves like a real one: the group breaks.
            Some(Action::Fail) => {
                Err(Error::io(format!("rustc10d: {} failed: fault injected by {ENV_FAULT}", ctx.what)))
            }
            fault => {
                match fault {
                    Some(Action::Stall(d)) => std::thread::sleep(d),
                    Some(Action::Drop) => self.drop_all(&format!("connections dropped by {ENV_FAULT}")),
                    _ => {}
                }
                // A monitored barrier exists to name missing ranks: no neighbour check first.
                let checked = match part {
                    Collective::MonitoredBarrier { .. } => Ok(()),
                    _ if check_inline => Ok(()),
                    _ => agree(&ctx, &fingerprint),
                };
                let inline = check_inline.then_some(&fingerprint);
                // A bug must not leave the op's Work waiting forever: it fails
                // the op (and breaks the group) like any other failure.
                checked.and_then(|()| {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match pieces {
                        Some(pieces) => execute_in_pieces(&ctx, part, pieces),
                        None => execute(&ctx, part, inline),
                    }))
                    .unwrap_or_else(|panic| {
                        let why = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned());
                        Err(Error::io(format!(
                            "rustc10d: {} hit an internal error: {}",
                            ctx.what,
                            why.unwrap_or_default()
                        )))
                    })
                })
            }
        };
        self.stats.record(part.name(), fingerprint.bytes, start.elapsed(), r.is_ok());
        if let Err(e) = &r {
            if part.failure_breaks_group() && !matches!(e.kind, ErrorKind::InvalidArgument | ErrorKind::Unsupported) {
                self.break_group(e);
            }
        }
        r
    }
}

impl Shared {
    fn drop_all(&self, why: &str) {
        let me = self.transport.rank();
        for peer in (0..self.transport.size()).filter(|&p| p != me) {
            self.transport.break_peer(peer, &Error::peer_lost(why.to_string()));
        }
    }

    /// Apply a RUSTC10D_FAULT rule to a send or receive (`peer` MAX: any source).
    fn p2p_fault(&self, op: &'static str, seq: u64, peer: usize) -> Result<()> {
        match self.faults.hit(self.transport.rank(), op, seq) {
            Some(Action::Fail) => {
                Err(Error::io(format!("rustc10d: {op} #{seq} failed: fault injected by {ENV_FAULT}")))
            }
            Some(Action::Stall(d)) => {
                std::thread::sleep(d);
                Ok(())
            }
            Some(Action::Drop) if peer < self.transport.size() => {
                self.transport
                    .break_peer(peer, &Error::peer_lost(format!("{op} #{seq}: connection dropped by {ENV_FAULT}")));
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Wrap a p2p op's callback so that its completion is counted.
    fn recorded(&self, op: &'static str, bytes: usize, done: Callback) -> Callback {
        let (stats, start) = (self.stats.clone(), Instant::now());
        Box::new(move |r: &Result<i64>| {
            stats.record(op, bytes as u64, start.elapsed(), r.is_ok());
            done(r)
        })
    }

    /// A collective failed: the ranks no longer agree on where they are. Close
    /// every connection so that peers blocked in this or later collectives
    /// fail within moments instead of at their timeout; the failure spreads
    /// around the ring the same way.
    fn break_group(&self, cause: &Error) {
        self.broken.lock().unwrap().get_or_insert_with(|| cause.clone());
        self.transport.abort_all(cause);
    }
}

/// `check`: the call's fingerprint, when the op checks it alongside its
/// exchange rather than before (see run_part).
fn execute(ctx: &OpCtx, part: &Collective, check: Option<&Fingerprint>) -> Result<()> {
    match part {
        Collective::AllReduce { buf, red } => {
            let op = premultiply(buf, red);
            all_reduce(ctx, *buf, red.dtype, op, check)
        }
        Collective::Reduce { buf, root, red } if ctx.transport.rank() == *root => {
            let op = premultiply(buf, red);
            ring_reduce(ctx, *buf, *root, red.dtype, op)
        }
        Collective::Reduce { buf, root, red } => {
            // Not the root: the caller's buffer must stay as it was.
            let mut copy = Scratch::new(0);
            let input = premultiplied_copies(&mut copy, ctx, std::slice::from_ref(buf), red);
            ring_reduce(ctx, input[0], *root, red.dtype, red.op)
        }
        Collective::Broadcast { buf, root } => ring_broadcast(ctx, *buf, *root),
        Collective::AllGather { input, outputs } => ring_allgather(ctx, *input, outputs),
        Collective::Gather { input, outputs, root } => direct_gather(ctx, *input, outputs, *root),
        Collective::Scatter { inputs, output, root } => direct_scatter(ctx, inputs, *output, *root),
        Collective::ReduceScatter { inputs, output, red } => {
            let mut copy = Scratch::new(0);
            let inputs = premultiplied_copies(&mut copy, ctx, inputs, red);
            ring_reduce_scatter(ctx, &inputs, *output, red.dtype, red.op)
        }
        Collective::AllToAll { inputs, outputs } => pairwise_alltoall(ctx, inputs, outputs),
        // An allreduce of one byte: nobody finishes before everybody has arrived.
        Collective::Barrier => {
            let mut one = Scratch::new(1);
            let buf = RawBuf { ptr: one.raw().ptr, len: 1 };
            all_reduce(ctx, buf, DType::U8, ReduceOp::BOr, check)
        }
        Collective::MonitoredBarrier { wait_all, timeout } => {
            monitored_barrier(ctx, *wait_all, timeout.unwrap_or(ctx.timeout))
        }
    }
}

/// Bring a job's inputs to the host: in pieces of the returned size where
/// its one op can run so, else whole (None).
fn stage(parts: &[Collective], staging: &mut dyn Staging) -> Result<Option<usize>> {
    if let [part] = parts {
        if let Some(bytes) = part.piece_bytes(staging.piece_bytes()) {
            if staging.start_pieces(bytes)? {
                return Ok(Some(bytes));
            }
        }
    }
    staging.all_in().map(|()| None)
}

/// A staged op run piece by piece (see `Staging`).
struct Pieces<'a> {
    bytes: usize,
    staging: &'a mut dyn Staging,
}

/// Each piece is a whole collective of its own (keys of its own, same
/// sequence number), run after its bytes are on the host; its result is
/// copied back while the next piece runs. The call was checked once for all.
fn execute_in_pieces(ctx: &OpCtx, part: &Collective, pieces: Pieces) -> Result<()> {
    let Pieces { bytes, staging } = pieces;
    let deadline = Instant::now() + ctx.timeout;
    let len = part.piece_buffer().map_or(0, |b| b.len);
    for (i, start) in (0..len).step_by(bytes).enumerate() {
        staging.piece_in(i).map_err(|e| e.context(&ctx.what))?;
        let piece_ctx = OpCtx {
            timeout: deadline.saturating_duration_since(Instant::now()),
            what: format!("{} (piece {i})", ctx.what),
            piece: i as u64,
            ..*ctx
        };
        execute(&piece_ctx, &part.piece(start, bytes.min(len - start)), None)?;
        staging.piece_out(i).map_err(|e| e.context(&ctx.what))?;
    }
    Ok(())
}

/// Small messages: one direct exchange; large ones: the bandwidth-optimal ring.
fn all_reduce(ctx: &OpCtx, buf: RawBuf, dtype: DType, op: ReduceOp, check: Option<&Fingerprint>) -> Result<()> {
    if prefers_direct(buf.len, ctx.transport.size(), ctx.small_allreduce_bytes) {
        direct_allreduce(ctx, buf, dtype, op, check)
    } else {
        debug_assert!(check.is_none(), "the ring checks the call before it starts");
        ring_allreduce(ctx, buf, dtype, op)
    }
}

/// PREMUL_SUM on a buffer the op overwrites anyway: scale it in place, then sum.
fn premultiply(buf: &RawBuf, red: &Reduction) -> ReduceOp {
    if let Some(f) = red.premul {
        scale(red.dtype, unsafe { buf.slice_mut(0, buf.len) }, f);
    }
    red.op
}

/// PREMUL_SUM on inputs the caller keeps: scaled copies of `blocks` in `scratch`
/// (taken from the pool here); without PREMUL_SUM the blocks themselves.
fn premultiplied_copies<'a>(
    scratch: &mut Scratch<'a>,
    ctx: &OpCtx<'a>,
    blocks: &[RawBuf],
    red: &Reduction,
) -> Vec<RawBuf> {
    let Some(factor) = red.premul else { return blocks.to_vec() };
    *scratch = ctx.scratch(blocks.iter().map(|b| b.len).sum());
    let mut at = scratch.raw().ptr;
    blocks
        .iter()
        .map(|b| {
            let dst = RawBuf::new(at, b.len);
            unsafe {
                copy_buf(dst, *b);
                scale(red.dtype, dst.slice_mut(0, dst.len), factor);
                at = at.add(b.len);
            }
            dst
        })
        .collect()
}

impl OpHandle {
    pub fn is_done(&self) -> bool {
        self.status.is_done()
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The peer of a send or receive (-1 for collectives); for an any-source
    /// receive, the sender once it has matched.
    pub fn source_rank(&self) -> i64 {
        match (self.source_rank, self.status.result()) {
            (ANY_SOURCE, Some(Ok(peer))) => peer,
            (r, _) => r,
        }
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
        let err = e.timed_out.clone();
        let cancelled = match (e.recv_key, e.peer) {
            (Some(key), Some(peer)) => e.transport.cancel_recv(peer, key, &self.status),
            (Some(key), None) => e.transport.cancel_recv_any(key, &self.status),
            (None, _) => false,
        };
        if cancelled {
            self.status.finish(Err(err));
            return;
        }
        // Being filled or written right now: give it a moment, then cut the link.
        if self.status.wait(Some(Instant::now() + Duration::from_millis(200))).is_none() {
            if let Some(peer) = e.peer {
                e.transport.break_peer(peer, &err);
            }
        }
    }
}
