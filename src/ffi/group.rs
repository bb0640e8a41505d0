//! The engine behind a torch Backend, and an op behind a torch Work, as the
//! shim calls them.

use super::bridge::{self, Call, OpKind, WaitOutcome};
use super::translate::{
    all_reduce_of, buf, collectives, finish_with, first, op_kind, rank, shared, timeout, Fence, ShimDevice,
};
use super::{Formed, Group, GroupStore, Op};
use crate::config::CudaWait;
use crate::cuda::{DeviceGate, Stream};
use crate::engine::{Device, GatedOp, HostHeld, HostStream, OpHandle, StagedBuffer, Staging, StreamGates, Waited};
use crate::error::{Error, Result};
use crate::locks::{level, Mutex};
use crate::ops::{self, SparseGathered};
use crate::panics;
use crate::rendezvous::Member;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A group's stream-ordered completion on one CUDA device.
pub(crate) struct DeviceGates {
    streams: [Stream; 3],
    gates: Arc<StreamGates>,
}

impl Group {
    /// The op's staged buffers, on the shim's device primitives. Every op
    /// but a send holds its copies back behind a gate of the group's, in
    /// stream order (gates.rs): under test staging (host memory standing in
    /// for a device) on the group's host stream, whose consumer is the host;
    /// on a CUDA device with `cuda_wait=stream`, on the group's held stream
    /// for that device. A send copies its tensor in at issue and has nothing
    /// to copy back.
    ///
    /// `cuda`: the CUDA device of the op's tensors (-1: none), asked of the
    /// Completion before it was shared.
    pub(crate) fn staging(
        &self,
        call: &Call,
        done: &super::translate::SharedCompletion,
        cuda: i32,
    ) -> Result<Option<Staging>> {
        if call.staged.is_empty() {
            return Ok(None);
        }
        let buffers = call
            .staged
            .iter()
            .map(|s| StagedBuffer {
                host: buf(&s.host),
                copy_in: s.copy_in,
                copy_out: s.copy_out,
                contiguous: s.contiguous,
            })
            .collect();
        let send = call.kind == OpKind::Send;
        let shim = ShimDevice { done: done.clone(), streams: None };
        let device: Box<dyn Device> = match (send, self.cfg.test_staging, self.cfg.cuda_wait) {
            (false, true, _) => {
                let (stream, gates) = self.host_gates()?;
                Box::new(GatedOp::new(HostHeld::new(shim, stream), gates))
            }
            (false, false, CudaWait::Stream) if cuda >= 0 => {
                let (streams, gates) = self.gates(cuda)?;
                Box::new(GatedOp::new(ShimDevice { streams: Some(streams), ..shim }, gates))
            }
            _ => Box::new(shim),
        };
        Ok(Some(Staging::new(buffers, device, self.cfg.stage_piece_bytes)))
    }

    /// CUDA device `device`'s gates and streams, made with its first op.
    fn gates(&self, device: i32) -> Result<([Stream; 3], Arc<StreamGates>)> {
        let mut all = self.gates.lock().unwrap();
        if let Some(g) = all.get(&device) {
            return Ok((g.streams, g.gates.clone()));
        }
        let gate = DeviceGate::new(device)?;
        let streams = gate.streams();
        let gates = Arc::new(StreamGates::new(Box::new(gate))?);
        all.insert(device, DeviceGates { streams, gates: gates.clone() });
        Ok((streams, gates))
    }

    /// The group's host stream and its gates, made with its first staged op.
    fn host_gates(&self) -> Result<(HostStream, Arc<StreamGates>)> {
        let mut made = self.host_gates.lock().unwrap();
        if made.is_none() {
            let stream = HostStream::start("rustc10d-stream")?;
            let gates = Arc::new(StreamGates::new(Box::new(stream.clone()))?);
            *made = Some((stream, gates));
        }
        Ok(made.clone().expect("made above"))
    }

