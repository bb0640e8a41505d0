//! `Mesh`: the Transport of one group. Connections to a peer open lazily,
//! when a rank first sends to it (dial.rs; the listening side is accept.rs):
//! shared memory to a peer on this host, TCP to the others. Every connection
//! is a Link served by the process's one reactor; what happens to a peer as
//! connections come and go is decided by its state machine (peer.rs), whose
//! actions are carried out here. The group's own frames are channel 0 of its
//! connections; groups made from it are channels on them too (channel.rs).
//! Its failure closes channel 0 alone, as a channel's failure closes that
//! channel; the connections close with the last group on them.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::locks::{Condvar, Mutex};
use crate::status::{Polling, Status};
use crate::transport::group::arena::Arena;
use crate::transport::group::channel::Channel;
use crate::transport::group::waits::Wait;
use crate::transport::links::accept::{Listener, Listening};
use crate::transport::links::auth::Identity;
use crate::transport::links::endpoint::{PeerAddr, ShmEndpoint};
use crate::transport::links::frame::Key;
use crate::transport::links::mailbox::{Fold, Mailbox, RecvBuf, Sources};
use crate::transport::links::mesh_core::{describe, Core, PeerConns, PeerSlot};
use crate::transport::links::peer::Peer;
use crate::transport::links::peer_reads::PeerReadsGrant;
use crate::transport::links::reactor::{Reactor, READABLE};
use crate::transport::links::striping::Striping;
use crate::transport::{Gate, Ready, Transport};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Mesh {
    core: Arc<Core>,
}

/// What the rendezvous learned of the group as a whole, the same on every rank.
pub struct Layout {
    /// Each rank's host, numbered in the order of their lowest rank.
    pub hosts: Vec<usize>,
    /// Every rank reads every other's large messages from the sender's memory.
    pub single_copy: bool,
    pub arena: ArenaRole,
    /// The ranks of every host share an arena of their own (`arena` on each).
    pub arena_on_every_host: bool,
    /// Peers on this host may read this rank's memory while the group lives.
    pub peer_reads: Option<PeerReadsGrant>,
}

/// This rank's part in a shared arena (arena.rs): the group's, or its host's.
pub enum ArenaRole {
    None,
    /// It made the arena of `members` (ranks in the arena's order, itself
    /// first), and hands it to each of them that connects.
    Lead {
        arena: Arena,
        members: Vec<usize>,
    },
    /// It gets the arena of `members` from the first of them, which it
    /// connects to at init.
    Join {
        members: Vec<usize>,
    },
}

