//! Some ranks of a group seen as a group of their own, so that an algorithm
//! written for a whole group runs on them unchanged: rank i of the view is
//! rank `members[i]` of the group. Hierarchical collectives run their phases
//! on such views (the ranks of one host, or one rank of every host), and a
//! view of every rank in another order makes a ring follow the hosts. A view
//! of one host's ranks has that host's shared arena, where there is one.

use crate::error::{Error, Result};
use crate::status::{Polling, Status};
use crate::transport::group::arena::Arena;
use crate::transport::{Fold, Gate, Key, Ready, RecvBuf, Transport, Wait};
use std::sync::Arc;
use std::time::Instant;

pub struct Subgroup<'a> {
    group: &'a dyn Transport,
    members: Vec<usize>,
    /// This rank's place in `members`.
    me: usize,
}

impl<'a> Subgroup<'a> {
    /// The view of `members` (distinct ranks of `group`, this rank among them).
    pub fn new(group: &'a dyn Transport, members: Vec<usize>) -> Subgroup<'a> {
        let me = members.iter().position(|&r| r == group.rank()).expect("a subgroup holds its own rank");
        Subgroup { group, members, me }
    }

    /// The view's rank of the group's rank `rank`, if it is a member.
    pub fn position(&self, rank: usize) -> Option<usize> {
        self.members.iter().position(|&r| r == rank)
    }
}

impl Transport for Subgroup<'_> {
    fn rank(&self) -> usize {
        self.me
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn describe_peer(&self, peer: usize) -> String {
        self.group.describe_peer(self.members[peer])
    }

    /// # Safety
    /// As for `Transport::send`.
    unsafe fn send(
        &self,
        peer: usize,
        key: Key,
        data: *const u8,
        len: usize,
        status: Arc<Status>,
        deadline: Instant,
        ready: Option<Ready>,
    ) -> Result<()> {
        // SAFETY: the caller's contract is the group's: passed on, for the
        // member this view's rank `peer` is.
        unsafe { self.group.send(self.members[peer], key, data, len, status, deadline, ready) }
    }

    /// # Safety
    /// As for `Transport::recv`.
    unsafe fn recv(
        &self,
        peer: usize,
        key: Key,
        data: *mut u8,
        len: usize,
        fold: Option<Fold>,
        status: Arc<Status>,
    ) -> Result<()> {
        // SAFETY: the caller's contract is the group's: passed on, for the
        // member this view's rank `peer` is.
        unsafe { self.group.recv(self.members[peer], key, data, len, fold, status) }
    }

    unsafe fn recv_after(
        &self,
        gate: &Arc<Gate>,
        peer: usize,
        key: Key,
        buf: RecvBuf,
        status: Arc<Status>,
    ) -> Result<()> {
        // SAFETY: the caller's contract is the group's: passed on, for the
        // member this view's rank `peer` is.
        unsafe { self.group.recv_after(gate, self.members[peer], key, buf, status) }
    }

    /// Views are for collectives, whose receives name their sender.
    ///
    /// # Safety
    /// As for `Transport::recv_any` (the buffer is never touched here).
    unsafe fn recv_any(&self, _key: Key, _data: *mut u8, _len: usize, _status: Arc<Status>) -> Result<()> {
        Err(Error::invalid("rustc10d: a subgroup view takes no any-source receive"))
    }

    fn cancel_recv_any(&self, _key: Key, _status: &Arc<Status>) -> bool {
        false
    }

    fn cancel_recv(&self, peer: usize, key: Key, status: &Arc<Status>) -> bool {
        self.group.cancel_recv(self.members[peer], key, status)
    }

    fn break_peer(&self, peer: usize, reason: &Error) {
        self.group.break_peer(self.members[peer], reason)
    }

    fn abort_all(&self, reason: &Error, sent_below: u64) {
        self.group.abort_all(reason, sent_below)
    }

    fn shutdown(&self) {
        self.group.shutdown()
    }

    fn polling(&self, peer: Option<usize>) -> Option<Box<dyn Polling + '_>> {
        self.group.polling(peer.map(|p| self.members[p]))
    }

    /// Single copy is a promise about every rank of the group, which a view
    /// of fewer ranks on several hosts would not keep; a view of them all would.
    fn begin_wait(&self, wait: Wait) -> u64 {
        self.group.begin_wait(Wait { peer: self.members[wait.peer], ..wait })
    }

    fn end_wait(&self, id: u64, said: Option<String>) {
        self.group.end_wait(id, said)
    }

    fn ask(&self, peer: usize) -> Option<String> {
        self.group.ask(self.members[peer])
    }

    fn single_copy_bytes(&self) -> Option<usize> {
        self.group.single_copy_bytes().filter(|_| self.members.len() == self.group.size())
    }

    /// The arena of a view whose ranks are exactly those that map one, in
    /// its order: one host's ranks of a group on several hosts.
    fn arena(&self) -> Option<Arc<Arena>> {
        let (arena, members) = self.group.shared_arena()?;
        (members == self.members.as_slice()).then_some(arena)
    }

    fn link_kind(&self, peer: usize) -> Option<&'static str> {
        self.group.link_kind(self.members[peer])
    }

    fn host_of(&self, peer: usize) -> usize {
        self.group.host_of(self.members[peer])
    }
}