    // The raw buffers are the tensors (or their staged host copies) that the
    // Completion owns; it is dropped only when the op's finisher has run,
    // after the engine is done with them (and, with gates, when a failed
    // op's restore has run too). Torch's contract for asynchronous ops keeps
    // the caller's hands off them until the Work completes.
    pub(crate) fn issue(
        &self,
        call: &Call,
        done: cxx::UniquePtr<bridge::Completion>,
    ) -> Result<(OpHandle, Vec<Arc<Fence>>)> {
        // Without a Completion (the shim handed none) nothing is staged.
        let cuda = (!call.staged.is_empty()).then(|| done.as_ref().map(bridge::staged_device)).flatten();
        let done = shared(done);
        let mut staging = match cuda {
            Some(cuda) => self.staging(call, &done, cuda)?,
            None => None,
        };
        // Where the host consumes the op (test staging), its completion and
        // its Work wait for its copies back.
        let after = staging.as_mut().and_then(Staging::after_copies).map(|a| (a, Arc::new(Fence::default())));
        let fences: Vec<Arc<Fence>> = after.iter().map(|(_, f)| f.clone()).collect();
        let e = &self.engine;
        let handle = match op_kind(call.kind)? {
            ops::OpKind::Send => {
                let ready = staging.map(|s| s.send_in()).transpose()?;
                // The ready runs on the staging thread and uses the Completion
                // (its events, its host copy); a send whose connection closes
                // meanwhile is finished at once. So they take turns: the
                // finisher waits for a ready that runs, and a ready that
                // starts after it does nothing.
                let live = Arc::new(Mutex::<level::SendLive, _>::new(true));
                let ready = ready.map(|wait| -> crate::transport::Ready {
                    let live = live.clone();
                    Box::new(move || {
                        let live = live.lock().unwrap_or_else(|e| e.into_inner());
                        if !*live {
                            return Err(crate::error::Error::aborted(
                                "rustc10d: the send had ended before its tensor was staged",
                            ));
                        }
                        wait().map_err(|e| e.context("rustc10d: send could not stage its tensor"))
                    })
                });
                let finish = finish_with(done, None, None, None);
                let done: crate::status::Finisher = Box::new(move |r| {
                    *live.lock().unwrap_or_else(|e| e.into_inner()) = false;
                    finish(r)
                });
                let dst = rank(call.root, "destination")?;
                let input = first(&call.inputs, "input")?;
                // SAFETY: the input (or its host copy, filled by `ready`) is owned
                // by the Completion, which `done` frees only when the send has
                // finished, and which torch's caller leaves unchanged until then.
                unsafe { e.send(input, dst, call.tag, timeout(call.timeout_ms), ready, done)? }
            }
            ops::OpKind::Recv => {
                // A negative source: any source (torch's recvAnysource).
                let src = if call.root < 0 { None } else { Some(rank(call.root, "source")?) };
                let out = first(&call.outputs, "output")?;
                // Its copy back is queued now, behind its gate (stream order).
                let ticket = match staging.as_mut() {
                    Some(s) => s.queue(&[]).map(|()| s.ticket())?,
                    None => None,
                };
                let done = finish_with(done, None, staging, after);
                // SAFETY: the output (or its host copy) is owned by the Completion,
                // which the finisher frees only when the receive has finished, and
                // which torch's caller does not read until then.
                let handle = unsafe { e.recv(out, src, call.tag, timeout(call.timeout_ms), done)? };
                // Nobody may wait for it on the host: the gates end it at its timeout.
                if let (Some((gates, t)), Some((deadline, expire))) = (ticket, handle.expirer()) {
                    gates.expire_at(t, deadline, expire);
                }
                handle
            }
            _ => {
                let is_sparse = call.kind == OpKind::AllReduceSparse;
                let sparse = is_sparse.then(|| Arc::new(Mutex::new(SparseGathered::default())));
                let parts = collectives(call, sparse.as_ref())?;
                // A monitored barrier's timeout is rank 0's wait; the op runs with the group's.
                let op_timeout = if call.kind == OpKind::MonitoredBarrier { None } else { timeout(call.timeout_ms) };
                let done = finish_with(done, sparse, None, after);
                // SAFETY: every buffer of `parts` is a tensor (or its host copy)
                // the Completion owns, which `done` frees only when the op has
                // finished; torch's caller leaves inputs unchanged and outputs
                // unread until then.
                unsafe {
                    if call.sync_op {
                        e.run_now(parts, op_timeout, staging, done)?
                    } else {
                        e.submit(parts, op_timeout, staging, done)?
                    }
                }
            }
        };
        if e.is_coalescing() {
            self.batch.lock().unwrap().extend(fences.iter().cloned());
        }
        Ok((handle, fences))
    }

