//! The progress engine of one process group: it orders ops and owns them
//! until they finish. Collectives run one at a time in issue order (the same
//! order on every rank; job.rs): on the group's worker thread, or, for an op
//! whose caller waits for it at once and finds the engine idle, on the
//! caller's own thread (`run_now`: no hand-off to a thread and back, which
//! is most of a small op's time); point-to-point ops go
//! straight to the transport, so they never queue behind collectives
//! (p2p.rs). A handle only observes its op (handle.rs). Which algorithm runs
//! a collective is `algorithms::run`'s business, moving device tensors in
//! and out staging.rs's.

mod apart;
mod gates;
mod handle;
mod host_stream;
mod job;
pub mod lend;
mod p2p;
mod staging;

pub use gates::{Expire, GateWord, GatedOp, HeldCopies, Restore, StreamGates, Tickets};
pub use handle::{OpHandle, Waited};
pub use host_stream::{AfterCopies, HostHeld, HostStream};
pub use staging::{run_in_pieces, Device, Event, Gates, StagedBuffer, Staging};

use crate::algorithms::ScratchPool;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::fault::Faults;
use crate::locks::{level, Mutex, MutexGuard};
use crate::ops::{Collective, OpKind};
use crate::panics;
use crate::stats::Stats;
use crate::status::{Finisher, Status};
use crate::transport::Transport;
use job::Job;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub struct Engine {
    shared: Arc<Shared>,
    queue: Mutex<level::EngineQueue, Option<Sender<Job>>>,
    worker: Mutex<level::EngineWorker, Option<JoinHandle<()>>>,
    /// Between start_coalescing and end_coalescing: the ops issued meanwhile.
    coalescing: Mutex<level::Coalescing, Option<Vec<Arc<Status>>>>,
    /// Whether `coalescing` holds a batch, set under its lock: what every op
    /// run on its caller's thread asks, without that lock's cache line.
    coalescing_open: AtomicBool,
}

struct Shared {
    transport: Arc<dyn Transport>,
    timeout_ms: AtomicU64,
    segment_bytes: usize,
    small_allreduce_bytes: usize,
    spin: Duration,
    sync_spin: Duration,
    next_seq: AtomicU64,
    /// Every collective below this sequence number has finished here, its
    /// sends all made: what a peer may still take once this rank leaves.
    done_below: AtomicU64,
    stopping: AtomicBool,
    /// Jobs handed to the worker and not yet finished.
    queued: AtomicU64,
    /// Held by whoever runs a job, the worker or a caller (`run_now`), so
    /// that jobs run one at a time. A job's completion may issue the next
    /// op under it, so that op only tries it (`turn_here`).
    running: Mutex<level::EngineTurn, ()>,
    /// Set by the first collective that fails: later ones fail at once with it,
    /// since the ranks can no longer be assumed to agree on the sequence.
    broken: Mutex<level::EngineBroken, Option<Error>>,
    /// Whether `broken` holds a cause (set after it, under its lock): every
    /// op asks, almost always of a group that is not, and learns it here
    /// without that lock's cache line.
    is_broken: AtomicBool,
    faults: Arc<Faults>,
    stats: Arc<Stats>,
    pool: ScratchPool,
    sends: AtomicU64,
    recvs: AtomicU64,
}

impl Engine {
    /// An engine over `transport`, with the group's settings and default timeout.
    pub fn new(transport: Arc<dyn Transport>, cfg: &Config, timeout: Duration) -> Result<Engine> {
        let shared = Arc::new(Shared {
            transport,
            timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
            segment_bytes: cfg.segment_bytes,
            small_allreduce_bytes: cfg.small_allreduce_bytes,
            spin: cfg.spin,
            sync_spin: cfg.sync_spin,
            next_seq: AtomicU64::new(0),
            done_below: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            running: Mutex::new(()),
            stopping: AtomicBool::new(false),
            broken: Mutex::new(None),
            is_broken: AtomicBool::new(false),
            faults: cfg.faults.clone(),
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
                    let running = s.running.lock().unwrap_or_else(|e| e.into_inner());
                    s.run_contained(job);
                    drop(running);
                    // After `running` is let go: while a job is counted here,
                    // `run_now` queues rather than wait for the worker.
                    s.queued.fetch_sub(1, Ordering::SeqCst);
                }
            })
            .map_err(|e| Error::resource(format!("rustc10d: could not start the engine thread: {e}")))?;
        Ok(Engine {
            shared,
            queue: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
            coalescing: Mutex::new(None),
            coalescing_open: AtomicBool::new(false),
        })
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
    /// the coalesced variants); `done` runs once all have finished. With
    /// `staging`, the buffers are the host copies of device tensors: they are
    /// brought in and out on the engine thread (a failure there fails the job
    /// and breaks the group: the peers are in the op).
    ///
    /// # Safety
    /// Every buffer must stay valid until `done` has run; the caller must not
    /// touch output buffers, nor change input buffers, before that (inputs
    /// with staging need to be valid only once it has brought them in).
    pub unsafe fn submit(
        &self,
        parts: Vec<Collective>,
        timeout: Option<Duration>,
        staging: Option<Staging>,
        done: Finisher,
    ) -> Result<OpHandle> {
        // SAFETY: the caller keeps `submit`'s contract, which is `issue`'s.
        unsafe { self.issue(parts, timeout, staging, done, false) }
    }

