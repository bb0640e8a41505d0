//! What every part of one group's mesh shares: the peers (each with its
//! mailbox, its state machine and its connections), the reactor, and the
//! carrying out of the peer state machine's actions. Links, the listening
//! side and the Mesh reach each other through it.

use crate::error::{Error, Result};
use crate::locks::{level, Condvar, Mutex};
use crate::status::Status;
use crate::transport::group::arena::Arena;
use crate::transport::group::waits::{ask_next, decode_answer, encode_answer, grace_at, in_turn, Waits, ASK_GRACE};
use crate::transport::links::accept::Listening;
use crate::transport::links::auth::Identity;
use crate::transport::links::conn::Conn;
use crate::transport::links::dial::Dialler;
use crate::transport::links::endpoint::PeerAddr;
use crate::transport::links::frame::{Key, ANSWER_LEN};
use crate::transport::links::link::Link;
use crate::transport::links::mailbox::{AnyPosted, Mailbox};
use crate::transport::links::mailbox::{PostedRecv, RecvBuf};
use crate::transport::links::peer::{Action, ConnId, Event, Peer};
use crate::transport::links::peer_reads::PeerReadsGrant;
use crate::transport::links::reactor::{Membership, Reactor, Token};
use crate::transport::links::striping::Striping;
use crate::transport::links::writer::SendReq;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a failed write waits for the peer's reason to give up to arrive.
const WHY_GRACE: Duration = Duration::from_millis(50);
/// How long telling a peer why this rank gives up may take.
pub const TELL_GRACE: Duration = Duration::from_millis(100);

/// What every part of the mesh shares.
pub struct Core {
    /// This rank, and the group's key it proves itself with.
    pub(in crate::transport) me: Identity,
    pub(in crate::transport) addrs: Vec<PeerAddr>,
    pub peers: Vec<PeerSlot>,
    /// Receives posted for any peer (recv with src=None).
    pub any: Mutex<level::AnyPosted, AnyPosted>,
    pub reactor: Arc<Reactor>,
    /// Keeps the reactor running until this group shuts down.
    pub(in crate::transport) membership: Mutex<level::Membership, Option<Membership>>,
    pub(in crate::transport) listeners: Mutex<level::Listeners, Vec<(Token, Arc<Listening>)>>,
    pub(in crate::transport) next_conn: AtomicU64,
    pub(in crate::transport) stopping: AtomicBool,
    pub(in crate::transport) tcp_addr: SocketAddr,
    pub(in crate::transport) ring_bytes: Option<usize>,
    /// Shared memory: messages of this many bytes or more cross in one copy (0: never).
    pub(in crate::transport) direct_from: usize,
    /// Every rank of the group reads every other's messages of at least
    /// `direct_from` bytes from the sender's memory (the rendezvous found out).
    pub(in crate::transport) single_copy_group: bool,
    /// Each rank's host (`Transport::host_of`).
    pub(in crate::transport) hosts: Vec<usize>,
    /// How long a busy shared-memory connection is polled before waiting.
    pub spin: Duration,
    /// What this rank's ops wait for, to answer a peer that asks.
    pub(in crate::transport) waits: Mutex<level::Waits, Waits>,
    /// This rank's shared arena, once it has it (arena.rs), until the group
    /// shuts down (ops still in it keep it mapped until they end).
    pub(in crate::transport) arena: Mutex<level::MeshArena, Option<Arc<Arena>>>,
    /// The ranks that map it, in its order (empty: no arena); the first
    /// makes it and hands it out.
    pub(in crate::transport) arena_members: Vec<usize>,
    /// Every host's ranks share an arena (`Transport::arena_on_every_host`).
    pub(in crate::transport) arena_on_every_host: bool,
    /// Lets peers on this host read this process's memory until shutdown.
    pub(in crate::transport) peer_reads: Mutex<level::PeerReadsGrant, Option<PeerReadsGrant>>,
    /// The channels on these connections: how many of each name this rank
    /// opened, the groups it gave up on, the arenas they leased (channel.rs).
    pub(in crate::transport) channels: Mutex<level::Channels, crate::transport::group::channel::Channels>,
}

pub struct PeerSlot {
    pub mailbox: Mutex<level::Mailbox, Mailbox>,
    pub(in crate::transport) state: Mutex<level::PeerState, PeerConns>,
    /// Notified when a connection is adopted or the peer is lost.
    pub(in crate::transport) linked: Condvar,
    pub(in crate::transport) links: Mutex<level::PeerLinks, Vec<Arc<Link>>>,
    /// Answers to the peer's questions being made now, each on a thread.
    pub(in crate::transport) answering: AtomicUsize,
}