    /// An Op of `handle` (failed at issue: `at_issue`), whose `wait` also waits for `fences`.
    fn op(&self, handle: OpHandle, at_issue: bool, fences: Vec<Arc<Fence>>) -> Box<Op> {
        // Its copies back wait for the ops issued before it, each of which
        // ends by its own timeout (a receive's, the gates end it): a safety
        // net well past those, so that a wait still cannot hang forever.
        let fence_bound = self.engine.timeout() * 2 + Duration::from_secs(10);
        Box::new(Op { handle, at_issue, fences, fence_bound })
    }

    // Every function the shim calls contains panics (`panics::contain`):
    // cxx aborts the process on one that reaches its boundary.

    pub(crate) fn submit(&self, call: &Call, done: cxx::UniquePtr<bridge::Completion>) -> Box<Op> {
        let name = op_kind(call.kind).map_or("op", |k| k.name());
        match panics::contain(format_args!("{name} on rank {}", self.engine.rank()), || self.issue(call, done)) {
            Ok(Ok((handle, fences))) => self.op(handle, false, fences),
            Ok(Err(e)) | Err(e) => self.op(OpHandle::failed(e), true, Vec::new()),
        }
    }

    pub(crate) fn all_reduce_direct(&self, tensor: &bridge::TensorDesc, reduce: bridge::ReduceOpCode) -> bridge::Ended {
        let run = || -> Result<()> {
            // PREMUL_SUM, whose factor this does not take, the shim refuses.
            let part = || all_reduce_of(tensor, reduce, 1.0);
            // SAFETY: the buffer is the caller's tensor, which it holds, and
            // neither reads nor changes, until this returns (the bridge's
            // contract for `all_reduce_direct`).
            if let Some(ran) = unsafe { self.engine.run_here(part()?) } {
                return ran;
            }
            // Busy: queued behind what runs, and waited for here.
            // SAFETY: as above; the wait below returns once the op has ended,
            // which it does by its timeout at the latest.
            let handle = unsafe { self.engine.run_now(vec![part()?], None, None, Box::new(|_| Ok(()))) }?;
            match handle.wait(None) {
                Waited::Done => Ok(()),
                Waited::Failed(e) => Err(e),
                Waited::TimedOut => Err(handle.error().unwrap_or_else(|| {
                    Error::timeout(format!(
                        "rustc10d: allreduce on rank {} did not end within its timeout",
                        self.engine.rank()
                    ))
                })),
            }
        };
        let ran = panics::contain(format_args!("allreduce on rank {}", self.engine.rank()), run).and_then(|r| r);
        match ran {
            Ok(()) => bridge::Ended { failed: false, kind: bridge::ErrorKind::InvalidArgument, message: String::new() },
            Err(e) => bridge::Ended { failed: true, kind: e.kind.into(), message: e.message },
        }
    }

    pub(crate) fn start_coalescing(&self) -> Result<()> {
        panics::contain("startCoalescing", || {
            self.engine.start_coalescing()?;
            self.batch.lock().unwrap().clear();
            Ok(())
        })
        .and_then(|r| r)
    }

    /// The batch's op; where its ops' consumer is the host (test staging),
    /// its completion and `wait` also wait for each op's.
    pub(crate) fn end_coalescing(&self, done: cxx::UniquePtr<bridge::Completion>) -> Box<Op> {
        let fences = std::mem::take(&mut *self.batch.lock().unwrap());
        let batch = (!fences.is_empty()).then(|| Arc::new(Fence::default()));
        let ended = panics::contain("endCoalescing", || {
            let finish = finish_with(shared(done), None, None, None);
            let finish: crate::status::Finisher = match batch.clone() {
                None => finish,
                // After every op's own completion (each runs after its copies back).
                Some(fence) => Box::new(move |r| {
                    let (outcome, r) = (r.clone().map(|_| ()), r.clone());
                    Fence::after_all(
                        &fences,
                        Box::new(move || {
                            let _ = finish(&r);
                            fence.pass();
                        }),
                    );
                    outcome
                }),
            };
            self.engine.end_coalescing(finish)
        });
        match ended.and_then(|r| r) {
            Ok(handle) => self.op(handle, false, batch.into_iter().collect()),
            Err(e) => self.op(OpHandle::failed(e), true, Vec::new()),
        }
    }

