//! Point-to-point ops: straight to the transport, never queued behind
//! collectives. Each has a timeout its waiter enforces, and names itself
//! ("send #3 to rank 1 (...) (tag 5) on rank 0") in every error it reports.

use super::handle::{Expiry, OpHandle, ANY_SOURCE};
use super::Engine;
use crate::error::{Error, Result};
use crate::fault::{Action, ENV_FAULT};
use crate::ops::OpKind;
use crate::ops::RawBuf;
use crate::status::{Cost, Finisher, Status};
use crate::transport::{Key, Ready};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl Engine {
    /// Send `buf` to `dst`. With `ready`, the buffer is filled by it (a device
    /// tensor's copy to the host), on the sending thread: the caller does not wait.
    ///
    /// # Safety
    /// `buf` must stay valid and unchanged until `done` has run (from the
    /// time `ready` returns, with `ready`).
    pub unsafe fn send(
        &self,
        buf: RawBuf,
        dst: usize,
        tag: i64,
        timeout: Option<Duration>,
        ready: Option<Ready>,
        done: Finisher,
    ) -> Result<OpHandle> {
        self.check_peer(OpKind::Send, dst)?;
        let seq = self.shared.sends.fetch_add(1, Ordering::SeqCst);
        let t = &self.shared.transport;
        let op = format!("send #{seq} to {} (tag {tag}) on rank {}", t.describe_peer(dst), self.rank());
        // The group's connections outlive its failure, and the peer would
        // drop the message: say so here instead.
        self.shared.unless_broken(&op)?;
        self.p2p_fault(OpKind::Send, seq, &op, Some(dst))?;
        let timeout = timeout.unwrap_or_else(|| self.shared.timeout());
        let status = self.issued(self.p2p_status(OpKind::Send, &op, buf.len, done));
        let deadline = Instant::now() + timeout;
        let timed_out = Error::timed_out(timeout, format_args!("{op} was still waiting to write its data"));
        // SAFETY: the caller keeps `buf` valid and unchanged (from when `ready`
        // returns) until `done` has run, which `status` runs as it finishes.
        unsafe { t.send(dst, Key::p2p(tag), buf.ptr, buf.len, status.clone(), deadline, ready) }
            .map_err(|e| e.context(format_args!("rustc10d: {op}")))?;
        let expiry = Expiry { deadline, transport: t.clone(), peer: Some(dst), recv_key: None, timed_out };
        Ok(OpHandle { status, seq, source_rank: -1, expiry: Some(expiry), spin: self.shared.spin })
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
        done: Finisher,
    ) -> Result<OpHandle> {
        if let Some(src) = src {
            self.check_peer(OpKind::Recv, src)?;
        }
        let seq = self.shared.recvs.fetch_add(1, Ordering::SeqCst);
        let t = &self.shared.transport;
        let from = src.map_or_else(|| "any rank".to_string(), |s| t.describe_peer(s));
        let op = format!("recv #{seq} from {from} (tag {tag}) on rank {}", self.rank());
        self.p2p_fault(OpKind::Recv, seq, &op, src)?;
        let timeout = timeout.unwrap_or_else(|| self.shared.timeout());
        let status = self.issued(self.p2p_status(OpKind::Recv, &op, buf.len, done));
        let timed_out = Error::timed_out(timeout, format_args!("{op} was waiting for data"));
        let key = Key::p2p(tag);
        match src {
            // SAFETY: the caller keeps `buf` valid and unread until `done` has
            // run, which `status` runs as it finishes.
            Some(src) => unsafe { t.recv(src, key, buf.ptr, buf.len, None, status.clone())? },
            // SAFETY: as above, whichever peer's message fills it.
            None => unsafe { t.recv_any(key, buf.ptr, buf.len, status.clone())? },
        }
        let expiry = Expiry {
            deadline: Instant::now() + timeout,
            transport: t.clone(),
            peer: src,
            recv_key: Some(key),
            timed_out,
        };
        let source_rank = src.map_or(ANY_SOURCE, |s| s as i64);
        Ok(OpHandle { status, seq, source_rank, expiry: Some(expiry), spin: self.shared.spin })
    }

    /// The op's completion cell: its finish is counted, and an error from
    /// the transport names the op.
    fn p2p_status(&self, kind: OpKind, op: &str, bytes: usize, done: Finisher) -> std::sync::Arc<Status> {
        let (stats, start) = (self.shared.stats.clone(), Instant::now());
        let cost = std::sync::Arc::new(Cost::default());
        Status::named(
            op.to_string(),
            cost.clone(),
            Box::new(move |r: &Result<i64>| {
                let handed_over = done(r);
                stats.record(kind, bytes as u64, start.elapsed(), r.is_ok() && handed_over.is_ok(), &cost);
                handed_over
            }),
        )
    }

    /// Apply a RUSTC10D_FAULT rule to a send or receive (`peer` None: any source).
    fn p2p_fault(&self, kind: OpKind, seq: u64, op: &str, peer: Option<usize>) -> Result<()> {
        match self.shared.faults.hit(self.rank(), kind, seq) {
            Some(Action::Fail) => Err(Error::io(format!("rustc10d: {op} failed: fault injected by {ENV_FAULT}"))),
            Some(Action::Stall(d)) => {
                std::thread::sleep(d);
                Ok(())
            }
            Some(Action::Drop) => {
                if let Some(peer) = peer {
                    let why = format!("{op}: connection dropped by {ENV_FAULT}");
                    self.shared.transport.break_peer(peer, &Error::peer_lost(why));
                }
                Ok(())
            }
            None => Ok(()),
        }
    }
}
