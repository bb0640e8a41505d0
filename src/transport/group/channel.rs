//! `Channel`: a group that sends over another group's connections instead of
//! opening its own (issue #31). A process keeps one set of connections per
//! peer process, owned by the group that opened them (the default group's
//! `Mesh`); every group made from it (torch's new_group, split_group) is a
//! channel there: its frames carry the channel's number, and each peer's
//! mailbox matches them apart from every other group's. A channel has its
//! own ordering (its engine's sequence numbers), matching, waits, call check
//! and failure: a member that gives up on it tells the others (the abort
//! says from which collective on it may not have sent everything: messages
//! of earlier ones still count) and closes it, for that member, and no other
//! group; the owner gives up on its channel 0 the same way. What fails a
//! connection (a peer lost, a transfer cut) fails every group on it.
//!
//! Members agree on a channel's number without a message: it is a hash of
//! the group's name (the same on every member; torch's) and of how many
//! channels of that name this rank has opened before (the same on every
//! member too, as each opens every group it is in, in the same order). A
//! number is never opened twice in a process (of the last `NUMBERS_KEPT`
//! opened: an older one comes back only by a collision of 64-bit hashes),
//! so a closed channel's late messages are dropped, never taken for a new
//! group's. What a process keeps per group it ever made is bounded (issue
//! #42, item 3): the numbers, the groups it gave up on, and each mailbox's
//! closed groups are the most recent so many; only the count of channels
//! per name stays, as every member's numbering rests on it.

use crate::error::{Error, Result};
use crate::locks::{level, Mutex};
use crate::status::{Polling, Status};
use crate::transport::group::arena::Arena;
use crate::transport::group::waits::Wait;
use crate::transport::links::frame::{Key, ABORT_MAX};
use crate::transport::links::mailbox::{RecvBuf, Sources};
use crate::transport::links::mesh_core::{describe_as, Core};
use crate::transport::links::writer::SendReq;
use crate::transport::{Fold, Gate, Ready, Transport};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// The channels a process's connections carry (`Core::channels`). Its lock
/// is taken alone: nothing else is locked while it is held (the I/O thread
/// takes it too, when a peer is lost), nor is it taken under another lock.
#[derive(Default)]
pub struct Channels {
    /// How many channels of each name this rank has opened.
    opened: HashMap<String, u64>,
    /// The last `NUMBERS_KEPT` numbers opened (`numbers_order` oldest first).
    numbers: HashSet<u64>,
    numbers_order: VecDeque<u64>,
    /// The last `GIVEN_UP_KEPT` groups this rank gave up on, and what it
    /// told their members: a member it had no connection to then is told
    /// once it has one (`told_late`).
    given_up: VecDeque<GivenUp>,
    /// Channels open now. The connections close with the last group on
    /// them: the owner, once it has shut down (`owner_shut`), or the last
    /// channel after it.
    live: usize,
    owner_shut: bool,
    /// The arenas that groups on these connections leased, with their
    /// members (the connections' ranks): a member lost fails its groups'
    /// rounds there at once, as it fails their messages (`arenas_with`).
    /// Pruned of those that have ended whenever one is added.
    leased: Vec<(Arc<[usize]>, Weak<Arena>)>,
}

/// How many numbers opened a process remembers, to refuse one opened again.
const NUMBERS_KEPT: usize = 4 * crate::transport::links::mailbox::CLOSED_KEPT;
/// How many groups given up on a process remembers, to tell members that connect later.
const GIVEN_UP_KEPT: usize = crate::transport::links::mailbox::CLOSED_KEPT;

struct GivenUp {
    key: Key,
    why: Vec<u8>,
    /// The group's members, as the connections' ranks.
    members: Arc<[usize]>,
}

impl Channels {
    /// The arenas of live groups that have `peer` among their members.
    pub(in crate::transport) fn arenas_with(&self, peer: usize) -> Vec<Arc<Arena>> {
        let with = self.leased.iter().filter(|(members, _)| members.contains(&peer));
        with.filter_map(|(_, arena)| arena.upgrade()).collect()
    }