    /// `submit` for a caller that waits for the op at once (torch's
    /// `async_op=False`): where nothing else is queued or running, the op
    /// runs on this thread before this returns, finished (no hand-off to the
    /// worker and back); else it queues as `submit`'s does. Staged ops always
    /// queue (their copies are ordered with other threads' streams), and so
    /// do ops of an open coalescing batch, which the caller waits for later.
    ///
    /// # Safety
    /// As for `submit`.
    pub unsafe fn run_now(
        &self,
        parts: Vec<Collective>,
        timeout: Option<Duration>,
        staging: Option<Staging>,
        done: Finisher,
    ) -> Result<OpHandle> {
        // SAFETY: the caller keeps `submit`'s contract, which is `issue`'s.
        unsafe { self.issue(parts, timeout, staging, done, true) }
    }

    /// # Safety
    /// As for `submit`.
    unsafe fn issue(
        &self,
        parts: Vec<Collective>,
        timeout: Option<Duration>,
        staging: Option<Staging>,
        done: Finisher,
        now: bool,
    ) -> Result<OpHandle> {
        let (rank, world) = (self.rank(), self.size());
        let mut staging = staging;
        let checked = parts.iter().try_for_each(|p| p.check(rank, world));
        // Queued under the lock, so that ops issued from several threads at
        // once take their gates' tickets in the order the engine runs them.
        // Else an op run first with a higher ticket completes by ordering the
        // group's side stream after its copies back, which wait for the lower
        // ticket; the op holding it, run next, fails and restores on that
        // side stream: a deadlock.
        let queue = self.queue.lock().unwrap();
        if let Err(e) = checked.and_then(|()| staging.as_mut().map_or(Ok(()), |s| s.queue(&parts))) {
            drop(queue);
            // Settled (its copies let through) while `done` still holds the tensors.
            drop(staging);
            return Err(e);
        }
        let Some(tx) = queue.as_ref() else {
            return Err(Error::aborted("rustc10d: the process group was shut down"));
        };
        let first_seq = self.shared.next_seq.fetch_add(parts.len().max(1) as u64, Ordering::SeqCst);
        let status = self.issued(Status::with_callback(done));
        let timeout = timeout.unwrap_or_else(|| self.shared.timeout());
        let spin = self.shared.spin;
        let mut job = Job { first_seq, parts, timeout, staging, status: status.clone(), spin };
        let handle = OpHandle { status, seq: first_seq, source_rank: -1, expiry: None, spin };
        if let Some(running) = (now && job.staging.is_none()).then(|| self.turn_here()).flatten() {
            drop(queue);
            // Its caller waits anyway: polling longer costs nobody's compute.
            job.spin = self.shared.sync_spin;
            self.shared.run_contained(job);
            drop(running);
            return Ok(handle);
        }
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        if let Err(e) = tx.send(job) {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            e.0.fail(Error::aborted("rustc10d: the engine has stopped"));
        }
        Ok(handle)
    }

    /// A collective run on this thread at once, for a caller that holds its
    /// buffers and has nothing to finish on the torch side (the direct op,
    /// `rustc10d.all_reduce_`): its result where the group is idle; None,
    /// having done nothing, where it is not (the caller then issues it with
    /// `run_now`, which queues it). No status, handle or job is made: the
    /// smallest ops cost little more than their exchange.
    ///
    /// # Safety
    /// The buffers must stay valid, and untouched by the caller, until this returns.
    pub unsafe fn run_here(&self, part: Collective) -> Option<Result<()>> {
        if let Err(e) = part.check(self.rank(), self.size()) {
            return Some(Err(e));
        }
        let queue = self.queue.lock().unwrap();
        if queue.is_none() {
            return Some(Err(Error::aborted("rustc10d: the process group was shut down")));
        }
        let running = self.turn_here()?;
        let seq = self.shared.next_seq.fetch_add(1, Ordering::SeqCst);
        drop(queue);
        let s = &self.shared;
        let ran = panics::contain(format_args!("op #{seq} on rank {}", self.rank()), || {
            s.run_here(seq, &part, s.timeout(), s.sync_spin)
        });
        // A failure of the op has broken the group already where it should
        // (`run_part`); a panic around it breaks it here, as `run_contained`'s,
        // before `running` is let go, so that no later op starts on a group
        // not yet marked broken.
        let ran = ran.unwrap_or_else(|e| {
            s.break_group(&e, seq);
            Err(e)
        });
        drop(running);
        Some(ran)
    }

