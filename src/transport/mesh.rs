//! `Mesh`: the Transport of one group. Connections to a peer open lazily,
//! when a rank first sends to it (dial.rs; the listening side is accept.rs):
//! shared memory to a peer on this host, TCP to the others. Every connection
//! is a Link served by the process's one reactor; what happens to a peer as
//! connections come and go is decided by its state machine (peer.rs), whose
//! actions are carried out here.

use super::accept::{Listener, Listening};
use super::conn::Conn;
use super::dial::Dialler;
use super::frame::{Hello, Key, ABORT_MAX, KIND_P2P};
use super::link::Link;
use super::mailbox::{AnyPosted, Fold, Mailbox, PostedRecv, RecvBuf};
use super::peer::{Action, ConnId, Event, Peer};
use super::reactor::{Membership, Reactor, Token, READABLE};
use super::writer::SendReq;
use super::{Ready, Transport};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::status::{Polling, Status};
use std::net::{SocketAddr, TcpListener};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a failed write waits for the peer's reason to give up to arrive.
const WHY_GRACE: Duration = Duration::from_millis(50);
/// How long telling a peer why this rank gives up may take.
const TELL_GRACE: Duration = Duration::from_millis(100);

pub struct Mesh {
    core: Arc<Core>,
}

/// Where a peer listens.
#[derive(Debug, Clone)]
pub struct PeerAddr {
    pub tcp: SocketAddr,
    /// The abstract Unix socket name to reach it through shared memory, for
    /// a peer on this host; None: over TCP.
    pub shm: Option<String>,
}

/// This rank's end for shared-memory peers: a Unix socket in the abstract
/// namespace (nothing on disk), where peers hand over their segments.
pub struct ShmEndpoint {
    pub listener: UnixListener,
    pub ring_bytes: usize,
}

impl ShmEndpoint {
    /// Listen under a fresh random name; the name goes to peers via the Store.
    /// The segments this rank creates have rings of `ring_bytes`.
    pub fn bind(ring_bytes: usize) -> Result<(ShmEndpoint, String)> {
        let mut r = [0u8; 16];
        if unsafe { libc::getrandom(r.as_mut_ptr().cast(), r.len(), 0) } != r.len() as isize {
            return Err(Error::io("rustc10d: getrandom failed"));
        }
        let name = format!("rustc10d-{}", r.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io(e.to_string()))?;
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| Error::io(format!("rustc10d: cannot listen on a Unix socket: {e}")))?;
        Ok((ShmEndpoint { listener, ring_bytes }, name))
    }
}

/// What every part of the mesh shares.
pub struct Core {
    me: Hello,
    addrs: Vec<PeerAddr>,
    pub peers: Vec<PeerSlot>,
    /// Receives posted for any peer (recv with src=None).
    pub any: Mutex<AnyPosted>,
    pub reactor: Arc<Reactor>,
    /// Keeps the reactor running until this group shuts down.
    membership: Mutex<Option<Membership>>,
    pub handshakes: AtomicUsize,
    listeners: Mutex<Vec<(Token, Arc<Listening>)>>,
    next_conn: AtomicU64,
    stopping: AtomicBool,
    /// Why this rank gave up on the group (what it tells peers), once it has.
    gave_up: Mutex<Option<Vec<u8>>>,
    tcp_addr: SocketAddr,
    ring_bytes: Option<usize>,
    nsocks: usize,
    /// How long a busy shared-memory connection is polled before waiting.
    pub spin: Duration,
}

pub struct PeerSlot {
    pub mailbox: Mutex<Mailbox>,
    state: Mutex<Peer>,
    /// Notified when a connection is adopted or the peer is lost.
    linked: Condvar,
    links: Mutex<Vec<Arc<Link>>>,
}

impl Mesh {
    /// Start listening, connect to `eager` peers and wait until each of
    /// `expect` has connected to us, all before `deadline`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        listener: TcpListener,
        local: Option<ShmEndpoint>,
        me: Hello,
        addrs: Vec<PeerAddr>,
        cfg: &Config,
        eager: &[usize],
        expect: &[usize],
        deadline: Instant,
    ) -> Result<Mesh> {
        let (reactor, membership) = Reactor::join()?;
        let tcp_addr = listener.local_addr().map_err(|e| Error::io(e.to_string()))?;
        let peers = (0..addrs.len())
            .map(|p| PeerSlot {
                mailbox: Mutex::new(Mailbox::new(p)),
                state: Mutex::new(Peer::new(describe(&addrs, p))),
                linked: Condvar::new(),
                links: Mutex::default(),
            })
            .collect();
        let core = Arc::new(Core {
            me,
            addrs,
            peers,
            any: Mutex::default(),
            reactor,
            membership: Mutex::new(Some(membership)),
            handshakes: AtomicUsize::new(0),
            listeners: Mutex::default(),
            next_conn: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            gave_up: Mutex::new(None),
            tcp_addr,
            ring_bytes: local.as_ref().map(|l| l.ring_bytes),
            nsocks: cfg.nsocks,
            spin: cfg.spin,
        });
        let mesh = Mesh { core: core.clone() };
        let mut listeners = vec![Listener::Tcp(listener)];
        listeners.extend(local.map(|l| Listener::Unix(l.listener)));
        for l in listeners {
            let nonblocking = match &l {
                Listener::Tcp(l) => l.set_nonblocking(true),
                Listener::Unix(l) => l.set_nonblocking(true),
            };
            nonblocking.map_err(|e| Error::io(format!("rustc10d: could not listen: {e}")))?;
            let (fd, source) = (l.fd(), Arc::new(Listening(l, Arc::downgrade(&core))));
            let token = core.reactor.register(fd, READABLE, source.clone())?;
            core.listeners.lock().unwrap().push((token, source));
        }
        for &p in eager {
            core.lane(p, 0, deadline)?;
        }
        for &p in expect {
            core.wait_linked(p, deadline)?;
        }
        Ok(mesh)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.core.tcp_addr
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.core.shutdown();
    }
}