    fn lease_taken(&mut self, members: Arc<[usize]>, arena: &Arc<Arena>) {
        self.leased.retain(|(_, a)| a.strong_count() > 0);
        self.leased.push((members, Arc::downgrade(arena)));
    }

    /// The owner shuts down: true if the connections are its alone now, to
    /// close; else the last channel closes them.
    pub(in crate::transport) fn owner_shuts(&mut self) -> bool {
        self.owner_shut = true;
        self.live == 0
    }
}

impl Core {
    /// Tell `members` (the connections' ranks) that this rank gives up on
    /// group `group` having sent all of its collectives below `sent_below`
    /// (`Transport::abort_all`), in a frame of that group's channel: the
    /// connections stay, for the other groups. A member with no connection
    /// yet is told when it connects.
    pub(in crate::transport) fn tell_group_abort(
        &self,
        group: u64,
        members: Arc<[usize]>,
        sent_below: u64,
        why: &Error,
    ) {
        let told = GivenUp { key: Key::group_abort(group, sent_below), why: abort_text(why), members };
        let (key, why, members) = (told.key, told.why.clone(), told.members.clone());
        // Recorded first: a connection adopted meanwhile finds it there (or
        // is found below; told twice, the peer closes the channel once).
        let mut channels = self.channels.lock().unwrap();
        channels.given_up.push_back(told);
        if channels.given_up.len() > GIVEN_UP_KEPT {
            channels.given_up.pop_front();
        }
        drop(channels);
        self.tell_members(key, &members, &why);
    }

    /// Tell `members` that this rank leaves group `group` (torch destroys
    /// it), having sent every message of its collectives below
    /// `sent_below` and of its point-to-point ops (`Transport::leave`).
    /// Only members it has a connection to are told: one it has none to
    /// was sent nothing and waits for nothing that went. Each is told on
    /// the connection point-to-point sends take (its first lane, see
    /// `lane`), behind them: the peer then knows that no more of the
    /// group's point-to-point messages come (`Mailbox::peer_destroyed_group`).
    pub(in crate::transport) fn tell_group_leave(&self, group: u64, members: &[usize], sent_below: u64, why: &Error) {
        self.tell_members(Key::group_leave(group, sent_below), members, &abort_text(why));
    }

    /// Send frame `key` with `why` to each of `members` but this rank, on
    /// the connection point-to-point sends to it take (its first lane, see
    /// `lane`), where it has one.
    fn tell_members(&self, key: Key, members: &[usize], why: &[u8]) {
        for &p in members.iter().filter(|&&p| p != self.rank()) {
            let first_lane = self.peers[p].state.lock().unwrap().life.lanes().first().copied();
            if let Some(link) = first_lane.and_then(|conn| self.link(p, conn)) {
                link.send(SendReq::owning(key, why.to_vec()));
            }
        }
    }

    /// What the process keeps about groups (`Transport::retained`).
    pub(in crate::transport) fn retained(&self) -> crate::transport::Retained {
        let (mut closed, mut early_bytes) = (0, 0);
        for p in &self.peers {
            let mailbox = p.mailbox.lock().unwrap();
            closed += mailbox.closed_groups();
            early_bytes += mailbox.early_bytes();
        }
        let channels = self.channels.lock().unwrap();
        crate::transport::Retained {
            closed,
            numbers: channels.numbers.len(),
            given_up: channels.given_up.len(),
            names: channels.opened.len(),
            early_bytes,
        }
    }

    /// What this rank told the groups it gave up on that `peer` is in, for
    /// its first connection: it may have had none then.
    pub(in crate::transport) fn told_late(&self, peer: usize) -> Vec<SendReq> {
        let channels = self.channels.lock().unwrap();
        let of_peer = channels.given_up.iter().filter(|g| g.members.contains(&peer));
        of_peer.map(|g| SendReq::owning(g.key, g.why.clone())).collect()
    }
}