    /// The turn of an op to run on its caller's thread: where nothing of the
    /// group is queued, running or being coalesced. Taken under the queue's
    /// lock, so that no later op can run before this one; never waited for
    /// there (see `running`).
    fn turn_here(&self) -> Option<MutexGuard<'_, level::EngineTurn, ()>> {
        if self.is_coalescing() || self.shared.queued.load(Ordering::SeqCst) != 0 {
            return None;
        }
        self.shared.running.try_lock().ok()
    }

    /// Ops issued from now on are also waited for by `end_coalescing`'s op.
    pub fn start_coalescing(&self) -> Result<()> {
        let mut c = self.coalescing.lock().unwrap();
        if c.is_some() {
            return Err(Error::invalid("rustc10d: startCoalescing() called twice without endCoalescing()"));
        }
        *c = Some(Vec::new());
        self.coalescing_open.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// One op that finishes once every op issued since `start_coalescing`
    /// has (with the first failure, if any); `done` runs then.
    pub fn end_coalescing(&self, done: Finisher) -> Result<OpHandle> {
        let ops = {
            let mut c = self.coalescing.lock().unwrap();
            self.coalescing_open.store(false, Ordering::SeqCst);
            c.take()
        };
        let ops = ops.ok_or_else(|| Error::invalid("rustc10d: endCoalescing() without startCoalescing()"))?;
        let seq = self.shared.next_seq.load(Ordering::SeqCst);
        let status = Status::all(&ops, done);
        Ok(OpHandle { status, seq, source_rank: -1, expiry: None, spin: self.shared.spin })
    }

    /// Whether a coalescing batch is open (its ops are waited for together).
    pub fn is_coalescing(&self) -> bool {
        self.coalescing_open.load(Ordering::SeqCst)
    }

    /// Note an op for a coalescing batch, if one is open.
    fn issued(&self, status: Arc<Status>) -> Arc<Status> {
        if let Some(ops) = self.coalescing.lock().unwrap().as_mut() {
            ops.push(status.clone());
        }
        status
    }

    /// Collectives issued so far (the group's sequence number).
    pub fn sequence_number(&self) -> u64 {
        self.shared.next_seq.load(Ordering::SeqCst)
    }

    /// The kind of the failure that broke the group, if one did (later
    /// collectives fail with it).
    pub fn broken_by(&self) -> Option<crate::error::ErrorKind> {
        if !self.shared.is_broken.load(Ordering::Acquire) {
            return None;
        }
        self.shared.broken.lock().unwrap().as_ref().map(|e| e.kind)
    }

    /// The group's default timeout now.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.shared.timeout_ms.load(Ordering::SeqCst))
    }

    /// What Python may ask about: the links (held weakly, as the engine owns them).
    pub fn transport(&self) -> std::sync::Weak<dyn Transport> {
        Arc::downgrade(&self.shared.transport)
    }

    /// A group of `members` (ranks of this one) on this group's connections
    /// (`Transport::open_channel`); None where there are none to share.
    pub fn open_channel(&self, name: &str, members: &[usize], timeout: Duration) -> Option<Result<Arc<dyn Transport>>> {
        self.shared.transport.open_channel(name, members, timeout)
    }

    /// `Transport::connections_outlive_failure`.
    pub fn connections_outlive_failure(&self) -> bool {
        self.shared.transport.connections_outlive_failure()
    }

    /// This rank and the group's size.
    pub fn rank_and_size(&self) -> (usize, usize) {
        (self.shared.transport.rank(), self.shared.transport.size())
    }

    /// The default timeout of later ops.
    pub fn set_timeout(&self, timeout: Duration) {
        self.shared.timeout_ms.store(timeout.as_millis() as u64, Ordering::SeqCst);
    }

    /// Fail what is pending, close connections, stop the worker. Idempotent.
    pub fn shutdown(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // Peers still waiting in the group for this rank learn it left.
        self.shared.transport.leave(self.shared.done_below.load(Ordering::SeqCst));
        drop(self.queue.lock().unwrap().take());
        if let Some(w) = self.worker.lock().unwrap().take() {
            let _ = w.join();
        }
    }

    fn check_peer(&self, op: OpKind, peer: usize) -> Result<()> {
        let name = op.name();
        if peer >= self.size() {
            return Err(Error::invalid(format!(
                "rustc10d: {name}: peer rank {peer} is out of range for a group of size {}",
                self.size()
            )));
        }
        if peer == self.rank() {
            return Err(Error::unsupported(format!(
                "rustc10d: {name} to or from the own rank ({peer}) is not supported"
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
    /// Run a job, wherever it runs. Each collective's panics are contained
    /// where it runs (`run_part`); one around the rest of the job (staging,
    /// finishing) fails the job and breaks the group, rather than end the
    /// worker with every later op waiting on it or unwind into the caller.
    fn run_contained(&self, job: Job) {
        let (status, seq) = (job.status.clone(), job.first_seq);
        if let Err(e) = panics::contain(format_args!("op #{seq} on rank {}", self.transport.rank()), || self.run(job)) {
            self.break_group(&e, seq);
            status.finish(Err(e));
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::SeqCst))
    }
}
