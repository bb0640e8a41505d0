//! An in-memory `Transport` for tests: W endpoints of one network inside one
//! process, so that the collective algorithms run, and can be checked,
//! without sockets or the I/O thread. A send delivers its bytes at once, on
//! the sending thread, into the receiver's `Mailbox` for that sender, which
//! matches them exactly as a connection's reader does: a posted receive of
//! the same length is filled (folded, with a `Fold`), one of another length
//! fails with the size mismatch, otherwise the message waits until its
//! receive is posted. Then the send finishes with its length.
//!
//! It may have a shared arena (`with_arena`), in memory all its ranks share,
//! or, with ranks on several hosts, one for each host's ranks
//! (`on_hosts_with_arenas`). A cut link aborts the arenas of both ends, as
//! the lost peer does the mesh's.
//!
//! A test may `hold` a link: sends over it then wait, unread, until it is
//! released, as sends behind a busy connection do; they read their memory
//! only then. A rank that asks a peer what it waits for is answered at once
//! (unless the link is held), from what the peer's ops noted.
//!
//! Not modelled: partial reads or writes (a message lands whole), flow
//! control (a send never waits for its receiver, and `deadline` is unused),
//! timing (no latency: a send has landed when it returns, unless held), lanes, polling,
//! and the in-flight window of a real cut: once a link is cut no more bytes
//! cross it, but messages that landed before stay receivable, as data read
//! before a connection closed does. A receive posted for any source
//! fails once any peer is lost, as the mesh's does.

use super::group::arena::Arena;
use super::group::waits::{ask_next, in_turn, Wait, Waits};
use super::links::mailbox::{AnyPosted, Mailbox, PostedRecv, RecvBuf, Sources};
use super::{Fold, Gate, Key, Ready, Transport};
use crate::error::{Error, Result};
use crate::locks::{level, Mutex};
use crate::status::Status;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The network that a group's endpoints share.
pub struct FakeNet {
    /// `inbox[dst][src]`: what `src` sent to `dst`, matched with `dst`'s receives.
    inbox: Vec<Vec<Mutex<level::Mailbox, Mailbox>>>,
    /// `any[dst]`: `dst`'s receives posted for any source.
    any: Vec<Mutex<level::AnyPosted, AnyPosted>>,
    /// `cut[me][peer]`: why `me` lost `peer`, once it has. Held while a send
    /// from `me` to `peer` delivers, so that a cut waits for a delivery in progress.
    cut: Vec<Vec<Mutex<level::FakeCut, Option<Error>>>>,
    /// `held[src][dst]`: the sends from `src` to `dst` waiting for the link's
    /// release, in order, while the link is held (Some).
    held: Vec<Vec<Mutex<level::FakeHeld, Option<Vec<HeldSend>>>>>,
    /// `waits[r]`: what rank r's ops wait for; a rank that asks reads it.
    waits: Vec<Mutex<level::Waits, Waits>>,
    /// `arenas[r]`: rank r's view of its shared arena, and the ranks that
    /// map it, if it has one.
    arenas: Vec<Option<(Arc<Arena>, Vec<usize>)>>,
}

/// A send that has not read its memory yet.
struct HeldSend {
    key: Key,
    data: *const u8,
    len: usize,
    status: Arc<Status>,
}

// SAFETY: the sender keeps `data` valid and unchanged until the send's status
// finishes (`Transport::send`), which a held send's does only once it is
// delivered or failed; the pointer is only read on delivery, by whichever
// thread releases the link (under the link's lock).
unsafe impl Send for HeldSend {}

/// One rank's endpoint of a `FakeNet`.
pub struct FakeTransport {
    net: Arc<FakeNet>,
    rank: usize,
    sent: AtomicU64,
    /// Bytes delivered to ranks on other hosts, and to the others on this one.
    crossed: AtomicU64,
    on_host: AtomicU64,
    /// What `Transport::single_copy_bytes` says (the bytes are copied alike).
    single_copy: Option<usize>,
    /// What `Transport::host_of` says of each rank (the links are alike).
    hosts: Arc<Vec<usize>>,
}