fn describe(addrs: &[PeerAddr], peer: usize) -> String {
    let a = &addrs[peer];
    match a.shm {
        Some(_) => format!("rank {peer} ({}, shared memory)", a.tcp),
        None => format!("rank {peer} ({})", a.tcp),
    }
}

impl Core {
    pub fn rank(&self) -> usize {
        self.me.rank as usize
    }

    pub fn hello(&self) -> &Hello {
        &self.me
    }

    pub fn describe(&self, peer: usize) -> String {
        describe(&self.addrs, peer)
    }

    /// The connection to send to `peer` on (`lane` picks one of several),
    /// dialling the peer first if there is none.
    fn lane(self: &Arc<Self>, peer: usize, lane: usize, deadline: Instant) -> Result<Arc<Link>> {
        if peer == self.rank() || peer >= self.peers.len() {
            return Err(Error::invalid(format!("rank {} cannot send to rank {peer}", self.rank())));
        }
        let slot = &self.peers[peer];
        loop {
            {
                let state = slot.state.lock().unwrap();
                if let Some(err) = state.lost() {
                    return Err(err.clone());
                }
                if let Some(&id) = state.lanes().get(lane % state.lanes().len().max(1)) {
                    let links = slot.links.lock().unwrap();
                    if let Some(l) = links.iter().find(|l| l.id == id) {
                        return Ok(l.clone());
                    }
                }
            }
            let dialler = Dialler { me: &self.me, peer, name: self.describe(peer), deadline };
            match (&self.addrs[peer].shm, self.ring_bytes) {
                (Some(name), Some(ring_bytes)) => {
                    let conn = dialler.shm(name, ring_bytes)?;
                    self.adopt(peer, conn);
                }
                _ => {
                    for _ in 0..self.nsocks {
                        let conn = dialler.tcp(self.addrs[peer].tcp, || self.stopping.load(Ordering::SeqCst))?;
                        self.adopt(peer, conn);
                    }
                }
            }
        }
    }