    pub(crate) fn sequence_number(&self) -> u64 {
        self.engine.sequence_number()
    }

    pub(crate) fn broken_by(&self) -> bridge::BrokenBy {
        match self.engine.broken_by() {
            Some(kind) => bridge::BrokenBy { broken: true, kind: kind.into() },
            None => bridge::BrokenBy { broken: false, kind: bridge::ErrorKind::Io },
        }
    }

    pub(crate) fn set_timeout(&self, timeout_ms: i64) {
        self.engine.set_timeout(Duration::from_millis(timeout_ms.max(0) as u64));
    }

    pub(crate) fn shutdown(&self) {
        if let Err(e) = panics::contain("destroying the process group", || self.shut_down()) {
            tracing::error!("{}", e.message);
        }
    }

    fn shut_down(&self) {
        self.engine.shutdown();
        // Collectives have ended; point-to-point ops still holding a ticket
        // end now, and no held copy waits beyond that.
        if let Some((stream, gates)) = self.host_gates.lock().unwrap().take() {
            gates.close();
            stream.stop();
        }
        let devices = std::mem::take(&mut *self.gates.lock().unwrap());
        for g in devices.values() {
            g.gates.close();
        }
        // The device's word goes once its streams drain.
        drop(devices);
    }

    pub(crate) fn cuda_allowed(&self) -> bool {
        self.cfg.cuda
    }

    pub(crate) fn test_staging(&self) -> bool {
        self.cfg.test_staging
    }

    pub(crate) fn rank(&self) -> i32 {
        self.engine.rank_and_size().0 as i32
    }

    pub(crate) fn size(&self) -> i32 {
        self.engine.rank_and_size().1 as i32
    }

    pub(crate) fn timeout_ms(&self) -> i64 {
        self.engine.timeout().as_millis() as i64
    }

    /// A child group of this group's `ranks`, with this group's settings:
    /// a channel on this group's connections, agreed by the members without
    /// a message (channel.rs); or, where this group has none to share or
    /// torch gave no name to agree on, through the store torch namespaced
    /// for it, with connections of its own.
    pub(crate) fn split(
        &self,
        store: cxx::UniquePtr<bridge::StoreRef>,
        ranks: &[i32],
        rank: i32,
        size: i32,
        timeout_ms: i64,
        group_name: &str,
    ) -> Box<Formed> {
        let formed = || -> Result<Box<Group>> {
            let store = GroupStore::new(store)?;
            let timeout = Duration::from_millis(timeout_ms.max(0) as u64);
            let members: Vec<usize> = ranks.iter().map(|&r| r as usize).collect();
            let channel =
                (!group_name.is_empty()).then(|| self.engine.open_channel(group_name, &members, timeout)).flatten();
            let child = match channel {
                Some(transport) => Group::over(transport?, store, self.cfg.clone(), timeout)?,
                None => {
                    let member = member(rank as usize, size as usize, timeout_ms, &store);
                    Group::join(store, &member, self.cfg.clone())?
                }
            };
            crate::python::watch(group_name, &child);
            Ok(Box::new(child))
        };
        Box::new(Formed(panics::contain(format_args!("split_group on rank {}", self.rank()), formed).and_then(|r| r)))
    }

    /// The survivors' group: this group's ranks but `excluded`, in their
    /// order (the n-th shrink of this group, which every survivor counts
    /// alike). The connections outlive a group's failure: the survivors'
    /// group is a channel on them, with no Store round trip and no new
    /// connection. Once they are shut (SHRINK_ABORT of the last group on
    /// them), it joins through this group's Store under a namespace of its
    /// own. Who is gone is the caller's word, as torch's shrink_group has
    /// it; survivors that disagree make groups of different sizes, which
    /// fail at their first op or rendezvous, at the timeout.
    pub(crate) fn shrink(&self, excluded: &[i64], timeout_ms: i64) -> Box<Formed> {
        let shrink = || self.shrink_to_survivors(excluded, timeout_ms);
        Box::new(Formed(panics::contain(format_args!("shrink_group on rank {}", self.rank()), shrink).and_then(|r| r)))
    }