impl FakeNet {
    /// The endpoints of a new network of `world` ranks, by rank.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world: usize) -> Vec<Arc<FakeTransport>> {
        FakeNet::with_single_copy(world, None)
    }

    /// The same, saying that every rank reads messages of at least
    /// `single_copy` bytes from the sender's memory (the single-copy algorithms run).
    pub fn with_single_copy(world: usize, single_copy: Option<usize>) -> Vec<Arc<FakeTransport>> {
        FakeNet::build(vec![0; world], single_copy, None)
    }

    /// The same, with a shared arena of slots of `slot_bytes` (in this
    /// process's memory), so that the arena's algorithms run. A cut link
    /// aborts the arena, as a lost peer does the mesh's.
    pub fn with_arena(world: usize, slot_bytes: usize, single_copy: Option<usize>) -> Vec<Arc<FakeTransport>> {
        FakeNet::build(vec![0; world], single_copy, Some(slot_bytes))
    }

    /// The endpoints of a new network whose rank r says it runs on host
    /// `hosts[r]` (numbered in the order of their lowest rank), so that the
    /// algorithms for groups on several hosts run.
    pub fn on_hosts(hosts: Vec<usize>) -> Vec<Arc<FakeTransport>> {
        FakeNet::build(hosts, None, None)
    }

    /// The same, with an arena of slots of `slot_bytes` for the ranks of
    /// each host that holds two or more.
    pub fn on_hosts_with_arenas(hosts: Vec<usize>, slot_bytes: usize) -> Vec<Arc<FakeTransport>> {
        FakeNet::build(hosts, None, Some(slot_bytes))
    }

    fn build(hosts: Vec<usize>, single_copy: Option<usize>, slot_bytes: Option<usize>) -> Vec<Arc<FakeTransport>> {
        let world = hosts.len();
        let mut arenas: Vec<Option<(Arc<Arena>, Vec<usize>)>> = (0..world).map(|_| None).collect();
        for host in 0..slot_bytes.map_or(0, |_| world) {
            let members: Vec<usize> = (0..world).filter(|&r| hosts[r] == host).collect();
            if members.len() < 2 {
                continue;
            }
            let views = Arena::in_memory(members.len(), slot_bytes.unwrap()).expect("shared memory for the arena");
            for (&r, view) in members.iter().zip(views) {
                arenas[r] = Some((Arc::new(view), members.clone()));
            }
        }
        let hosts = Arc::new(hosts);
        let net = Arc::new(FakeNet {
            inbox: (0..world).map(|_| (0..world).map(|src| Mutex::new(Mailbox::new(src))).collect()).collect(),
            any: (0..world).map(|_| Mutex::default()).collect(),
            cut: (0..world).map(|_| (0..world).map(|_| Mutex::new(None)).collect()).collect(),
            held: (0..world).map(|_| (0..world).map(|_| Mutex::new(None)).collect()).collect(),
            waits: (0..world).map(|_| Mutex::default()).collect(),
            arenas,
        });
        (0..world)
            .map(|rank| {
                let (net, hosts) = (net.clone(), hosts.clone());
                let (sent, crossed, on_host) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
                Arc::new(FakeTransport { net, rank, sent, crossed, on_host, single_copy, hosts })
            })
            .collect()
    }
}

impl FakeTransport {
    /// Messages this endpoint has delivered so far (tests tell algorithms apart by it).
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// Bytes this endpoint has delivered to ranks on other hosts so far:
    /// what would have crossed its host's link.
    pub fn crossed(&self) -> u64 {
        self.crossed.load(Ordering::SeqCst)
    }

    /// Bytes this endpoint has delivered to the other ranks of its host so far.
    pub fn on_host(&self) -> u64 {
        self.on_host.load(Ordering::SeqCst)
    }

    /// From now on, sends from this rank to `peer` wait unread until `release`.
    pub fn hold(&self, peer: usize) {
        self.net.held[self.rank][peer].lock().unwrap().get_or_insert_with(Vec::new);
    }

    /// Deliver the sends to `peer` held since `hold`, in order, reading their
    /// memory now; later sends go at once again.
    pub fn release(&self, peer: usize) {
        let held = self.net.held[self.rank][peer].lock().unwrap().take().unwrap_or_default();
        for h in held {
            // Delivered as if sent now: a link cut meanwhile fails it.
            // SAFETY: a held send's bytes are still valid and unchanged: its status has
            // not finished (see HeldSend), and `send` reads them before it finishes it.
            if let Err(e) = unsafe { self.send(peer, h.key, h.data, h.len, h.status.clone(), Instant::now(), None) } {
                h.status.finish(Err(e));
            }
        }
    }

