//! What the engine's worker thread does with each job: stage its tensors in,
//! run its collectives in order (fault injection, the broken-group check, the
//! call check and the algorithm), stage results out, count, and finish.

use super::lend;
use super::staging::{run_in_pieces, Staging};
use super::Shared;
use crate::algorithms::{self, call_check::Fingerprint, OpCtx, Plan, What};
use crate::error::{Error, ErrorKind, Result};
use crate::fault::{Action, ENV_FAULT};
use crate::ops::Collective;
use crate::panics;
use crate::status::{Cost, Status};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Collectives issued together (several for the coalesced calls), run back
/// to back; part i has sequence number `first_seq + i`.
pub(super) struct Job {
    pub first_seq: u64,
    pub parts: Vec<Collective>,
    pub timeout: Duration,
    pub staging: Option<Staging>,
    pub status: Arc<Status>,
    /// How long its waits poll before they sleep.
    pub spin: Duration,
}

impl Job {
    /// Fail a job that never ran: its staging settles (its copies let through,
    /// its tensors as they were) before the completion may free the tensors.
    pub(super) fn fail(mut self, e: Error) {
        if let Some(s) = self.staging.as_mut() {
            s.settle();
        }
        self.status.finish(Err(e));
    }
}

impl Shared {
    pub(super) fn run(&self, mut job: Job) {
        let result = self.run_job(&mut job);
        if let Some(s) = job.staging.as_mut() {
            s.settle();
        }
        if result.is_ok() {
            // Jobs run one at a time, in order.
            self.done_below.fetch_max(job.first_seq + job.parts.len().max(1) as u64, Ordering::SeqCst);
        }
        job.status.finish(result.map(|()| 0));
    }

    fn run_job(&self, job: &mut Job) -> Result<()> {
        let pieces = job.staging.as_ref().and_then(|s| s.pieces_for(&job.parts));
        if let (Some(staging), None) = (&mut job.staging, pieces) {
            staging.all_in().map_err(|e| self.staging_failed(job.first_seq, &job.parts, e))?;
        }
        match (pieces, &mut job.staging) {
            (Some(bytes), Some(staging)) => {
                let part = &job.parts[0];
                let fingerprint = Fingerprint { piece: bytes as u64, ..Fingerprint::of(part) };
                self.run_part(job.first_seq, part, job.timeout, job.spin, fingerprint, |ctx| {
                    // Checked once for all pieces (the piece size is part of the call).
                    algorithms::call_check::agree(ctx, &fingerprint)?;
                    run_in_pieces(staging, part, bytes, |i, piece| {
                        // Each piece is a collective of its own, with keys of its own.
                        let piece_ctx = OpCtx {
                            timeout: ctx.deadline.saturating_duration_since(Instant::now()),
                            what: ctx.what.within("piece", i as u64),
                            piece: i as u64,
                            ..*ctx
                        };
                        lend::run(&piece_ctx, piece, &Plan::of(&piece_ctx, piece, false), &Fingerprint::of(piece))
                    })
                })
            }
            _ => {
                for (i, part) in job.parts.iter().enumerate() {
                    self.run_collective(job.first_seq + i as u64, part, job.timeout, job.spin)?;
                }
                let staging = job.staging.as_mut().map_or(Ok(()), Staging::all_out);
                staging.map_err(|e| self.staging_failed(job.first_seq, &job.parts, e))
            }
        }
    }

    /// A collective of a job without staging.
    fn run_collective(&self, seq: u64, part: &Collective, timeout: Duration, spin: Duration) -> Result<()> {
        let fingerprint = Fingerprint::of(part);
        self.run_part(seq, part, timeout, spin, fingerprint, |ctx| {
            // The smallest all-reduces and barriers check the call
            // alongside their one exchange; the rest before they start.
            let plan = Plan::of(ctx, part, true);
            if !plan.checks_inline && !matches!(part, Collective::MonitoredBarrier { .. }) {
                algorithms::call_check::agree(ctx, &fingerprint)?;
            }
            lend::run(ctx, part, &plan, &fingerprint)
        })
    }