pub struct Channel {
    core: Arc<Core>,
    /// Its number in frames (never 0: that is the owner's).
    group: u64,
    /// The owner's rank of each member, rank i of this group first.
    members: Arc<[usize]>,
    /// This rank's place in `members`.
    me: usize,
    /// Each member's host, numbered in the order of their lowest rank here.
    hosts: Vec<usize>,
    /// The arena every member maps, where they all run on one host
    /// (arena_pool.rs), until the channel shuts down: ops still in it hold
    /// their own, and the last one out gives the lease back.
    arena: Mutex<level::ChannelArena, Option<Arc<Arena>>>,
    /// 0..size: the arena's members, in its order.
    everyone: Vec<usize>,
    shut: AtomicBool,
}

/// The reason an abort or leave frame carries: `why`'s message, cut to ABORT_MAX bytes.
fn abort_text(why: &Error) -> Vec<u8> {
    let why = why.message.as_bytes();
    why[..why.len().min(ABORT_MAX as usize)].to_vec()
}

/// FNV-1a of `bytes`.
fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// A channel's number: a hash of its name and how many of that name came before.
fn number(name: &str, nth: u64) -> u64 {
    fnv1a(name.bytes().chain([0]).chain(nth.to_le_bytes())).max(1)
}

/// The key of a channel's arena in its host's pool: its number and its
/// members (torch names the halves of a split alike; their members differ).
fn lease_key(group: u64, members: &[usize]) -> u64 {
    fnv1a(group.to_le_bytes().into_iter().chain(members.iter().flat_map(|&r| (r as u64).to_le_bytes())))
}

impl Channel {
    /// Open the channel of group `name` whose rank i is the owner's rank
    /// `members[i]`; members on one host lease an arena (waiting for the
    /// pool's lock at most `timeout`).
    pub(in crate::transport) fn open(
        core: &Arc<Core>,
        name: &str,
        members: Vec<usize>,
        timeout: Duration,
    ) -> Result<Arc<Channel>> {
        let size = core.peers.len();
        let mut seen = HashSet::new();
        if let Some(&bad) = members.iter().find(|&&r| r >= size || !seen.insert(r)) {
            return Err(Error::invalid(format!(
                "rustc10d: a group's ranks must be distinct ranks of a group of {size}: got {bad} in {members:?}"
            )));
        }
        let Some(me) = members.iter().position(|&r| r == core.rank()) else {
            return Err(Error::invalid(format!("rustc10d: rank {} is not in the group {members:?}", core.rank())));
        };
        if core.stopping.load(Ordering::SeqCst) {
            return Err(Error::aborted(format!(
                "rustc10d: group {name:?} cannot share the connections of a process group that was shut down \
                 (pg_options=rustc10d.Options(share_connections=False) gives a group connections of its own)"
            )));
        }
        let group = {
            let mut channels = core.channels.lock().unwrap();
            let nth = channels.opened.entry(name.to_string()).or_default();
            let group = number(name, *nth);
            *nth += 1;
            if !channels.numbers.insert(group) {
                return Err(Error::invalid(format!(
                    "rustc10d: group {name:?} hashes to the number of a group opened before ({group:#x}); \
                     give it another name"
                )));
            }
            channels.numbers_order.push_back(group);
            if channels.numbers_order.len() > NUMBERS_KEPT {
                let oldest = channels.numbers_order.pop_front().expect("more than NUMBERS_KEPT");
                channels.numbers.remove(&oldest);
            }
            // Counted from here: the Channel made below, dropped on any
            // failure, counts itself out (`shutdown`).
            channels.live += 1;
            group
        };
        let mut first_seen = HashMap::new();
        let hosts = members.iter().map(|&r| {
            let n = first_seen.len();
            *first_seen.entry(core.hosts[r]).or_insert(n)
        });
        let hosts: Vec<usize> = hosts.collect();
        // Members on one host, which has an arena with a pool, lease theirs
        // there: every member maps the pool already, since init.
        let one_host = hosts.iter().all(|&h| h == 0);
        let pool = core.arena.lock().unwrap().as_ref().and_then(|a| a.pool().cloned());
        let pool = pool.filter(|_| members.len() > 1 && one_host);
        let key = lease_key(group, &members);
        let everyone = (0..members.len()).collect();
        let channel = Arc::new(Channel {
            core: core.clone(),
            group,
            members: members.into(),
            me,
            hosts,
            arena: Mutex::new(None),
            everyone,
            shut: AtomicBool::new(false),
        });
        // The members as ranks of the host (slots of its arena), which the
        // pool records to know whose process has ended.
        let slots: Option<Vec<usize>> =
            channel.members.iter().map(|r| core.arena_members.iter().position(|a| a == r)).collect();
        if let (Some(pool), Some(slots)) = (pool, slots) {
            let leased = pool
                .lease(key, &slots, me, Instant::now() + timeout)
                .map_err(|e| e.context(format_args!("rustc10d: group {name:?} could not start")))?;
            if let Some(arena) = leased {
                let arena = Arc::new(arena);
                core.channels.lock().unwrap().lease_taken(channel.members.clone(), &arena);
                *channel.arena.lock().unwrap() = Some(arena);
            }
        }
        Ok(channel)
    }