    /// What `peer` answers `from` when asked at `depth`: at once, unless
    /// the link is held; in turn what the rank it waits for answers
    /// (waits.rs). Over a cut link, why it was cut (a peer that gave up says why).
    fn ask_at(&self, from: usize, peer: usize, depth: u64) -> Option<String> {
        self.check_peer(peer).ok()?;
        if self.net.held[from][peer].lock().unwrap().is_some() {
            return None;
        }
        if let Some(why) = &*self.net.cut[from][peer].lock().unwrap() {
            return Some(why.message.clone());
        }
        let (text, next) = {
            let waits = self.net.waits[peer].lock().unwrap();
            (waits.answer(|p| self.describe_peer(p)), waits.waiting_for())
        };
        let deeper = ask_next(next, from, depth).and_then(|q| self.ask_at(peer, q, depth + 1));
        Some(in_turn(text, deeper))
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer == self.rank || peer >= self.size() {
            return Err(Error::invalid(format!("rustc10d: rank {} (fake) has no peer {peer}", self.rank)));
        }
        Ok(())
    }

    /// Cut the link with `peer`: from now on this side's transfers with it
    /// fail with `mine`, the peer's with us with `theirs` (the first cut's
    /// reasons stay). Both sides count as cut before either mailbox closes,
    /// so nothing lands in a closed one.
    fn cut(&self, peer: usize, mine: Error, theirs: Error) {
        if self.check_peer(peer).is_err() {
            return;
        }
        let net = &self.net;
        let mine = net.cut[self.rank][peer].lock().unwrap().get_or_insert(mine).clone();
        let theirs = net.cut[peer][self.rank].lock().unwrap().get_or_insert(theirs).clone();
        if let Some((arena, _)) = &net.arenas[self.rank] {
            arena.abort(&format!("rank {}: {}", self.rank, mine.message));
        }
        if let Some((arena, _)) = &net.arenas[peer] {
            arena.abort(&format!("rank {peer}: {}", theirs.message));
        }
        net.inbox[self.rank][peer].lock().unwrap().close(mine.clone());
        net.inbox[peer][self.rank].lock().unwrap().close(theirs.clone());
        net.any[self.rank].lock().unwrap().fail_all(&mine);
        net.any[peer].lock().unwrap().fail_all(&theirs);
        for (from, to, why) in [(self.rank, peer, &mine), (peer, self.rank, &theirs)] {
            let held = net.held[from][to].lock().unwrap().as_mut().map(std::mem::take).unwrap_or_default();
            for h in held {
                h.status.finish(Err(why.clone()));
            }
        }
    }
}

