//! What a Work sees of its op: done or not, the outcome, a bounded wait. A
//! handle only observes: dropping it changes nothing about the op.

use crate::error::{Error, Result};
use crate::status::Status;
use crate::transport::{withdraw, Key, Transport};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct OpHandle {
    pub(super) status: Arc<Status>,
    pub(super) seq: u64,
    pub(super) source_rank: i64,
    /// For p2p ops the waiter enforces the op's timeout (collectives enforce
    /// their own on the worker).
    pub(super) expiry: Option<Expiry>,
    pub(super) spin: Duration,
}

/// `OpHandle::source_rank` of an any-source receive before it has matched.
pub(super) const ANY_SOURCE: i64 = -2;

pub(super) struct Expiry {
    pub deadline: Instant,
    pub transport: Arc<dyn Transport>,
    /// None for an any-source receive.
    pub peer: Option<usize>,
    pub recv_key: Option<Key>,
    /// The op's error when it expires.
    pub timed_out: Error,
}

/// Outcome of `OpHandle::wait`.
#[derive(Debug, PartialEq)]
pub enum Waited {
    Done,
    Failed(Error),
    /// The caller's own timeout passed; the op goes on.
    TimedOut,
}

impl OpHandle {
    /// A handle on an op that failed before it started.
    pub fn failed(error: Error) -> OpHandle {
        let status = Status::new();
        status.finish(Err(error));
        OpHandle { status, seq: 0, source_rank: -1, expiry: None, spin: Duration::ZERO }
    }

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

    /// Fail the op with `why` (unless it has finished), after a panic in a
    /// thread waiting for it: the peer it waited for is given up on, since
    /// what that thread was reading from it cannot be trusted.
    pub fn fail(&self, why: &Error) {
        if let Some(peer) = self.expiry.as_ref().and_then(|e| e.peer.map(|p| (&e.transport, p))) {
            peer.0.break_peer(peer.1, why);
        }
        self.status.finish(Err(why.clone()));
    }

    /// When, and how, the op ends past its timeout as `wait` would end it
    /// (point-to-point ops: their timeout is their waiter's to enforce), for
    /// whoever enforces it where nobody waits on the host (gates.rs). With
    /// an error, it ends for that reason instead.
    pub fn expirer(&self) -> Option<(Instant, super::Expire)> {
        let e = self.expiry.as_ref()?;
        let (transport, peer, key) = (e.transport.clone(), e.peer, e.recv_key);
        let (status, timed_out) = (self.status.clone(), e.timed_out.clone());
        let expire =
            move |why: Option<Error>| withdraw(&*transport, peer, key, &status, why.as_ref().unwrap_or(&timed_out));
        Some((e.deadline, Box::new(expire)))
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
            Err(e) => Waited::Failed(e),
        };
        let polling = self.expiry.as_ref().and_then(|e| e.transport.polling(e.peer));
        if let Some(r) = self.status.wait_polling(bound, self.spin, polling) {
            return outcome(r);
        }
        match &self.expiry {
            Some(e) if Instant::now() >= e.deadline => {
                // Past its timeout: withdraw the op, or cut the link that holds it.
                withdraw(&*e.transport, e.peer, e.recv_key, &self.status, &e.timed_out);
                outcome(self.status.wait(None, self.spin).expect("finished"))
            }
            _ => Waited::TimedOut,
        }
    }
}