    fn shrink_to_survivors(&self, excluded: &[i64], timeout_ms: i64) -> Result<Box<Group>> {
        let (rank, size) = self.engine.rank_and_size();
        let survivors: Vec<usize> = (0..size).filter(|&r| !excluded.contains(&(r as i64))).collect();
        let Some(new_rank) = survivors.iter().position(|&r| r == rank) else {
            return Err(Error::invalid(format!("rustc10d: rank {rank} cannot shrink a group that excludes it")));
        };
        let n = self.shrinks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let store = self.store.within(&format!("rustc10d/shrink/{n}"));
        let timeout = Duration::from_millis(timeout_ms.max(0) as u64);
        let name = self.name.lock().unwrap().clone();
        if !name.is_empty() && self.engine.connections_outlive_failure() {
            let channel = self.engine.open_channel(&format!("{name}/shrink/{n}"), &survivors, timeout);
            if let Some(channel) = channel {
                return Ok(Box::new(Group::over(channel?, store, self.cfg.clone(), timeout)?));
            }
        }
        let member = member(new_rank, survivors.len(), timeout_ms, &store);
        Ok(Box::new(Group::join(store, &member, self.cfg.clone())?))
    }

    pub(crate) fn watch_as(&self, group_name: &str) {
        if let Err(e) = panics::contain("naming the group", || crate::python::watch(group_name, self)) {
            tracing::error!("{}", e.message);
        }
    }
}

pub(super) fn member(rank: usize, size: usize, timeout_ms: i64, store: &GroupStore) -> Member {
    Member { rank, size, timeout: Duration::from_millis(timeout_ms.max(0) as u64), store_host: Some(store.host()) }
}

impl Op {
    pub(crate) fn is_done(&self) -> bool {
        self.handle.is_done() && self.fences.iter().all(|f| f.passed())
    }

    pub(crate) fn failed_at_issue(&self) -> bool {
        self.at_issue
    }

    pub(crate) fn wait(&self, timeout_ms: i64) -> WaitOutcome {
        // A waiting thread may read its message itself (`Transport::polling`):
        // a panic there fails the op and gives up on the peer it waited for.
        let seq = self.handle.seq();
        let mine = timeout(timeout_ms).map(|t| Instant::now() + t);
        let waited = panics::contain(format_args!("waiting for op #{seq}"), || self.handle.wait(timeout(timeout_ms)));
        // Ended: where the host consumes it, until its copies back have run
        // too (they wait for the ops issued before it, which end by their timeouts).
        let bound = mine.unwrap_or_else(|| Instant::now() + self.fence_bound);
        let landed = || self.fences.iter().all(|f| f.wait(bound));
        match waited {
            Ok(Waited::Done | Waited::Failed(_)) if !landed() => WaitOutcome::TimedOut,
            Ok(Waited::Done) => WaitOutcome::Done,
            Ok(Waited::Failed(_)) => WaitOutcome::Failed,
            // In stream order every op issued after it waits for it: a
            // receive whose waiter gives up is withdrawn, not left to hold
            // them until its own timeout.
            Ok(Waited::TimedOut) if !self.fences.is_empty() => match self.handle.expirer() {
                Some((_, withdraw)) => {
                    let ms = timeout_ms.max(0);
                    withdraw(Some(Error::timeout(format!(
                        "rustc10d: Work.wait(timeout={ms} ms) expired; the receive is withdrawn, since the ops \
                         issued after it are ordered after it"
                    ))));
                    let bound = Instant::now() + self.fence_bound;
                    let landed = self.fences.iter().all(|f| f.wait(bound));
                    if landed {
                        WaitOutcome::Failed
                    } else {
                        WaitOutcome::TimedOut
                    }
                }
                None => WaitOutcome::TimedOut,
            },
            Ok(Waited::TimedOut) => WaitOutcome::TimedOut,
            Err(e) => {
                self.handle.fail(&e);
                WaitOutcome::Failed
            }
        }
    }

    pub(crate) fn error_kind(&self) -> bridge::ErrorKind {
        self.handle.error().map_or(bridge::ErrorKind::Io, |e| e.kind.into())
    }

    pub(crate) fn error_message(&self) -> String {
        self.handle.error().map(|e| e.message).unwrap_or_default()
    }

    pub(crate) fn source_rank(&self) -> i64 {
        self.handle.source_rank()
    }

    pub(crate) fn seq(&self) -> u64 {
        self.handle.seq()
    }
}