impl Transport for FakeTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.net.any.len()
    }

    fn describe_peer(&self, peer: usize) -> String {
        format!("rank {peer} (fake)")
    }

    /// Runs `ready`, then delivers, on the caller's thread: `status` has
    /// finished when this returns Ok. A send to a lost peer fails at once.
    ///
    /// # Safety
    /// As for `Transport::send`.
    unsafe fn send(
        &self,
        peer: usize,
        key: Key,
        data: *const u8,
        len: usize,
        status: Arc<Status>,
        _deadline: Instant,
        ready: Option<Ready>,
    ) -> Result<()> {
        self.check_peer(peer)?;
        let link = &self.net.cut[self.rank][peer];
        if let Some(why) = link.lock().unwrap().clone() {
            return Err(why);
        }
        if let Some(Err(e)) = ready.map(|ready| ready()) {
            status.finish(Err(e));
            return Ok(());
        }
        let cut = link.lock().unwrap();
        if let Some(why) = &*cut {
            // Cut while `ready` ran: like a send queued on a connection that closed.
            status.finish(Err(why.clone()));
            return Ok(());
        }
        // Under the cut's lock, so that a cut fails every send it holds.
        if let Some(held) = self.net.held[self.rank][peer].lock().unwrap().as_mut() {
            held.push(HeldSend { key, data, len, status });
            return Ok(());
        }
        // SAFETY: the caller keeps `len` bytes at `data` valid and unchanged
        // until `status` finishes (this function's contract), which is below,
        // after the copy; `ready`, if any, has run.
        let bytes = if len == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(data, len) } };
        // A frame read whole: the mailbox fills or folds a posted receive of
        // this length, fails one of another length, or keeps the message early.
        self.net.inbox[peer][self.rank].lock().unwrap().arrived(key, bytes.to_vec(), &self.net.any[peer]);
        drop(cut);
        self.sent.fetch_add(1, Ordering::SeqCst);
        if self.hosts[peer] != self.hosts[self.rank] {
            self.crossed.fetch_add(len as u64, Ordering::SeqCst);
        } else {
            self.on_host.fetch_add(len as u64, Ordering::SeqCst);
        }
        status.finish(Ok(len as i64));
        Ok(())
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
        self.check_peer(peer)?;
        let recv = PostedRecv { buf: RecvBuf { ptr: data, len, fold }, status, any_source: None };
        self.net.inbox[self.rank][peer].lock().unwrap().post(key, recv);
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
        self.check_peer(peer)?;
        let (net, rank, posted) = (self.net.clone(), self.rank, status.clone());
        gate.post_after(status, move || {
            let recv = PostedRecv { buf, status: posted, any_source: None };
            net.inbox[rank][peer].lock().unwrap().post(key, recv);
        });
        Ok(())
    }

    /// # Safety
    /// As for `Transport::recv_any`.
    unsafe fn recv_any(&self, key: Key, data: *mut u8, len: usize, status: Arc<Status>) -> Result<()> {
        // As the mesh does: post, then take a message that came early, if any.
        let any = &self.net.any[self.rank];
        let recv = PostedRecv {
            buf: RecvBuf { ptr: data, len, fold: None },
            status: status.clone(),
            any_source: Some(Sources::Owner),
        };
        any.lock().unwrap().push(key, recv);
        let inbox = |peer: usize| self.net.inbox[self.rank][peer].lock().unwrap();
        let others = || (0..self.size()).filter(|&p| p != self.rank);
        if !others().any(|peer| inbox(peer).offer_early(key, &status, any)) {
            if let Some(err) = others().find_map(|peer| inbox(peer).closed().cloned()) {
                if any.lock().unwrap().remove(key, &status).is_some() {
                    status.finish(Err(err));
                }
            }
        }
        Ok(())
    }

    fn cancel_recv_any(&self, key: Key, status: &Arc<Status>) -> bool {
        self.net.any[self.rank].lock().unwrap().remove(key, status).is_some()
    }

    fn cancel_recv(&self, peer: usize, key: Key, status: &Arc<Status>) -> bool {
        self.check_peer(peer).is_ok() && self.net.inbox[self.rank][peer].lock().unwrap().cancel(key, status)
    }

    /// The link is lost on both sides: ours fails naming the peer, with
    /// `reason`; the peer's as if we had closed the connection.
    fn break_peer(&self, peer: usize, reason: &Error) {
        let mine =
            Error::new(reason.kind, format!("lost connection to {}: {}", self.describe_peer(peer), reason.message));
        let theirs = Error::peer_lost(format!("{} closed its connection", self.describe_peer(self.rank)));
        self.cut(peer, mine, theirs);
    }

    /// Every link is cut; ours fail with `reason` (as the mesh's do), every
    /// peer's with why we gave up, as the mesh's abort frame tells them.
    fn abort_all(&self, reason: &Error, _sent_below: u64) {
        let me = self.describe_peer(self.rank);
        let theirs = Error::peer_lost(format!("{me} gave up on the group: {}", reason.message));
        for peer in (0..self.size()).filter(|&p| p != self.rank) {
            self.cut(peer, reason.clone(), theirs.clone());
        }
    }

    fn shutdown(&self) {
        let mine = Error::aborted("rustc10d: the process group was shut down");
        let theirs = Error::peer_lost(format!("{} closed its connection", self.describe_peer(self.rank)));
        for peer in (0..self.size()).filter(|&p| p != self.rank) {
            self.cut(peer, mine.clone(), theirs.clone());
        }
    }

    fn single_copy_bytes(&self) -> Option<usize> {
        self.single_copy
    }

    fn shared_arena(&self) -> Option<(Arc<Arena>, &[usize])> {
        let (arena, members) = self.net.arenas[self.rank].as_ref()?;
        Some((arena.clone(), members))
    }

    fn arena_on_every_host(&self) -> bool {
        self.net.arenas.iter().all(Option::is_some)
    }

    fn link_kind(&self, peer: usize) -> Option<&'static str> {
        self.check_peer(peer).is_ok().then_some("fake")
    }

    fn host_of(&self, peer: usize) -> usize {
        self.hosts[peer]
    }

    fn begin_wait(&self, wait: Wait) -> u64 {
        self.net.waits[self.rank].lock().unwrap().begin(wait)
    }

    fn end_wait(&self, id: u64, said: Option<String>) {
        self.net.waits[self.rank].lock().unwrap().end(id, said)
    }

    fn ask(&self, peer: usize) -> Option<String> {
        self.ask_at(self.rank, peer, 0)
    }
}
