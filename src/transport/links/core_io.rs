//! A group's transfers on the process's connections to its peers, the same
//! for the group that owns them (`Mesh`) and for one that shares them
//! (`Channel`): peers here are ranks of the owner, and keys carry their
//! group's channel number.

use crate::error::Result;
use crate::status::{Polling, Status};
use crate::transport::links::frame::{Key, KIND_P2P};
use crate::transport::links::link::Link;
use crate::transport::links::mailbox::{PostedRecv, RecvBuf, Sources};
use crate::transport::links::mesh_core::Core;
use crate::transport::links::writer::SendReq;
use crate::transport::{Fold, Gate, Ready};
use std::sync::Arc;
use std::time::Instant;

impl Core {
    /// `Transport::send` to `peer`.
    /// # Safety
    /// As for `Transport::send`.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::transport) unsafe fn send_to(
        self: &Arc<Self>,
        peer: usize,
        key: Key,
        data: *const u8,
        len: usize,
        status: Arc<Status>,
        deadline: Instant,
        ready: Option<Ready>,
    ) -> Result<()> {
        // Point-to-point keeps to one connection, so that it stays in order.
        let spread = key.kind != KIND_P2P;
        let link = self.lane(peer, key.sub as usize, spread, deadline)?;
        link.send(SendReq::new(key, data, len, status, ready));
        Ok(())
    }

    /// `Transport::recv` from `peer`.
    /// # Safety
    /// As for `Transport::recv`.
    pub(in crate::transport) unsafe fn recv_from(
        self: &Arc<Self>,
        peer: usize,
        key: Key,
        data: *mut u8,
        len: usize,
        fold: Option<Fold>,
        status: Arc<Status>,
    ) {
        let recv = PostedRecv { buf: RecvBuf { ptr: data, len, fold }, status, any_source: None };
        self.peers[peer].mailbox.lock().unwrap().post(key, recv);
        self.resume(peer);
    }

    /// `Transport::recv_after` from `peer`: `recv_from` once `gate`'s send is done.
    /// # Safety
    /// As for `Transport::recv_after`.
    pub(in crate::transport) unsafe fn recv_from_after(
        self: &Arc<Self>,
        gate: &Arc<Gate>,
        peer: usize,
        key: Key,
        buf: RecvBuf,
        status: Arc<Status>,
    ) {
        let (core, posted) = (self.clone(), status.clone());
        gate.post_after(status, move || {
            let buf = buf;
            // SAFETY: the caller's contract, passed on: the buffer stays valid,
            // and untouched, until `posted` finishes.
            unsafe { core.recv_from(peer, key, buf.ptr, buf.len, buf.fold, posted) }
        });
    }

    /// `Transport::recv_any` from whichever of `peers` sends first, named as `sources` says.
    /// # Safety
    /// As for `Transport::recv_any`.
    pub(in crate::transport) unsafe fn recv_from_any(
        self: &Arc<Self>,
        peers: &[usize],
        sources: Sources,
        key: Key,
        data: *mut u8,
        len: usize,
        status: Arc<Status>,
    ) {
        // Post first, then look for a message that came early: a reader that
        // gets one meanwhile finds the posted receive.
        let recv = PostedRecv {
            buf: RecvBuf { ptr: data, len, fold: None },
            status: status.clone(),
            any_source: Some(sources),
        };
        self.any.lock().unwrap().push(key, recv);
        let early = peers.iter().any(|&p| self.peers[p].mailbox.lock().unwrap().offer_early(key, &status, &self.any));
        // A peer already lost fails it now; one lost later fails it then (mesh_core, Lost).
        if !early {
            let closed = |&p: &usize| self.peers[p].mailbox.lock().unwrap().closed_for(key.group).cloned();
            if let Some(err) = peers.iter().find_map(closed) {
                if self.any.lock().unwrap().remove(key, &status).is_some() {
                    status.finish(Err(err));
                }
            }
        }
        for &peer in peers {
            self.resume(peer);
        }
    }

    /// `Transport::polling` of `peers`' connections.
    pub(in crate::transport) fn polling_of(&self, peers: impl Iterator<Item = usize>) -> Box<dyn Polling + '_> {
        let links: Vec<_> = peers.flat_map(|p| self.peers[p].links.lock().unwrap().clone()).collect();
        links.iter().for_each(|l| l.poll_begin());
        Box::new(Pollers(links))
    }

    /// `Transport::link_kind` of `peer`.
    pub(in crate::transport) fn link_kind_of(&self, peer: usize) -> Option<&'static str> {
        let links = self.peers.get(peer)?.links.lock().unwrap();
        links.first().map(|l| if l.conn.is_shm() { "shm" } else { "tcp" })
    }

    /// `Transport::lanes` of `peer`.
    pub(in crate::transport) fn lanes_of(&self, peer: usize) -> usize {
        let Some(slot) = self.peers.get(peer) else { return 0 };
        let state = slot.state.lock().unwrap();
        state.life.lanes().len().min(state.striping.lanes())
    }

    /// `Transport::lanes_settled` of `peer`.
    pub(in crate::transport) fn lanes_settled_of(&self, peer: usize) -> bool {
        // Shared memory is one connection, never measured.
        self.link_kind_of(peer) == Some("shm")
            || self.peers.get(peer).is_none_or(|slot| slot.state.lock().unwrap().striping.settled())
    }
}

/// Links a waiting thread polls.
struct Pollers(Vec<Arc<Link>>);

impl Polling for Pollers {
    fn poll(&self) {
        self.0.iter().for_each(|l| l.poll());
    }
}

impl Drop for Pollers {
    fn drop(&mut self) {
        self.0.iter().for_each(|l| l.poll_end());
    }
}