    /// One collective, number `seq`, run on its caller's thread with no job
    /// around it (`Engine::run_here`), by whoever holds `running`.
    pub(super) fn run_here(&self, seq: u64, part: &Collective, timeout: Duration, spin: Duration) -> Result<()> {
        self.run_collective(seq, part, timeout, spin)?;
        self.done_below.fetch_max(seq + 1, Ordering::SeqCst);
        Ok(())
    }

    /// Run one collective: refuse it on a stopped or broken group, apply
    /// RUSTC10D_FAULT, run `body`, count it, and break the group if it failed.
    fn run_part(
        &self,
        seq: u64,
        part: &Collective,
        timeout: Duration,
        spin: Duration,
        fingerprint: Fingerprint,
        body: impl FnOnce(&OpCtx) -> Result<()>,
    ) -> Result<()> {
        let kind = part.kind();
        let what = What::new(kind.name(), seq, self.transport.rank());
        if self.stopping.load(Ordering::SeqCst) {
            return Err(Error::aborted(format!("rustc10d: {what} was cancelled: the process group was shut down")));
        }
        self.unless_broken(&what)?;
        let start = Instant::now();
        let cost = Arc::new(Cost::default());
        let ctx = OpCtx {
            transport: &*self.transport,
            seq,
            timeout,
            deadline: start + timeout,
            what,
            segment_bytes: self.segment_bytes,
            small_allreduce_bytes: self.small_allreduce_bytes,
            pool: &self.pool,
            spin,
            piece: 0,
            phase: 0,
            cost: &cost,
        };
        debug_assert_eq!(fingerprint.op, kind);
        let r = match self.faults.hit(self.transport.rank(), kind, seq) {
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
                // A bug must not leave the op's Work waiting forever: it fails
                // the op (and breaks the group) like any other failure.
                panics::contain(&ctx.what, || body(&ctx)).and_then(|r| r)
            }
        };
        self.stats.record(kind, part.bytes(), start.elapsed(), r.is_ok(), &cost);
        if let Err(e) = &r {
            if part.failure_breaks_group() && !matches!(e.kind, ErrorKind::InvalidArgument | ErrorKind::Unsupported) {
                self.break_group(e, seq);
            }
        }
        r
    }

    /// A device copy failed: the peers are in the op, so the group breaks.
    fn staging_failed(&self, first_seq: u64, parts: &[Collective], e: Error) -> Error {
        let name = parts.first().map_or("op", |p| p.kind().name());
        let e = Error::new(
            e.kind,
            format!(
                "rustc10d: {name} #{first_seq} on rank {} could not stage its tensors: {}",
                self.transport.rank(),
                e.message
            ),
        );
        self.break_group(&e, first_seq);
        e
    }

    fn drop_all(&self, why: &str) {
        let me = self.transport.rank();
        for peer in (0..self.transport.size()).filter(|&p| p != me) {
            self.transport.break_peer(peer, &Error::peer_lost(why.to_string()));
        }
    }

    /// Refuse op `what` on a group that an earlier failure broke.
    pub(super) fn unless_broken(&self, what: &dyn std::fmt::Display) -> Result<()> {
        if !self.is_broken.load(Ordering::Acquire) {
            return Ok(());
        }
        match &*self.broken.lock().unwrap() {
            Some(cause) => Err(Error::new(
                cause.kind,
                format!(
                    "rustc10d: {what} cannot run: the process group is broken by an earlier failure: {}",
                    cause.message
                ),
            )),
            None => Ok(()),
        }
    }

    /// A collective failed: the ranks no longer agree on where they are.
    /// Tell every peer and close the group (its channel: the connections
    /// stay for the other groups), so that peers blocked in this or later
    /// collectives fail within moments instead of at their timeout; the
    /// failure spreads the same way. `seq`: the failed collective's (see
    /// `Transport::abort_all`).
    pub(super) fn break_group(&self, cause: &Error, seq: u64) {
        let mut broken = self.broken.lock().unwrap();
        broken.get_or_insert_with(|| cause.clone());
        self.is_broken.store(true, Ordering::Release);
        drop(broken);
        self.transport.abort_all(cause, seq);
    }
}