    /// The other members, as the owner's ranks.
    fn others(&self) -> Vec<usize> {
        self.members.iter().copied().filter(|&r| r != self.core.rank()).collect()
    }

    /// Close the channel on this rank: its receives fail with `why`, now and
    /// later, and its messages are dropped from now on.
    fn close(&self, why: &Error) {
        if let Some(arena) = &*self.arena.lock().unwrap() {
            arena.abort(&format!("rank {}: {}", self.me, why.message));
        }
        for p in self.others() {
            self.core.peers[p].mailbox.lock().unwrap().close_group(self.group, why.clone());
        }
        self.core.any.lock().unwrap().fail_group(self.group, why);
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Transport for Channel {
    fn rank(&self) -> usize {
        self.me
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn describe_peer(&self, peer: usize) -> String {
        describe_as(&self.core.addrs, self.members[peer], peer)
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
        let (peer, key) = (self.members[peer], key.in_group(self.group));
        // SAFETY: the caller's contract, passed on.
        unsafe { self.core.send_to(peer, key, data, len, status, deadline, ready) }
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
        let (peer, key) = (self.members[peer], key.in_group(self.group));
        // SAFETY: the caller's contract, passed on.
        unsafe { self.core.recv_from(peer, key, data, len, fold, status) };
        Ok(())
    }

    unsafe fn recv_after(
        &self,
        gate: &Arc<Gate>,
        peer: usize,
        key: Key,
        buf: RecvBuf,
        status: Arc<Status>,
    ) -> Result<()> {
        let (peer, key) = (self.members[peer], key.in_group(self.group));
        // SAFETY: the caller's contract, passed on.
        unsafe { self.core.recv_from_after(gate, peer, key, buf, status) };
        Ok(())
    }

    /// # Safety
    /// As for `Transport::recv_any`.
    unsafe fn recv_any(&self, key: Key, data: *mut u8, len: usize, status: Arc<Status>) -> Result<()> {
        let sources = Sources::Members(self.members.clone());
        // SAFETY: the caller's contract, passed on.
        unsafe { self.core.recv_from_any(&self.others(), sources, key.in_group(self.group), data, len, status) };
        Ok(())
    }

    fn cancel_recv_any(&self, key: Key, status: &Arc<Status>) -> bool {
        self.core.any.lock().unwrap().remove(key.in_group(self.group), status).is_some()
    }

    fn cancel_recv(&self, peer: usize, key: Key, status: &Arc<Status>) -> bool {
        let mailbox = &self.core.peers[self.members[peer]].mailbox;
        mailbox.lock().unwrap().cancel(key.in_group(self.group), status)
    }

    fn polling(&self, peer: Option<usize>) -> Option<Box<dyn Polling + '_>> {
        match peer {
            Some(p) => Some(self.core.polling_of(std::iter::once(*self.members.get(p)?))),
            None => Some(self.core.polling_of(self.others().into_iter())),
        }
    }

    /// Cuts the connections to the peer, which every group on them shares:
    /// only for a transfer that cannot be withdrawn otherwise.
    fn break_peer(&self, peer: usize, reason: &Error) {
        self.core.give_up(self.members[peer], reason);
    }

    /// Tells each member this rank has a connection to why it gives up on
    /// the group, in the channel (the connections stay), then closes it here.
    /// The frame carries `sent_below`: the peer still takes the messages of
    /// earlier collectives, which may come after it on another lane.
    fn abort_all(&self, reason: &Error, sent_below: u64) {
        self.core.tell_group_abort(self.group, self.members.clone(), sent_below, reason);
        self.close(reason);
    }

    /// Tells each member this rank has a connection to that it leaves the
    /// group, then shuts the channel down.
    fn leave(&self, sent_below: u64) {
        if !self.shut.load(Ordering::SeqCst) {
            let why = Error::aborted(format!("rustc10d: rank {} destroyed the process group", self.me));
            self.core.tell_group_leave(self.group, &self.members, sent_below, &why);
        }
        self.shutdown();
    }

    /// Closes the channel here; the last group on the connections, once
    /// their owner has shut down, closes them.
    fn shutdown(&self) {
        if self.shut.swap(true, Ordering::SeqCst) {
            return;
        }
        self.close(&Error::aborted("rustc10d: the process group was shut down"));
        // Given back outside the channel's lock (the pool's is taken then).
        let arena = self.arena.lock().unwrap().take();
        drop(arena);
        let last = {
            let mut channels = self.core.channels.lock().unwrap();
            channels.live -= 1;
            channels.live == 0 && channels.owner_shut
        };
        if last {
            self.core.shutdown();
        }
    }

    fn connections_outlive_failure(&self) -> bool {
        !self.core.stopping.load(Ordering::SeqCst)
    }

    fn single_copy_bytes(&self) -> Option<usize> {
        self.core.single_copy_group.then_some(self.core.direct_from)
    }

    fn shared_arena(&self) -> Option<(Arc<Arena>, &[usize])> {
        Some((self.arena.lock().unwrap().clone()?, &self.everyone))
    }

    fn link_kind(&self, peer: usize) -> Option<&'static str> {
        self.core.link_kind_of(*self.members.get(peer)?)
    }

    fn lanes(&self, peer: usize) -> usize {
        self.members.get(peer).map_or(0, |&p| self.core.lanes_of(p))
    }

    fn lanes_settled(&self, peer: usize) -> bool {
        self.members.get(peer).is_none_or(|&p| self.core.lanes_settled_of(p))
    }

    fn retained(&self) -> crate::transport::Retained {
        self.core.retained()
    }

    fn host_of(&self, peer: usize) -> usize {
        self.hosts[peer]
    }

    /// Noted among the process's waits by the owner's rank of the peer: a
    /// rank that asks is told, and asks on in turn, by the connections' ranks.
    fn begin_wait(&self, wait: Wait) -> u64 {
        let peer = self.members.get(wait.peer).copied().unwrap_or(wait.peer);
        self.core.waits.lock().unwrap().begin(Wait { peer, ..wait })
    }

    fn end_wait(&self, id: u64, said: Option<String>) {
        self.core.waits.lock().unwrap().end(id, said)
    }

    fn ask(&self, peer: usize) -> Option<String> {
        self.core.ask(*self.members.get(peer)?, 0)
    }

    fn open_channel(&self, name: &str, members: &[usize], timeout: Duration) -> Option<Result<Arc<dyn Transport>>> {
        let Some(owners) = members.iter().map(|&r| self.members.get(r).copied()).collect::<Option<Vec<_>>>() else {
            let size = self.members.len();
            return Some(Err(Error::invalid(format!("rustc10d: ranks {members:?} are not all in a group of {size}"))));
        };
        Some(Channel::open(&self.core, name, owners, timeout).map(|c| c as Arc<dyn Transport>))
    }
}

#[cfg(test)]
mod tests {
    use super::number;

    #[test]
    fn numbers_differ_by_name_and_by_turn_and_are_never_the_owners() {
        let all = [number("1", 0), number("1", 1), number("2", 0), number("", 0), number("10", 0)];
        let distinct: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len());
        assert!(all.iter().all(|&n| n != 0));
        assert_eq!(number("1", 0), number("1", 0), "the same on every member");
    }
}
