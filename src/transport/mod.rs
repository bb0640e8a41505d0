//! The transport layer: move bytes to and from ranks. It knows nothing of
//! collectives; algorithms see only `send`/`recv` of byte ranges keyed by `Key`.
//! `links/` is what a process shares with its peers: one set of connections
//! (TCP to other hosts, shared memory on this one), served by one reactor,
//! and each peer's mailbox, where the frames of every group on them meet
//! their receives. `group/` is what each group owns over them: the `Mesh` of
//! the group that opened them, a `Channel` for each group that shares them,
//! the waits, the arena of a group's ranks on one host. `links/` reaches into
//! `group/` in one file only, `mesh_core.rs`, whose `Core` holds the owner's
//! arena (handed out with each shared-memory connection), the channels' table
//! and the waits a peer may ask about.

pub mod fake;
mod gate;
pub mod group;
pub mod links;
mod transfers;

// Modules are named by their folder (`transport::links::frame`), so that a
// reader sees which side each is on; only the items every layer uses are
// here.
pub use gate::Gate;
use group::{arena, waits};
pub use links::frame::Key;
pub use links::mailbox::{Fold, RecvBuf};
pub use transfers::{withdraw, Lent, TransferId, Transfers};

use crate::error::{Error, Result};
use crate::status::{Polling, Status};
use std::sync::Arc;
use std::time::{Duration, Instant};
pub use waits::{Wait, WaitOn};

/// Makes a send's bytes ready to read (see `Transport::send`).
pub type Ready = Box<dyn FnOnce() -> Result<()> + Send>;

/// Entries kept about groups, per process (`Transport::retained`): each
/// peer's closed groups (summed), channel numbers, groups given up on, and
/// group names counted; and the bytes of messages kept for receives not yet
/// posted (summed over the peers, each within its cap).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Retained {
    pub closed: usize,
    pub numbers: usize,
    pub given_up: usize,
    pub names: usize,
    pub early_bytes: u64,
}