impl Mesh {
    /// Start listening, connect to `eager` peers and wait until each of
    /// `expect` has connected to us, all before `deadline`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        listener: TcpListener,
        local: Option<ShmEndpoint>,
        me: Identity,
        addrs: Vec<PeerAddr>,
        cfg: &Config,
        layout: Layout,
        eager: &[usize],
        expect: &[usize],
        deadline: Instant,
    ) -> Result<Mesh> {
        let (reactor, membership) = Reactor::join()?;
        let (arena, arena_members) = match layout.arena {
            ArenaRole::None => (None, Vec::new()),
            ArenaRole::Lead { arena, members } => (Some(arena), members),
            ArenaRole::Join { members } => (None, members),
        };
        let tcp_addr = listener.local_addr().map_err(|e| Error::io(e.to_string()))?;
        let peers = (0..addrs.len())
            .map(|p| PeerSlot {
                mailbox: Mutex::new(Mailbox::with_early_max(p, cfg.early_bytes_max)),
                state: Mutex::new(PeerConns {
                    life: Peer::new(describe(&addrs, p)),
                    striping: Striping::new(cfg.nsocks),
                }),
                linked: Condvar::new(),
                links: Mutex::default(),
                answering: AtomicUsize::new(0),
            })
            .collect();
        let core = Arc::new(Core {
            me,
            addrs,
            peers,
            any: Mutex::default(),
            reactor,
            membership: Mutex::new(Some(membership)),
            listeners: Mutex::default(),
            next_conn: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            tcp_addr,
            ring_bytes: local.as_ref().map(|l| l.ring_bytes),
            direct_from: cfg.single_copy_bytes,
            single_copy_group: layout.single_copy,
            hosts: layout.hosts,
            spin: cfg.spin,
            waits: Mutex::default(),
            arena: Mutex::new(arena.map(Arc::new)),
            arena_members,
            arena_on_every_host: layout.arena_on_every_host,
            peer_reads: Mutex::new(layout.peer_reads),
            channels: Mutex::default(),
        });
        let mesh = Mesh { core: core.clone() };
        // A listener that runs out of descriptors refuses with this one.
        crate::transport::links::fd_limit::keep_spare();
        let mut listeners = vec![Listener::Tcp(listener)];
        listeners.extend(local.map(|l| Listener::Unix(l.listener)));
        for l in listeners {
            let nonblocking = match &l {
                Listener::Tcp(l) => l.set_nonblocking(true),
                Listener::Unix(l) => l.set_nonblocking(true),
            };
            nonblocking.map_err(|e| Error::io(format!("rustc10d: could not listen: {e}")))?;
            let (fd, source) = (l.fd(), Arc::new(Listening::new(l, &core)));
            let token = core.reactor.register(fd, READABLE, source.clone())?;
            core.listeners.lock().unwrap().push((token, source));
        }
        // A peer may join, run a first op and give up on the group (a
        // mismatched call) while this rank still joins: see there.
        for &p in eager {
            core.lane(p, 0, false, deadline).map(drop).or_else(|e| core.unless_it_joined_and_gave_up(p, e))?;
        }
        std::thread::sleep(cfg.test_join_pause);
        for &p in expect {
            core.wait_linked(p, deadline).or_else(|e| core.unless_it_joined_and_gave_up(p, e))?;
        }
        // The arena comes with the first shared-memory connection to its leader.
        if let Some(leader) = core.arena_leader().filter(|&l| l != core.rank()) {
            let joined = core.lane(leader, 0, false, deadline).map(drop);
            joined.or_else(|e| core.unless_it_joined_and_gave_up(leader, e))?;
            if core.arena.lock().unwrap().is_none() && !core.peers[leader].state.lock().unwrap().life.said_why() {
                return Err(Error::io(format!(
                    "rustc10d: rank {} did not receive its shared arena from {}",
                    core.rank(),
                    core.describe(leader)
                )));
            }
        }
        Ok(mesh)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.core.tcp_addr
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Mesh {
    /// Close this group's own channel (0) here: its receives fail with
    /// `why`, now and later; the connections stay, for the groups on them.
    fn close_own_channel(&self, why: &Error) {
        let core = &self.core;
        for p in (0..core.peers.len()).filter(|&p| p != core.rank()) {
            core.peers[p].mailbox.lock().unwrap().close_group(0, why.clone());
        }
        core.any.lock().unwrap().fail_group(0, why);
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
        // SAFETY: the caller's contract, passed on.
        unsafe { self.core.recv_from_after(gate, peer, key, buf, status) };
        Ok(())
    }

    /// # Safety
    /// As for `Transport::recv_any`.
    unsafe fn recv_any(&self, key: Key, data: *mut u8, len: usize, status: Arc<Status>) -> Result<()> {
        let others: Vec<usize> = (0..self.core.peers.len()).filter(|&p| p != self.core.rank()).collect();
        // SAFETY: the caller's contract, passed on.
        unsafe { self.core.recv_from_any(&others, Sources::Owner, key, data, len, status) };
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
        Some(self.core.polling_of(peers))
    }

    fn break_peer(&self, peer: usize, reason: &Error) {
        self.core.give_up(peer, reason);
    }

    /// This group gives up on its own channel (0) alone, as a channel does:
    /// the connections stay, for the groups that share them (a mismatch or
    /// a timeout here must not fail those) and for a shrink's survivors.
    fn abort_all(&self, reason: &Error, sent_below: u64) {
        let core = &self.core;
        core.abort_arena(&reason.message);
        let everyone: Arc<[usize]> = (0..core.peers.len()).collect();
        core.tell_group_abort(0, everyone, sent_below, reason);
        self.close_own_channel(reason);
    }

    /// Tells every peer it has a connection to that it leaves the group
    /// (the connections may stay, for the groups that share them), then
    /// shuts down.
    fn leave(&self, sent_below: u64) {
        let core = &self.core;
        if !core.stopping.load(Ordering::SeqCst) {
            let why = Error::aborted(format!("rustc10d: rank {} destroyed the process group", core.rank()));
            let everyone: Vec<usize> = (0..core.peers.len()).collect();
            core.tell_group_leave(0, &everyone, sent_below, &why);
        }
        self.shutdown();
    }

    /// While groups share the connections, this group closes its own
    /// channel alone, and the last of them closes the connections.
    fn shutdown(&self) {
        let core = &self.core;
        if core.channels.lock().unwrap().owner_shuts() {
            return core.shutdown();
        }
        core.abort_arena(&format!("rank {} shut the process group down", core.rank()));
        self.close_own_channel(&Error::aborted("rustc10d: the process group was shut down"));
    }

    fn connections_outlive_failure(&self) -> bool {
        !self.core.stopping.load(Ordering::SeqCst)
    }

    fn single_copy_bytes(&self) -> Option<usize> {
        self.core.single_copy_group.then_some(self.core.direct_from)
    }

    fn shared_arena(&self) -> Option<(Arc<Arena>, &[usize])> {
        let arena = self.core.arena.lock().unwrap().clone()?;
        Some((arena, &self.core.arena_members))
    }

    fn arena_on_every_host(&self) -> bool {
        self.core.arena_on_every_host
    }

    fn link_kind(&self, peer: usize) -> Option<&'static str> {
        self.core.link_kind_of(peer)
    }

    fn host_of(&self, peer: usize) -> usize {
        self.core.hosts[peer]
    }

    fn begin_wait(&self, wait: Wait) -> u64 {
        self.core.waits.lock().unwrap().begin(wait)
    }

    fn end_wait(&self, id: u64, said: Option<String>) {
        self.core.waits.lock().unwrap().end(id, said)
    }

    fn ask(&self, peer: usize) -> Option<String> {
        self.core.ask(peer, 0)
    }

    fn lanes(&self, peer: usize) -> usize {
        self.core.lanes_of(peer)
    }

    fn lanes_settled(&self, peer: usize) -> bool {
        self.core.lanes_settled_of(peer)
    }

    fn retained(&self) -> crate::transport::Retained {
        self.core.retained()
    }

    fn open_channel(&self, name: &str, members: &[usize], timeout: Duration) -> Option<Result<Arc<dyn Transport>>> {
        Some(Channel::open(&self.core, name, members.to_vec(), timeout).map(|c| c as Arc<dyn Transport>))
    }
}