    /// Take a connection that passed its handshake into service.
    pub fn adopt(self: &Arc<Self>, peer: usize, conn: Conn) {
        let id = self.next_conn.fetch_add(1, Ordering::SeqCst);
        let lanes = if conn.is_shm() { 1 } else { self.nsocks };
        if self.stopping.load(Ordering::SeqCst) {
            return conn.shutdown();
        }
        // Adopted before it reads, so that its end always comes after.
        let link = Link::new(self, id, peer, conn);
        self.peers[peer].links.lock().unwrap().push(link.clone());
        self.peer_event(peer, Event::Adopted { conn: id, lanes });
        if self.link(peer, id).is_some() {
            if let Err(e) = link.start() {
                let error = Error::peer_lost(format!("lost connection to {}: {}", self.describe(peer), e.message));
                self.peer_event(peer, Event::Ended { conn: id, error: Some(error) });
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
        let gave_up = self.gave_up.lock().unwrap().is_some() || self.stopping.load(Ordering::SeqCst);
        let actions = slot.state.lock().unwrap().on(event, gave_up);
        let take = |conn: ConnId| {
            let mut links = slot.links.lock().unwrap();
            links.iter().position(|l| l.id == conn).map(|i| links.remove(i))
        };
        // Links that ended or are closed now: their queued sends fail, with the peer's loss if it is lost.
        let mut closed: Vec<Arc<Link>> = ended.and_then(take).into_iter().collect();
        let mut lost = None;
        for action in actions {
            match action {
                Action::Send(_) => {}
                Action::TellWhy(conn) => {
                    let why = self.gave_up.lock().unwrap().clone().unwrap_or_default();
                    if let Some(l) = self.link(peer, conn) {
                        l.tell(&why, TELL_GRACE);
                    }
                }
                Action::Close(conn) => {
                    if let Some(link) = take(conn) {
                        link.conn.shutdown();
                        closed.push(link);
                    }
                }
                Action::Lost(err) => {
                    let waiting = slot.mailbox.lock().unwrap().close(err.clone());
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

    fn link(&self, peer: usize, conn: ConnId) -> Option<Arc<Link>> {
        self.peers[peer].links.lock().unwrap().iter().find(|l| l.id == conn).cloned()
    }

    fn wait_linked(&self, peer: usize, deadline: Instant) -> Result<()> {
        let slot = &self.peers[peer];
        let mut state = slot.state.lock().unwrap();
        while !state.is_linked() {
            if let Some(e) = state.lost() {
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

    /// Go on reading a peer's connections that wait for a receive.
    fn resume(&self, peer: usize) {
        let paused: Vec<_> = self.peers[peer].links.lock().unwrap().iter().filter(|l| l.is_paused()).cloned().collect();
        for link in paused {
            self.reactor.defer(Box::new(move || link.resume()));
        }
    }

    fn give_up(self: &Arc<Self>, peer: usize, why: &Error) {
        self.peer_event(peer, Event::GiveUp { why: why.clone() });
    }

    fn shutdown(self: &Arc<Self>) {
        if self.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        for (token, listening) in self.listeners.lock().unwrap().drain(..) {
            self.reactor.deregister(token, listening.0.fd());
        }
        let err = Error::aborted("rustc10d: the process group was shut down");
        for peer in (0..self.peers.len()).filter(|&p| p != self.rank()) {
            self.give_up(peer, &err);
        }
        drop(self.membership.lock().unwrap().take());
    }
}

impl Transport for Mesh {
    fn rank(&self) -> usize {
        self.core.rank()
    }

    fn size(&self) -> usize {
        self.core.me.size as usize
    }

    fn describe_peer(&self, peer: usize) -> String {
        self.core.describe(peer)
    }

    /// Written at once, as far as the connection takes it, when nothing is
    /// queued before it (and no `ready` holds it back); the reactor writes the rest.
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
        let lane = if key.kind == KIND_P2P { 0 } else { key.sub as usize };
        let link = self.core.lane(peer, lane, deadline)?;
        link.send(SendReq::new(key, data, len, status, ready));
        Ok(())
    }

    unsafe fn recv(
        &self,
        peer: usize,
        key: Key,
        data: *mut u8,
        len: usize,
        fold: Option<Fold>,
        status: Arc<Status>,
    ) -> Result<()> {
        let recv = PostedRecv { buf: RecvBuf { ptr: data, len, fold }, status, any_source: false };
        self.core.peers[peer].mailbox.lock().unwrap().post(key, recv);
        self.core.resume(peer);
        Ok(())
    }

    unsafe fn recv_any(&self, key: Key, data: *mut u8, len: usize, status: Arc<Status>) -> Result<()> {
        let core = &self.core;
        // Post first, then look for a message that came early: a reader that
        // gets one meanwhile finds the posted receive.
        let recv = PostedRecv { buf: RecvBuf { ptr: data, len, fold: None }, status: status.clone(), any_source: true };
        core.any.lock().unwrap().push(key, recv);
        for peer in (0..core.peers.len()).filter(|&p| p != core.rank()) {
            if core.peers[peer].mailbox.lock().unwrap().offer_early(key, &status, &core.any) {
                break;
            }
        }
        for peer in (0..core.peers.len()).filter(|&p| p != core.rank()) {
            core.resume(peer);
        }
        Ok(())
    }

    fn cancel_recv_any(&self, key: Key, status: &Arc<Status>) -> bool {
        self.core.any.lock().unwrap().remove(key, status).is_some()
    }

    fn cancel_recv(&self, peer: usize, key: Key, status: &Arc<Status>) -> bool {
        self.core.peers[peer].mailbox.lock().unwrap().cancel(key, status)
    }

    fn polling(&self, peer: Option<usize>) -> Option<Box<dyn Polling + '_>> {
        let peers = match peer {
            Some(p) if p < self.core.peers.len() => p..p + 1,
            Some(_) => return None,
            None => 0..self.core.peers.len(),
        };
        let links: Vec<_> = peers.flat_map(|p| self.core.peers[p].links.lock().unwrap().clone()).collect();
        links.iter().for_each(|l| l.poll_begin());
        Some(Box::new(Pollers(links)))
    }

    fn break_peer(&self, peer: usize, reason: &Error) {
        self.core.give_up(peer, reason);
    }

    fn abort_all(&self, reason: &Error) {
        let core = &self.core;
        let why = reason.message.as_bytes();
        let why = &why[..why.len().min(ABORT_MAX as usize)];
        core.gave_up.lock().unwrap().get_or_insert_with(|| why.to_vec());
        let peers = || (0..core.peers.len()).filter(|&p| p != core.rank());
        // Tell every connection, between frames: the peer may read only one of them yet.
        for peer in peers() {
            let links: Vec<_> = core.peers[peer].links.lock().unwrap().clone();
            for link in links {
                link.tell(why, TELL_GRACE);
            }
        }
        for peer in peers() {
            core.give_up(peer, reason);
        }
    }

    fn shutdown(&self) {
        self.core.shutdown();
    }

    fn link_kind(&self, peer: usize) -> Option<&'static str> {
        let links = self.core.peers.get(peer)?.links.lock().unwrap();
        links.first().map(|l| if l.conn.is_shm() { "shm" } else { "tcp" })
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