pub trait Transport: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// "rank 3 (10.0.0.4:40123)", for error messages.
    fn describe_peer(&self, peer: usize) -> String;

    /// Queue `len` bytes at `data` for `peer`; `status` finishes when they are written.
    /// With `ready`, the bytes are read only after it has returned (on a
    /// sending thread, in the order of the sends to `peer`), so the caller
    /// need not wait for them to be filled; an error from `ready` fails this
    /// send alone.
    ///
    /// # Safety
    /// The bytes must stay valid and unchanged until `status` finishes (from
    /// the time `ready` returns, with `ready`).
    #[allow(clippy::too_many_arguments)]
    unsafe fn send(
        &self,
        peer: usize,
        key: Key,
        data: *const u8,
        len: usize,
        status: Arc<Status>,
        deadline: Instant,
        ready: Option<Ready>,
    ) -> Result<()>;

    /// Post a buffer for the next message from `peer` with `key`; `status`
    /// finishes when it is filled (or the peer is lost, or sizes differ).
    /// With `fold`, the message is folded into the buffer's contents instead.
    ///
    /// # Safety
    /// The buffer must stay valid, and not be read, until `status` finishes.
    unsafe fn recv(
        &self,
        peer: usize,
        key: Key,
        data: *mut u8,
        len: usize,
        fold: Option<Fold>,
        status: Arc<Status>,
    ) -> Result<()>;

    /// Like `recv`, posted once the send `gate` waits for (from the same
    /// memory) has finished, so that the message is not written while the
    /// send may still read it (one that arrives sooner waits, as an early
    /// message does); that send failing fails it with its error. `gate` says
    /// whether it was posted yet, and withdraws it before then.
    ///
    /// # Safety
    /// As for `recv`, from now on.
    unsafe fn recv_after(
        &self,
        gate: &Arc<Gate>,
        peer: usize,
        key: Key,
        buf: RecvBuf,
        status: Arc<Status>,
    ) -> Result<()>;

    /// Like `recv`, from whichever peer sends a message with `key` first;
    /// `status` finishes with that peer's rank.
    ///
    /// # Safety
    /// As for `recv`.
    unsafe fn recv_any(&self, key: Key, data: *mut u8, len: usize, status: Arc<Status>) -> Result<()>;

    /// Withdraw an any-source receive that no peer has matched yet.
    fn cancel_recv_any(&self, key: Key, status: &Arc<Status>) -> bool;

    /// Withdraw a posted receive that has not begun. False if it is already
    /// being filled or finished; the caller must then wait for `status`.
    fn cancel_recv(&self, peer: usize, key: Key, status: &Arc<Status>) -> bool;

    /// Give up on `peer`: close its connections so that every transfer
    /// with it finishes (with `reason`) promptly.
    fn break_peer(&self, peer: usize, reason: &Error);

    /// Give up on every peer, telling each why first (best effort), so that
    /// ranks that are not our neighbours learn the original cause too.
    /// `sent_below`: the first collective (sequence number) whose messages
    /// this rank may not all have sent; those of earlier ones are all with
    /// the connections (collectives run one at a time, and one finishes
    /// only once its sends have). Where the connections outlive the group
    /// (a channel), a peer still takes those.
    fn abort_all(&self, reason: &Error, sent_below: u64);

    /// Close every connection; all pending transfers fail. Idempotent.
    fn shutdown(&self);

    /// Leave the group (torch destroys it): tell the peers, where the
    /// connections outlive the group, that this rank has sent every message
    /// of its collectives below `sent_below` and of its point-to-point ops,
    /// so that a peer still waiting in the group for more fails now instead
    /// of at its timeout; then `shutdown`.
    fn leave(&self, sent_below: u64) {
        let _ = sent_below;
        self.shutdown();
    }

    /// A thread that waits for a transfer with `peer` (None: any peer) and
    /// polls meanwhile makes progress with it through this; dropping it says
    /// the thread stops polling (None: nothing to poll).
    fn polling(&self, _peer: Option<usize>) -> Option<Box<dyn Polling + '_>> {
        None
    }

    /// Whether every rank of the group reads every other's messages of at
    /// least this many bytes straight from the sender's memory: such a send
    /// costs its sender no copy, so one buffer can go to every rank at once.
    /// The same on every rank of the group.
    fn single_copy_bytes(&self) -> Option<usize> {
        None
    }

    /// The shared arena this rank maps (arena.rs) and the ranks that map it,
    /// in the arena's order: every rank of a group on one host, or the ranks
    /// of this rank's host in a group on several. The same on each of them.
    fn shared_arena(&self) -> Option<(Arc<arena::Arena>, &[usize])> {
        None
    }

    /// Whether the ranks of every host of the group share an arena of
    /// their own (`shared_arena` on each of them). The same on every rank.
    fn arena_on_every_host(&self) -> bool {
        false
    }

    /// The arena of exactly this group's ranks, rank i in slot i: the
    /// algorithms that run there need every rank of the group in it.
    fn arena(&self) -> Option<Arc<arena::Arena>> {
        let (arena, members) = self.shared_arena()?;
        (members.len() == self.size()).then_some(arena)
    }

    /// How bytes reach `peer` now: "shm", "tcp", or None before the first connection.
    fn link_kind(&self, peer: usize) -> Option<&'static str>;

    /// How many connections collectives send to `peer` on now (0 before the first).
    fn lanes(&self, _peer: usize) -> usize {
        0
    }

    /// Whether `lanes(peer)` is final (with `nsocks=auto`, once measured).
    fn lanes_settled(&self, _peer: usize) -> bool {
        true
    }

    /// What the process keeps about the groups its connections carried
    /// (tests of bounded growth; zeroes where nothing is kept).
    fn retained(&self) -> Retained {
        Retained::default()
    }

    /// A group of `members` (ranks of this one, in the new group's order,
    /// this rank among them) named `name` that sends over this group's
    /// connections in a channel of its own (channel.rs): every member opens
    /// it with the same name, in the same order as its other channels of
    /// that name, within `timeout` (members on one host agree on an arena).
    /// None where the transport has no connections to share.
    fn open_channel(&self, _name: &str, _members: &[usize], _timeout: Duration) -> Option<Result<Arc<dyn Transport>>> {
        None
    }

    /// Whether the connections outlive this group's failure (a failure
    /// closes its channel alone), so that its survivors can go on on them:
    /// until it, or the last group on them, shuts down.
    fn connections_outlive_failure(&self) -> bool {
        false
    }

    /// Which host `peer` runs on, as a number that every rank of the group
    /// gives the same host (hosts are numbered in the order of their lowest
    /// rank). Algorithms keep bytes off the links between hosts by it.
    fn host_of(&self, _peer: usize) -> usize {
        0
    }

    /// Note that an op blocks waiting for a peer, until `end_wait` (with
    /// what the rank said if it timed out or failed): what this rank answers when a
    /// peer asks.
    fn begin_wait(&self, _wait: Wait) -> u64 {
        0
    }

    fn end_wait(&self, _id: u64, _said: Option<String>) {}

    /// Ask `peer`, which this rank timed out waiting for, what it waits for
    /// itself ("" if nothing), and so on down the chain (waits.rs); None if
    /// it does not say in time.
    fn ask(&self, _peer: usize) -> Option<String> {
        None
    }
}