/// What this rank knows of a peer's connections, under one lock (both are
/// pure state, and a send asks both): their life, and how many of them
/// TCP sends go on.
pub(in crate::transport) struct PeerConns {
    pub life: Peer,
    /// How many TCP connections to send on, and its measurement.
    pub striping: Striping,
}

impl PeerSlot {
    /// Bytes this rank's TCP connections to the peer hold, not yet delivered.
    pub(in crate::transport) fn unsent(&self) -> u64 {
        self.links.lock().unwrap().iter().map(|l| l.conn.unsent()).sum()
    }
}

/// The most answers to one peer's questions made at once. A rank asks a
/// peer once per wait that timed out, so more at once is a flood (32
/// bytes a question, and a thread each): the questions beyond go
/// unanswered, which an asker allows for.
const ANSWERS_AT_ONCE: usize = 4;

/// One answer being made for a peer, counted in its slot while it lives
/// (on the answer's thread, or dropped with it if none could start).
struct Answering {
    core: Arc<Core>,
    peer: usize,
}

impl Answering {
    /// None if `ANSWERS_AT_ONCE` are being made for `peer` already.
    fn start(core: &Arc<Core>, peer: usize) -> Option<Answering> {
        let before = core.peers.get(peer)?.answering.fetch_add(1, Ordering::SeqCst);
        let this = Answering { core: core.clone(), peer };
        (before < ANSWERS_AT_ONCE).then_some(this)
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.core.peers[self.peer].answering.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(in crate::transport) fn describe(addrs: &[PeerAddr], peer: usize) -> String {
    describe_as(addrs, peer, peer)
}

/// `peer`, which its group calls rank `shown`.
pub(in crate::transport) fn describe_as(addrs: &[PeerAddr], peer: usize, shown: usize) -> String {
    let a = &addrs[peer];
    match a.shm {
        Some(_) => format!("rank {shown} ({}, shared memory)", a.tcp),
        None => format!("rank {shown} ({})", a.tcp),
    }
}

impl Core {
    pub fn rank(&self) -> usize {
        self.me.rank as usize
    }

    pub fn identity(&self) -> &Identity {
        &self.me
    }

    pub fn describe(&self, peer: usize) -> String {
        describe(&self.addrs, peer)
    }

    /// Tell `peer`, which asked (`Key::ask`) at `depth`, what this rank
    /// waits for, and what the rank it waits for says in turn. On a thread
    /// of its own: asking and finding the connection take time.
    pub fn answer(self: &Arc<Self>, peer: usize, depth: u64) {
        let Some(answering) = Answering::start(self, peer) else {
            return tracing::debug!("rustc10d: rank {}: too many questions from {}", self.rank(), self.describe(peer));
        };
        let answered = std::thread::Builder::new().name("rustc10d-answer".into()).spawn(move || {
            // A panic here leaves the peer unanswered, which it allows for, and says so.
            let answer = || {
                let core = &answering.core;
                let (text, next) = {
                    let waits = core.waits.lock().unwrap();
                    (waits.answer(|p| core.describe(p)), waits.waiting_for())
                };
                let deeper = ask_next(next, peer, depth).and_then(|q| core.ask(q, depth + 1));
                let bytes = encode_answer(&in_turn(text, deeper));
                if let Ok(link) = core.lane(peer, 0, false, Instant::now() + ASK_GRACE) {
                    link.send(SendReq::owning(Key::answer(), bytes));
                }
            };
            if let Err(e) = crate::panics::contain("answering what this rank waits for", answer) {
                tracing::error!("{}", e.message);
            }
        });
        // Without a thread the peer goes unanswered, which it allows for.
        drop(answered);
    }

    /// Ask `peer` what it waits for, as the rank asked at `depth - 1` (0:
    /// this rank timed out waiting for it): its answer, or why it gave up on
    /// the group if it has; None if it does not say in time.
    pub fn ask(self: &Arc<Self>, peer: usize, depth: u64) -> Option<String> {
        let grace = grace_at(depth);
        let deadline = Instant::now() + grace;
        let mut answer = vec![0u8; ANSWER_LEN];
        let got = Status::new();
        let recv = PostedRecv {
            buf: RecvBuf { ptr: answer.as_mut_ptr(), len: ANSWER_LEN, fold: None },
            status: got.clone(),
            any_source: None,
        };
        // A peer that gave up has said why: that is its answer.
        let mut mailbox = self.peers.get(peer)?.mailbox.lock().unwrap();
        if let Some(why) = mailbox.closed() {
            return Some(why.message.clone());
        }
        mailbox.post(Key::answer(), recv);
        drop(mailbox);
        self.resume(peer);
        let asked = self.lane(peer, 0, false, deadline);
        let asked = asked.map(|link| link.send(SendReq::new(Key::ask(depth), [].as_ptr(), 0, Status::new(), None)));
        let answered = asked.ok().and_then(|()| got.wait(Some(deadline), Duration::ZERO));
        let withdrawn = || self.peers[peer].mailbox.lock().unwrap().cancel(Key::answer(), &got);
        if answered.is_none() && !withdrawn() && got.wait(Some(deadline + grace), Duration::ZERO).is_none() {
            // Still being filled: the buffer must outlive it.
            std::mem::forget(answer);
            return None;
        }
        match answered? {
            Ok(_) => Some(decode_answer(&answer)),
            // It gave up meanwhile, and said why.
            Err(why) => Some(why.message),
        }
    }

    /// The connection to send to `peer` on (`lane` picks one of several:
    /// `spread` sends go over as many TCP connections as the peer's striping
    /// says, others take the first), dialling the peer first, or more
    /// connections to it where there are too few.
    pub(in crate::transport) fn lane(
        self: &Arc<Self>,
        peer: usize,
        lane: usize,
        spread: bool,
        deadline: Instant,
    ) -> Result<Arc<Link>> {
        if peer == self.rank() || peer >= self.peers.len() {
            return Err(Error::invalid(format!("rank {} cannot send to rank {peer}", self.rank())));
        }
        let slot = &self.peers[peer];
        let shm = match (&self.addrs[peer].shm, self.ring_bytes) {
            (Some(name), Some(ring_bytes)) => Some((name, ring_bytes)),
            _ => None,
        };
        let want = if spread && shm.is_none() { slot.state.lock().unwrap().striping.lanes() } else { 1 };
        let mut dialled = false;
        loop {
            let have = {
                let state = &mut slot.state.lock().unwrap().life;
                if let Some(err) = state.lost() {
                    return Err(err.clone());
                }
                if (1..want).contains(&state.lanes().len()) {
                    state.on(Event::Widen { lanes: want }, false);
                }
                let lanes = state.lanes();
                // After one round of dialling, take what there is: a
                // connection another thread dialled meanwhile may have
                // become read-only, and one lane is enough to go on with.
                if !lanes.is_empty() && (lanes.len() >= want || dialled) {
                    let id = lanes[lane % want.min(lanes.len())];
                    let links = slot.links.lock().unwrap();
                    if let Some(l) = links.iter().find(|l| l.id == id) {
                        return Ok(l.clone());
                    }
                }
                lanes.len()
            };
            let dialler = Dialler { me: &self.me, peer, name: self.describe(peer), deadline };
            // No more attempts once the connections are shutting down or the
            // peer is known lost: the op has failed.
            let lost = || slot.state.lock().unwrap().life.lost().cloned();
            let stopping = || self.stopping.load(Ordering::SeqCst) || lost().is_some();
            // A peer lost meanwhile (it gave up, and said why on a connection
            // it had dialled) is why the dial failed: say that, not the dial's error.
            let why = |e: Error| lost().unwrap_or(e);
            match shm {
                Some((name, ring_bytes)) => {
                    let lead = self.arena_to_hand_out();
                    let lead_fd = lead.as_ref().and_then(|a| a.fd());
                    let (conn, arena) =
                        dialler.shm(name, ring_bytes, self.direct_from, lead_fd, stopping).map_err(why)?;
                    if let Some(fd) = arena {
                        self.take_arena(peer, fd)?;
                    }
                    self.adopt(peer, conn);
                }
                None => {
                    for _ in have..want.max(1) {
                        let conn = dialler.tcp(self.addrs[peer].tcp, stopping).map_err(why)?;
                        self.adopt(peer, conn);
                    }
                }
            }
            dialled = true;
        }
    }

    /// The rank that makes this rank's arena and hands it out, if it has one.
    pub(in crate::transport) fn arena_leader(&self) -> Option<usize> {
        self.arena_members.first().copied()
    }

    /// The arena, on the rank that hands it out (`Arena::fd`).
    pub(in crate::transport) fn arena_to_hand_out(&self) -> Option<Arc<Arena>> {
        self.arena.lock().unwrap().clone().filter(|_| self.arena_leader() == Some(self.rank()))
    }

    /// Map the arena `peer` sent with its shared-memory connection; only
    /// the rank that makes it hands it out (anything else is dropped).
    pub(in crate::transport) fn take_arena(&self, peer: usize, fd: OwnedFd) -> Result<()> {
        if self.arena_leader() != Some(peer) {
            tracing::warn!(
                "rustc10d: rank {}: {} sent an arena it does not hand out",
                self.rank(),
                self.describe(peer)
            );
            return Ok(());
        }
        let mut mine = self.arena.lock().unwrap();
        if mine.is_none() && !self.stopping.load(Ordering::SeqCst) {
            let members = &self.arena_members;
            let at = members.iter().position(|&r| r == self.rank()).expect("a rank that joins an arena maps it");
            *mine = Some(Arc::new(Arena::open(&fd, at, members.len())?));
        }
        Ok(())
    }

    /// Fail every round of the arena, now and later (ranks waiting in it wake).
    pub(in crate::transport) fn abort_arena(&self, reason: &str) {
        if let Some(arena) = &*self.arena.lock().unwrap() {
            arena.abort(reason);
        }
    }

    /// Take a connection that passed its handshake into service.
    pub fn adopt(self: &Arc<Self>, peer: usize, conn: Conn) {
        let id = self.next_conn.fetch_add(1, Ordering::SeqCst);
        let lanes = if conn.is_shm() { 1 } else { self.peers[peer].state.lock().unwrap().striping.lanes() };
        if self.stopping.load(Ordering::SeqCst) {
            return conn.shutdown();
        }
        // Adopted before it reads, so that its end always comes after.
        let link = Link::new(self, id, peer, conn);
        let first = {
            let mut links = self.peers[peer].links.lock().unwrap();
            links.push(link.clone());
            links.len() == 1
        };
        self.peer_event(peer, Event::Adopted { conn: id, lanes });
        if self.link(peer, id).is_some() {
            if let Err(e) = link.start() {
                let error = Error::peer_lost(format!("lost connection to {}: {}", self.describe(peer), e.message));
                self.peer_event(peer, Event::Ended { conn: id, error: Some(error) });
            } else if first {
                // Groups this rank gave up on before it had a connection to the peer.
                for told in self.told_late(peer) {
                    link.send(told);
                }
            }
        }
    }

    /// Feed the peer's state machine and carry out what it says.
    pub fn peer_event(self: &Arc<Self>, peer: usize, event: Event) {
        let slot = &self.peers[peer];
        let ended = match &event {
            Event::Reason { conn, .. } | Event::Ended { conn, .. } => Some(*conn),
            _ => None,
        };
        // A group's failure closes its channel alone (`tell_group_abort`):
        // the connections are given up on only when they shut down.
        let shut = self.stopping.load(Ordering::SeqCst);
        let actions = slot.state.lock().unwrap().life.on(event, shut);
        let take = |conn: ConnId| {
            let mut links = slot.links.lock().unwrap();
            links.iter().position(|l| l.id == conn).map(|i| links.remove(i))
        };
        // Links that ended or are closed now: their queued sends fail, with the peer's loss if it is lost.
        let mut closed: Vec<Arc<Link>> = ended.and_then(take).into_iter().collect();
        // Ranks waiting in the arena learn of a loss at once, not at their
        // deadline, and from this rank before any connection closes: else a
        // peer that sees the close first writes only "rank N closed its
        // connection" there, and the reason is lost for every rank.
        if let Some(Action::Lost(err)) = actions.iter().find(|a| matches!(a, Action::Lost(_))) {
            if !self.stopping.load(Ordering::SeqCst) {
                let why = format!("rank {}: {}", self.rank(), err.message);
                self.abort_arena(&why);
                // And the arenas of the groups on these connections that it
                // was in: before, their ranks waited there for their timeout.
                let leased = self.channels.lock().unwrap().arenas_with(peer);
                leased.iter().for_each(|arena| arena.abort(&why));
                // A group destroyed meanwhile leaves these the last holders:
                // dropping its arena gives the lease back, which may wait for
                // the host's table lock, not a wait for the I/O thread.
                if !leased.is_empty() {
                    let _ = self.reactor.run_blocking(Box::new(move || drop(leased)));
                }
            }
        }
        let mut lost = None;
        for action in actions {
            match action {
                Action::Send(_) => {}
                Action::TellWhy(conn) => {
                    if let Some(l) = self.link(peer, conn) {
                        l.tell(b"the process group was shut down", TELL_GRACE);
                    }
                }
                Action::Close(conn) => {
                    // Shut down by `Link::close` below, once the receive it
                    // may be filling has failed with the reason: a reader
                    // that saw the shutdown first would fail it with "end of file".
                    if let Some(link) = take(conn) {
                        closed.push(link);
                    }
                }
                Action::Lost(err) => {
                    let waiting =
                        slot.mailbox.lock().unwrap().close(err.clone()) + self.any.lock().unwrap().fail_all(&err);
                    // A peer that closes while we expect nothing from it has just left the group.
                    if !self.stopping.load(Ordering::SeqCst) {
                        if waiting > 0 {
                            tracing::warn!("rustc10d: rank {}: {}", self.rank(), err.message);
                        } else {
                            tracing::debug!("rustc10d: rank {}: {}", self.rank(), err.message);
                        }
                    }
                    lost = Some(err);
                }
                Action::Await(error) => {
                    let core = self.clone();
                    self.reactor.after(WHY_GRACE, Box::new(move || core.peer_event(peer, Event::Awaited { error })));
                }
            }
        }
        let reason =
            lost.unwrap_or_else(|| Error::peer_lost(format!("the connection to {} was closed", self.describe(peer))));
        for link in closed {
            link.close(&reason);
        }
        slot.linked.notify_all();
    }

    pub(in crate::transport) fn link(&self, peer: usize, conn: ConnId) -> Option<Arc<Link>> {
        self.peers[peer].links.lock().unwrap().iter().find(|l| l.id == conn).cloned()
    }

    pub(in crate::transport) fn wait_linked(&self, peer: usize, deadline: Instant) -> Result<()> {
        let slot = &self.peers[peer];
        let mut state = slot.state.lock().unwrap();
        while !state.life.is_linked() {
            if let Some(e) = state.life.lost() {
                return Err(e.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(format!(
                    "rustc10d: Timed out: rank {} was waiting for {} to connect",
                    self.rank(),
                    self.describe(peer)
                )));
            }
            state = slot.linked.wait_timeout(state, deadline - now).unwrap().0;
        }
        Ok(())
    }

    /// `failed`, the error of a step of this rank's join that needed `peer`,
    /// unless the peer said why it gave up on the group: then it had joined
    /// (a rank gives up only in an op), and this rank joins too, with the
    /// peer lost. The group is broken on every rank alike, and this rank's
    /// first op that needs the peer fails with its reason, as the peers' ops
    /// did; failing the join instead would leave this rank without a group
    /// that its peers have, out of step with them from then on.
    pub(in crate::transport) fn unless_it_joined_and_gave_up(&self, peer: usize, failed: Error) -> Result<()> {
        if self.peers[peer].state.lock().unwrap().life.said_why() {
            tracing::debug!(
                "rustc10d: rank {} joins a group {} gave up on: {}",
                self.rank(),
                self.describe(peer),
                failed
            );
            return Ok(());
        }
        Err(failed)
    }

    /// Go on reading a peer's connections that wait for a receive.
    pub(in crate::transport) fn resume(&self, peer: usize) {
        let paused: Vec<_> = self.peers[peer].links.lock().unwrap().iter().filter(|l| l.is_paused()).cloned().collect();
        for link in paused {
            self.reactor.defer(Box::new(move || link.resume()));
        }
    }

    pub(in crate::transport) fn give_up(self: &Arc<Self>, peer: usize, why: &Error) {
        self.peer_event(peer, Event::GiveUp { why: why.clone() });
    }

    pub(in crate::transport) fn shutdown(self: &Arc<Self>) {
        if self.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        self.abort_arena(&format!("rank {} shut the process group down", self.rank()));
        drop(self.arena.lock().unwrap().take());
        let listeners: Vec<_> = self.listeners.lock().unwrap().drain(..).collect();
        for (token, listening) in listeners {
            self.reactor.deregister(token, listening.listener.fd());
            // Strangers' connections close now, not at their timeout.
            listening.drop_handshakes(self);
        }
        let err = Error::aborted("rustc10d: the process group was shut down");
        for peer in (0..self.peers.len()).filter(|&p| p != self.rank()) {
            self.give_up(peer, &err);
        }
        drop(self.membership.lock().unwrap().take());
        // The last group that needed it closes this process to its user's other processes.
        drop(self.peer_reads.lock().unwrap().take());
    }
}
