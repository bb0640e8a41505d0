//! Matching of incoming messages with posted receives, for one peer.
//! No I/O here: the connection's reader asks where a payload goes, the caller
//! posts buffers. Messages with the same key match in posting order; a message
//! that arrives before its receive is posted is kept until it is.

use crate::error::Error;
use crate::locks::{level, Mutex};
use crate::status::Status;
use crate::transport::links::frame::{Key, KIND_COLLECTIVE, KIND_P2P};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Folds arriving bytes into a receive buffer (`dst = f(dst, src)`) instead of
/// overwriting it: a reduction then reads the peer's bytes as they arrive,
/// without a copy to scratch memory first. Pieces are multiples of `unit`.
#[derive(Clone)]
pub struct Fold {
    pub unit: usize,
    pub f: FoldFn,
}

/// `f(dst, src)`: fold `src` into `dst` (same length).
pub type FoldFn = Arc<dyn Fn(&mut [u8], &[u8]) + Send + Sync>;

impl Fold {
    /// Fold `src` into `dst`. Kernels view both as typed slices, so a source
    /// that is not 8-byte aligned (an early message's heap copy) is realigned.
    pub fn apply(&self, dst: &mut [u8], src: &[u8]) {
        if src.is_empty() || (src.as_ptr() as usize).is_multiple_of(8) {
            return (self.f)(dst, src);
        }
        let mut aligned = vec![0u64; src.len().div_ceil(8)];
        let bytes = &mut crate::reduce::bytes_of_words(&mut aligned)[..src.len()];
        bytes.copy_from_slice(src);
        (self.f)(dst, bytes)
    }
}

/// A destination buffer owned by someone who keeps it alive until `status` finishes.
pub struct RecvBuf {
    pub ptr: *mut u8,
    pub len: usize,
    pub fold: Option<Fold>,
}
// SAFETY: the poster keeps the buffer valid, and touches it not, until the
// receive's status finishes (`Transport::recv`), whichever thread fills
// it; the RecvBuf is its only user meanwhile.
unsafe impl Send for RecvBuf {}

pub struct PostedRecv {
    pub buf: RecvBuf,
    pub status: Arc<Status>,
    /// Posted for any peer: finishing reports the sender's rank, not the length.
    pub any_source: Option<Sources>,
}

/// How an any-source receive names its sender: by the rank of the
/// connections' owner, or (a group that shares them) by its rank in the
/// group, `members[i]` being rank i.
#[derive(Clone)]
pub enum Sources {
    Owner,
    Members(Arc<[usize]>),
}

impl PostedRecv {
    /// The buffer is filled with `len` bytes from `peer`.
    pub fn complete(self, len: usize, peer: usize) {
        let reported = match &self.any_source {
            None => len,
            Some(Sources::Owner) => peer,
            // A message of the group's channel comes from a member; were it
            // not one, the receive fails rather than name someone else.
            Some(Sources::Members(m)) => match m.iter().position(|&r| r == peer) {
                Some(rank) => rank,
                None => {
                    let why = format!("a message for an any-source receive came from rank {peer}, not a member");
                    self.status.finish(Err(Error::io(why)));
                    return;
                }
            },
        };
        self.status.finish(Ok(reported as i64));
    }

    /// Fill from an early message: it was read into memory, and is now
    /// copied (or folded) out, two passes over its bytes; a copy more than
    /// a receive read straight into place, the same as a fold.
    fn fill(self, data: &[u8], peer: usize) {
        self.status.copied(2 * data.len());
        if self.buf.fold.is_none() {
            self.status.early(data.len());
        }
        match &self.buf.fold {
            // SAFETY: `data.len()` is the buffer's length (both callers match the
            // lengths first); the poster keeps it valid and untouched until the
            // status finishes, and this PostedRecv, taken out of the mailbox, is
            // its only user.
            Some(fold) => fold.apply(unsafe { std::slice::from_raw_parts_mut(self.buf.ptr, data.len()) }, data),
            // SAFETY: as for the fold above: `data.len()` bytes fit the buffer, which
            // is this receive's alone; `data` is the mailbox's own copy, other memory.
            None => unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.buf.ptr, data.len()) },
        }
        self.complete(data.len(), peer);
    }
}

/// Receives posted for any peer, shared by every peer's mailbox. A message
/// goes to a receive posted for its own peer first, then to one of these.
#[derive(Default)]
pub struct AnyPosted(HashMap<Key, VecDeque<PostedRecv>>);

impl AnyPosted {
    pub fn push(&mut self, key: Key, recv: PostedRecv) {
        self.0.entry(key).or_default().push_back(recv);
    }

    fn pop(&mut self, key: Key) -> Option<PostedRecv> {
        pop_front(&mut self.0, key)
    }

    /// A peer was lost: every receive from any peer fails, as the message it
    /// waits for may have been that peer's (Gloo fails them alike).
    pub fn fail_all(&mut self, err: &Error) -> usize {
        fail_where(&mut self.0, |_| true, err)
    }

    /// This rank closed group `group`: that group's receives from any peer fail.
    pub fn fail_group(&mut self, group: u64, err: &Error) -> usize {
        fail_where(&mut self.0, |k| k.group == group, err)
    }

    /// `peer` (the connections' rank) gave up on group `group`: that
    /// group's receives from any peer fail, where `peer` is one of their
    /// group's members. An abort from a rank outside the group, which no
    /// receive of it could have waited for, fails none of them.
    pub fn fail_group_from(&mut self, group: u64, peer: usize, err: &Error) -> usize {
        let fails = |q: &mut VecDeque<PostedRecv>| {
            let (failed, kept): (Vec<_>, Vec<_>) = q.drain(..).partition(|p| match &p.any_source {
                Some(Sources::Members(members)) => members.contains(&peer),
                Some(Sources::Owner) | None => true,
            });
            *q = kept.into();
            failed
        };
        let mut failed = Vec::new();
        for (_, q) in self.0.iter_mut().filter(|(k, _)| k.group == group) {
            failed.extend(fails(q));
        }
        self.0.retain(|_, q| !q.is_empty());
        let n = failed.len();
        for p in failed {
            p.status.finish(Err(err.clone()));
        }
        n
    }

    /// Take back a receive that no reader has claimed yet.
    pub fn remove(&mut self, key: Key, status: &Arc<Status>) -> Option<PostedRecv> {
        let q = self.0.get_mut(&key)?;
        let i = q.iter().position(|p| Arc::ptr_eq(&p.status, status))?;
        let p = q.remove(i);
        if q.is_empty() {
            self.0.remove(&key);
        }
        p
    }
}

/// Fail the receives whose key `which` picks; how many.
fn fail_where(map: &mut HashMap<Key, VecDeque<PostedRecv>>, which: impl Fn(&Key) -> bool, err: &Error) -> usize {
    let keys: Vec<Key> = map.keys().filter(|k| which(k)).copied().collect();
    let mut failed = 0;
    for key in keys {
        for p in map.remove(&key).unwrap_or_default() {
            p.status.finish(Err(err.clone()));
            failed += 1;
        }
    }
    failed
}

fn pop_front<T>(map: &mut HashMap<Key, VecDeque<T>>, key: Key) -> Option<T> {
    let q = map.get_mut(&key)?;
    let item = q.pop_front();
    if q.is_empty() {
        map.remove(&key);
    }
    item
}

/// Where the payload of an arriving frame goes.
pub enum Delivery {
    /// Straight into this posted buffer (the sizes agree).
    Direct(PostedRecv),
    /// A receive is posted but its size differs: drain the payload and fail it.
    Mismatch(PostedRecv),
    /// Nobody is waiting yet: read it into memory and `stash` it.
    Stash,
    /// Its group's channel is closed here: read past it.
    Drop,
}

impl Default for Mailbox {
    /// Peer 0's, with the default cap.
    fn default() -> Mailbox {
        Mailbox::new(0)
    }
}

/// Messages that arrived before their receive, by key, and the bytes they
/// hold with those a reader is reading in (admitted, not yet stashed).
#[derive(Default)]
struct Early {
    by_key: HashMap<Key, VecDeque<Vec<u8>>>,
    bytes: u64,
}

impl Early {
    fn pop_front(&mut self, key: Key) -> Option<Vec<u8>> {
        let data = pop_front(&mut self.by_key, key)?;
        self.bytes -= data.len() as u64;
        Some(data)
    }

    /// Keep `data`, admitted (counted) already.
    fn keep(&mut self, key: Key, data: Vec<u8>) {
        self.by_key.entry(key).or_default().push_back(data);
    }

    /// Put back what `pop_front` took.
    fn put_back(&mut self, key: Key, data: Vec<u8>) {
        self.bytes += data.len() as u64;
        self.by_key.entry(key).or_default().push_front(data);
    }

    fn retain(&mut self, keep: impl Fn(&Key) -> bool) {
        let bytes = &mut self.bytes;
        self.by_key.retain(|k, q| {
            let kept = keep(k);
            if !kept {
                *bytes -= q.iter().map(|d| d.len() as u64).sum::<u64>();
            }
            kept
        });
    }
}

pub struct Mailbox {
    /// The peer whose messages land here.
    peer: usize,
    posted: HashMap<Key, VecDeque<PostedRecv>>,
    early: Early,
    /// Most bytes of this peer's messages kept for receives not yet posted
    /// (`RUSTC10D_EARLY_BYTES_MAX`): past it, its connections are read no
    /// further until a receive takes some (`admit_early`).
    early_max: u64,
    closed: Option<Error>,
    /// Channels of groups that share the connections, closed for this
    /// peer: the peer gave up on the group, or this rank left it; the most
    /// recent `CLOSED_KEPT` of them, oldest first in `closed_order`.
    closed_groups: HashMap<u64, ClosedGroup>,
    closed_order: VecDeque<u64>,
}

/// How many closed groups each peer's mailbox remembers. A closed group is
/// remembered so that its late messages (on another lane, a moment after
/// its close) are dropped rather than kept for a receive that never comes;
/// a job that makes and destroys a group every step, or a member that
/// sends aborts for made-up groups, would otherwise grow the table for the
/// life of the process. A message of a group forgotten here (after this
/// many later closes) is kept as an early message, which the early-bytes
/// cap bounds.
pub const CLOSED_KEPT: usize = 1024;

/// The default of `RUSTC10D_EARLY_BYTES_MAX`: bytes of one peer's messages
/// kept for receives not yet posted. A member that sends more ahead than
/// this (a flood, or a program that posts its receives in another order
/// than its peer sends) is read no further until a receive takes some:
/// memory stays bounded, and such a program's op times out naming the peer.
pub const EARLY_BYTES_MAX: u64 = 1 << 30;

/// Why a group's channel with one peer is closed, and what of it is still taken.
struct ClosedGroup {
    why: Error,
    /// While only the peer has given up, the messages of collectives below
    /// this sequence number it sent in full before: they are still taken,
    /// arrived already or still on another lane, as after a lost peer
    /// (`close`) what arrived is. Once this rank leaves the group (0), the
    /// group's messages are all dropped, early and late: channel numbers
    /// are not reused (see channel.rs).
    sent_below: u64,
    /// Its point-to-point messages are still taken: the peer left the
    /// group (destroyed it) after sending them, and said so on the
    /// connection they travel on, behind them (`Core::tell_group_leave`).
    /// So a point-to-point receive that none of those that came meets
    /// fails: posted then, or when it is posted.
    p2p: bool,
}

impl ClosedGroup {
    fn takes(&self, key: &Key) -> bool {
        (key.kind == KIND_COLLECTIVE && key.channel < self.sent_below) || (key.kind == KIND_P2P && self.p2p)
    }
}

impl Mailbox {
    pub fn new(peer: usize) -> Mailbox {
        Mailbox::with_early_max(peer, EARLY_BYTES_MAX)
    }

    /// Keeping at most `early_max` bytes of the peer's messages ahead of their receives.
    pub fn with_early_max(peer: usize, early_max: u64) -> Mailbox {
        Mailbox {
            peer,
            posted: HashMap::new(),
            early: Early::default(),
            early_max,
            closed: None,
            closed_groups: HashMap::new(),
            closed_order: VecDeque::new(),
        }
    }

    /// A reader may read a message of `len` bytes into memory for a receive
    /// not yet posted: true (and counted from now) if that keeps the peer
    /// within its cap. False: read no further until a receive takes some.
    /// A message larger than the whole cap waits for its own receive.
    pub fn admit_early(&mut self, len: u64) -> bool {
        let admitted = self.early.bytes.checked_add(len).is_some_and(|b| b <= self.early_max);
        if admitted {
            self.early.bytes += len;
        }
        admitted
    }

    pub fn early_max(&self) -> u64 {
        self.early_max
    }

    /// Bytes kept (or being read in) for receives not yet posted.
    pub fn early_bytes(&self) -> u64 {
        self.early.bytes
    }

    /// A frame header arrived from this peer (`any` is taken under the mailbox).
    pub fn on_header(&mut self, key: Key, len: u64, any: &Mutex<level::AnyPosted, AnyPosted>) -> Delivery {
        if self.closed_groups.get(&key.group).is_some_and(|c| !c.takes(&key)) {
            return Delivery::Drop;
        }
        let posted = pop_front(&mut self.posted, key).or_else(|| any.lock().unwrap().pop(key));
        let Some(p) = posted else { return Delivery::Stash };
        if p.buf.len as u64 == len {
            Delivery::Direct(p)
        } else {
            Delivery::Mismatch(p)
        }
    }

    /// An early payload (admitted: `admit_early`) was read into memory. A
    /// receive may have been posted while it was being read: then it completes now.
    pub fn stash(&mut self, key: Key, data: Vec<u8>, any: &Mutex<level::AnyPosted, AnyPosted>) {
        let len = data.len() as u64;
        match self.on_header(key, len, any) {
            Delivery::Stash => return self.early.keep(key, data),
            Delivery::Direct(p) => p.fill(&data, self.peer),
            Delivery::Mismatch(p) => fail_mismatch(p, len, self.peer),
            Delivery::Drop => {}
        }
        self.early.bytes -= len;
    }

    /// A whole message that no reader admitted (the fake transport hands
    /// messages over whole): delivered as `stash` does, kept whatever the cap.
    pub fn arrived(&mut self, key: Key, data: Vec<u8>, any: &Mutex<level::AnyPosted, AnyPosted>) {
        self.early.bytes += data.len() as u64;
        self.stash(key, data, any);
    }

    /// Post a receive. It completes at once from an early message, fails at
    /// once if the peer is gone, or waits for the reader.
    pub fn post(&mut self, key: Key, recv: PostedRecv) {
        if let Some(c) = self.closed_groups.get(&key.group).filter(|c| !c.takes(&key)) {
            recv.status.finish(Err(c.why.clone()));
            return;
        }
        if let Some(data) = self.early.pop_front(key) {
            if data.len() == recv.buf.len {
                recv.fill(&data, self.peer);
            } else {
                fail_mismatch(recv, data.len() as u64, self.peer);
            }
            return;
        }
        // The peer destroyed the group: its point-to-point messages all
        // came ahead of its notice, and this receive met none of them.
        if let Some(c) = self.closed_groups.get(&key.group).filter(|_| key.kind == KIND_P2P) {
            recv.status.finish(Err(c.why.clone()));
            return;
        }
        // A group closed for the peer but still taking this key (above)
        // waits for it: it may be on another lane yet.
        if let Some(err) = &self.closed {
            recv.status.finish(Err(err.clone()));
            return;
        }
        self.posted.entry(key).or_default().push_back(recv);
    }

    /// Hand an early message to a receive posted for any peer, unless a reader
    /// has claimed that receive meanwhile. True if `status` is now finished
    /// (by this call or by the reader).
    pub fn offer_early(&mut self, key: Key, status: &Arc<Status>, any: &Mutex<level::AnyPosted, AnyPosted>) -> bool {
        let Some(data) = self.early.pop_front(key) else { return false };
        match any.lock().unwrap().remove(key, status) {
            Some(p) if p.buf.len == data.len() => p.fill(&data, self.peer),
            Some(p) => fail_mismatch(p, data.len() as u64, self.peer),
            None => self.early.put_back(key, data),
        }
        true
    }

    /// Withdraw a posted receive that has not started. False if the reader
    /// already owns it (it will finish it) or it is finished.
    pub fn cancel(&mut self, key: Key, status: &Arc<Status>) -> bool {
        let Some(q) = self.posted.get_mut(&key) else { return false };
        let Some(i) = q.iter().position(|p| Arc::ptr_eq(&p.status, status)) else { return false };
        q.remove(i);
        if q.is_empty() {
            self.posted.remove(&key);
        }
        true
    }

    /// How many closed groups it remembers.
    pub fn closed_groups(&self) -> usize {
        self.closed_groups.len()
    }

    /// Why the peer is gone, once it is.
    pub fn closed(&self) -> Option<&Error> {
        self.closed.as_ref()
    }

    /// Why group `group`'s messages from this peer will not come, once they will not.
    pub fn closed_for(&self, group: u64) -> Option<&Error> {
        self.closed.as_ref().or_else(|| self.closed_groups.get(&group).map(|c| &c.why))
    }

    /// The peer gave up on group `group`, having sent every message of the
    /// group's collectives below `sent_below`: receives of those stay, the
    /// group's other receives fail with `err`, now and later. Returns how
    /// many receives failed.
    pub fn peer_left_group(&mut self, group: u64, sent_below: u64, err: Error) -> usize {
        self.close_group_where(group, ClosedGroup { why: err, sent_below, p2p: false })
    }

    /// The peer destroyed group `group` having sent every message of its
    /// collectives below `sent_below` and of its point-to-point ops. The
    /// collectives' stay (arrived, or still to arrive on another lane); the
    /// point-to-point ones came ahead of this notice, on the connection it
    /// came on: those stay, and a point-to-point receive that none of them
    /// met fails. The group's other receives from it fail with `err`, now
    /// and later. Returns how many failed.
    pub fn peer_destroyed_group(&mut self, group: u64, sent_below: u64, err: Error) -> usize {
        let failed = self.close_group_where(group, ClosedGroup { why: err, sent_below, p2p: true });
        let why = self.closed_groups[&group].why.clone();
        failed + fail_where(&mut self.posted, |k| k.group == group && k.kind == KIND_P2P, &why)
    }

    /// This rank closes group `group`'s channel with this peer: its waiting
    /// receives fail with `err`, and so do later ones; its messages are
    /// dropped, early and late. Returns how many receives failed.
    pub fn close_group(&mut self, group: u64, err: Error) -> usize {
        self.close_group_where(group, ClosedGroup { why: err, sent_below: 0, p2p: false })
    }

    /// Narrow what group `group` still takes to what `closed` takes (the
    /// first reason stays), dropping and failing the rest.
    fn close_group_where(&mut self, group: u64, closed: ClosedGroup) -> usize {
        if !self.closed_groups.contains_key(&group) {
            self.closed_order.push_back(group);
            if self.closed_order.len() > CLOSED_KEPT {
                let oldest = self.closed_order.pop_front().expect("more than CLOSED_KEPT");
                self.closed_groups.remove(&oldest);
            }
        }
        let c =
            self.closed_groups.entry(group).or_insert(ClosedGroup { why: closed.why, sent_below: u64::MAX, p2p: true });
        c.sent_below = c.sent_below.min(closed.sent_below);
        c.p2p &= closed.p2p;
        let c = &*c;
        self.early.retain(|k| k.group != group || c.takes(k));
        fail_where(&mut self.posted, |k| k.group == group && !c.takes(k), &c.why)
    }

    /// The peer is gone: fail every waiting receive and all later ones.
    /// Returns how many were waiting.
    pub fn close(&mut self, err: Error) -> usize {
        if self.closed.is_none() {
            self.closed = Some(err.clone());
        }
        fail_where(&mut self.posted, |_| true, &err)
    }
}

pub fn fail_mismatch(p: PostedRecv, got: u64, peer: usize) {
    p.status.finish(Err(Error::invalid(format!(
        "size mismatch: the receive expects {} bytes but rank {peer} sent {got}",
        p.buf.len
    ))));
}

/// Deliver `data` the way a reader would.
#[cfg(test)]
pub fn deliver(mb: &mut Mailbox, key: Key, data: &[u8], any: &Mutex<level::AnyPosted, AnyPosted>) {
    match mb.on_header(key, data.len() as u64, any) {
        Delivery::Direct(p) => p.fill(data, mb.peer),
        Delivery::Mismatch(p) => fail_mismatch(p, data.len() as u64, mb.peer),
        Delivery::Stash => mb.arrived(key, data.to_vec(), any),
        Delivery::Drop => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post(mb: &mut Mailbox, key: Key, buf: &mut [u8]) -> Arc<Status> {
        let status = Status::new();
        mb.post(
            key,
            PostedRecv {
                buf: RecvBuf { ptr: buf.as_mut_ptr(), len: buf.len(), fold: None },
                status: status.clone(),
                any_source: None,
            },
        );
        status
    }

    #[test]
    fn folds_apply_to_early_and_late_messages_even_empty_or_misaligned() {
        // A fold as the reduction kernels see it: both sides must be 8-byte aligned.
        let fold = Fold {
            unit: 8,
            f: Arc::new(|dst: &mut [u8], src: &[u8]| {
                assert!(src.is_empty() || (src.as_ptr() as usize).is_multiple_of(8), "misaligned source");
                for (d, s) in dst.iter_mut().zip(src) {
                    *d += s;
                }
            }),
        };
        let mut mb = Mailbox::default();
        let post_folded = |mb: &mut Mailbox, key, buf: &mut [u8]| {
            let status = Status::new();
            let recv = RecvBuf { ptr: buf.as_mut_ptr(), len: buf.len(), fold: Some(fold.clone()) };
            mb.post(key, PostedRecv { buf: recv, status: status.clone(), any_source: None });
            status
        };
        // Empty (a dangling pointer), early then posted.
        deliver(&mut mb, Key::collective(1, 0), &[], &Mutex::default());
        assert!(post_folded(&mut mb, Key::collective(1, 0), &mut []).result().unwrap().is_ok());
        // Early, then posted: folded, not copied.
        deliver(&mut mb, Key::collective(2, 0), &[2u8; 8], &Mutex::default());
        let mut acc = [1u8; 8];
        assert!(post_folded(&mut mb, Key::collective(2, 0), &mut acc).result().unwrap().is_ok());
        assert_eq!(acc, [3; 8]);
        // A source at an odd address is realigned first.
        let unaligned = &[5u8; 9][1..];
        let mut acc = [1u8; 8];
        Fold::apply(&fold, &mut acc, unaligned);
        assert_eq!(acc, [6; 8]);
    }

    /// Early bytes count from a reader's admission until a receive takes
    /// them or their group closes, and never go past the cap.
    #[test]
    fn early_bytes_are_counted_from_admission_to_their_receive_and_capped() {
        let any = Mutex::default();
        let mut mb = Mailbox::with_early_max(1, 100);
        assert!(mb.admit_early(60));
        assert!(!mb.admit_early(41), "past the cap");
        assert!(mb.admit_early(40));
        assert!(!mb.admit_early(1));
        mb.stash(Key::p2p(1), vec![1; 60], &any);
        mb.stash(Key::p2p(2).in_group(5), vec![2; 40], &any);
        assert_eq!(mb.early_bytes(), 100);
        let mut buf = [0u8; 60];
        let taken = post(&mut mb, Key::p2p(1), &mut buf);
        assert_eq!((taken.result().unwrap().unwrap(), buf), (60, [1; 60]));
        assert_eq!(mb.early_bytes(), 40, "a receive took 60");
        mb.close_group(5, Error::aborted("closed"));
        assert_eq!(mb.early_bytes(), 0, "the closed group's message is dropped");
        // Admitted, then a receive was posted while it was read: it goes there, not kept.
        assert!(mb.admit_early(100));
        let mut buf = [0u8; 100];
        let status = post(&mut mb, Key::p2p(3), &mut buf);
        mb.stash(Key::p2p(3), vec![3; 100], &any);
        assert_eq!((status.result().unwrap().unwrap(), mb.early_bytes()), (100, 0));
        assert!(!mb.admit_early(u64::MAX - 5), "no overflow");
        assert!(mb.admit_early(100));
    }

    /// A job that makes and destroys a group every step closes one group
    /// per peer per step: the mailbox remembers the last CLOSED_KEPT, whose
    /// late messages it still drops.
    #[test]
    fn closed_groups_are_remembered_up_to_a_bound() {
        let mut mb = Mailbox::default();
        let any = Mutex::default();
        for g in 1..=3 * CLOSED_KEPT as u64 {
            mb.close_group(g, Error::peer_lost("destroyed"));
        }
        assert_eq!((mb.closed_groups.len(), mb.closed_order.len()), (CLOSED_KEPT, CLOSED_KEPT));
        let newest = Key::collective(0, 0).in_group(3 * CLOSED_KEPT as u64);
        assert!(matches!(mb.on_header(newest, 8, &any), Delivery::Drop), "a recent group's late message");
        let forgotten = Key::collective(0, 0).in_group(1);
        assert!(matches!(mb.on_header(forgotten, 8, &any), Delivery::Stash), "kept as early, under its cap");
        // Closing a remembered group again neither grows nor reorders the table.
        mb.close_group(3 * CLOSED_KEPT as u64, Error::peer_lost("again"));
        assert_eq!(mb.closed_order.len(), CLOSED_KEPT);
    }

    /// An abort of group g from a rank outside it fails none of g's
    /// any-source receives; from a member, it fails them all.
    #[test]
    fn an_abort_from_outside_a_group_fails_none_of_its_receives_from_any_peer() {
        let mut any = AnyPosted::default();
        let g = 0xABC;
        let mut bufs = [[0u8; 4]; 2];
        let statuses: Vec<_> = bufs
            .iter_mut()
            .map(|buf| {
                let status = Status::new();
                let members: Arc<[usize]> = Arc::from([0, 2]);
                let recv = PostedRecv {
                    buf: RecvBuf { ptr: buf.as_mut_ptr(), len: buf.len(), fold: None },
                    status: status.clone(),
                    any_source: Some(Sources::Members(members)),
                };
                any.push(Key::p2p(7).in_group(g), recv);
                status
            })
            .collect();
        assert_eq!(any.fail_group_from(g, 1, &Error::peer_lost("rank 1 is not in it")), 0);
        assert_eq!(any.fail_group_from(g + 1, 2, &Error::peer_lost("another group")), 0);
        assert!(statuses.iter().all(|s| !s.is_done()));
        assert_eq!(any.fail_group_from(g, 2, &Error::peer_lost("a member gave up")), 2);
        assert!(statuses.iter().all(|s| s.result().unwrap().is_err()));
    }

    #[test]
    fn posted_then_arrived_and_early_then_posted() {
        let mut mb = Mailbox::default();
        let mut a = [0u8; 3];
        let sa = post(&mut mb, Key::p2p(1), &mut a);
        assert!(!sa.is_done());
        deliver(&mut mb, Key::p2p(1), &[1, 2, 3], &Mutex::default());
        assert_eq!(sa.result().unwrap().unwrap(), 3);
        assert_eq!(a, [1, 2, 3]);

        deliver(&mut mb, Key::p2p(2), &[9, 9], &Mutex::default());
        let mut b = [0u8; 2];
        let sb = post(&mut mb, Key::p2p(2), &mut b);
        assert!(sb.is_done());
        assert_eq!(b, [9, 9]);
    }

    #[test]
    fn same_key_matches_in_order_and_tags_do_not_mix() {
        let mut mb = Mailbox::default();
        deliver(&mut mb, Key::p2p(5), &[1], &Mutex::default());
        deliver(&mut mb, Key::p2p(6), &[6], &Mutex::default());
        deliver(&mut mb, Key::p2p(5), &[2], &Mutex::default());
        let (mut x, mut y, mut z) = ([0u8], [0u8], [0u8]);
        post(&mut mb, Key::p2p(5), &mut x);
        post(&mut mb, Key::p2p(5), &mut y);
        post(&mut mb, Key::p2p(6), &mut z);
        assert_eq!((x, y, z), ([1], [2], [6]));
    }

    #[test]
    fn size_mismatch_fails_the_receive() {
        let mut mb = Mailbox::default();
        let mut a = [0u8; 4];
        let s = post(&mut mb, Key::collective(1, 0), &mut a);
        deliver(&mut mb, Key::collective(1, 0), &[1, 2], &Mutex::default());
        let err = s.result().unwrap().unwrap_err();
        assert!(err.message.contains("size mismatch"), "{}", err.message);
    }

    #[test]
    fn cancel_and_close() {
        let mut mb = Mailbox::default();
        let mut a = [0u8; 1];
        let mut b = [0u8; 1];
        let sa = post(&mut mb, Key::p2p(1), &mut a);
        let sb = post(&mut mb, Key::p2p(1), &mut b);
        assert!(mb.cancel(Key::p2p(1), &sa));
        assert!(!mb.cancel(Key::p2p(1), &sa));
        mb.close(Error::peer_lost("gone"));
        assert!(!sa.is_done(), "a cancelled receive is the canceller's to finish");
        assert_eq!(sb.result().unwrap().unwrap_err().message, "gone");
        let mut c = [0u8; 1];
        let sc = post(&mut mb, Key::p2p(1), &mut c);
        assert!(sc.result().unwrap().is_err(), "posting to a closed mailbox fails at once");
    }

    /// A peer finishes collective 0 of a group and gives up on it in
    /// collective 1 (a mismatch, say). Its messages of collective 0 were all
    /// sent, some on another lane that is read after its reason: they still
    /// complete receives, posted before or after. Collective 1's fail, even
    /// where a message of it came; other groups go on.
    #[test]
    fn a_peer_that_gave_up_on_a_group_still_delivers_what_it_sent_before() {
        let any = Mutex::new(AnyPosted::default());
        let (g, other) = (7, 8);
        let key = |seq, step| Key::collective(seq, step).in_group(g);
        let mut mb = Mailbox::default();
        let (mut waiting, mut failing, mut sibling) = ([0u8], [0u8], [0u8]);
        let s_waiting = post(&mut mb, key(0, 2), &mut waiting);
        let s_failing = post(&mut mb, key(1, 0), &mut failing);
        let s_sibling = post(&mut mb, Key::collective(1, 0).in_group(other), &mut sibling);
        deliver(&mut mb, key(0, 0), &[4], &any);
        deliver(&mut mb, key(1, 1), &[9], &any);
        assert_eq!(mb.peer_left_group(g, 1, Error::peer_lost("gave up")), 1);
        // Read after the reason, from other lanes.
        deliver(&mut mb, key(0, 1), &[5], &any);
        deliver(&mut mb, key(0, 2), &[6], &any);
        deliver(&mut mb, key(1, 2), &[9], &any);

        let (mut first, mut second, mut partial, mut p2p) = ([0u8], [0u8], [0u8], [0u8]);
        let s_first = post(&mut mb, key(0, 0), &mut first);
        let s_second = post(&mut mb, key(0, 1), &mut second);
        let s_partial = post(&mut mb, key(1, 1), &mut partial);
        let s_p2p = post(&mut mb, Key::p2p(0).in_group(g), &mut p2p);
        for s in [&s_first, &s_second, &s_waiting] {
            assert_eq!(s.result().unwrap().unwrap(), 1);
        }
        assert_eq!((first, second, waiting), ([4], [5], [6]));
        // Posted after the reason, before its message (still on its lane).
        let mut late = [0u8];
        let s_late = post(&mut mb, key(0, 5), &mut late);
        assert!(!s_late.is_done(), "a receive of a collective the peer sent in full waits for its message");
        deliver(&mut mb, key(0, 5), &[3], &any);
        assert_eq!((s_late.result().unwrap().unwrap(), late), (1, [3]));
        for s in [&s_failing, &s_partial, &s_p2p] {
            assert_eq!(s.result().unwrap().unwrap_err().message, "gave up");
        }
        assert_eq!(partial, [0], "a failed receive leaves its buffer as it was");
        assert!(!s_sibling.is_done(), "another group's receive waits on");

        // This rank leaves the group: what is left of it goes, and what comes later.
        deliver(&mut mb, key(0, 3), &[7], &any);
        mb.close_group(g, Error::aborted("left"));
        deliver(&mut mb, key(0, 4), &[8], &any);
        assert!(mb.early.by_key.keys().all(|k| k.group != g), "a group this rank left keeps no messages");
    }

    /// A peer destroys a group after collective 0 and a point-to-point
    /// send: both still complete receives, posted before or after, the
    /// collective's message arrived before the notice or after it on another
    /// lane; a point-to-point receive that no message met fails when the
    /// notice comes, or at once when posted after it (its messages travel
    /// ahead of the notice, on its connection); so does a receive of a later
    /// collective; a later abort, or this rank leaving, takes the
    /// point-to-point messages back.
    #[test]
    fn a_peer_that_destroyed_a_group_still_delivers_what_it_sent_before() {
        let any = Mutex::new(AnyPosted::default());
        let g = 7;
        let key = |seq, step| Key::collective(seq, step).in_group(g);
        let mut mb = Mailbox::default();
        let (mut sent, mut later, mut p2p_early, mut p2p_never) = ([0u8], [0u8], [0u8], [0u8]);
        let s_sent = post(&mut mb, key(0, 1), &mut sent);
        let s_later = post(&mut mb, key(1, 0), &mut later);
        let s_never = post(&mut mb, Key::p2p(9).in_group(g), &mut p2p_never);
        let mut other = [0u8];
        let s_other_group = post(&mut mb, Key::p2p(9).in_group(g + 1), &mut other);
        deliver(&mut mb, Key::p2p(3).in_group(g), &[5], &any);
        assert_eq!(mb.peer_destroyed_group(g, 1, Error::peer_lost("left")), 2);
        assert_eq!(s_later.result().unwrap().unwrap_err().message, "left");
        assert_eq!(s_never.result().unwrap().unwrap_err().message, "left");
        assert_eq!(p2p_never, [0], "a failed receive leaves its buffer as it was");
        assert!(!s_other_group.is_done(), "another group's receive waits on");
        assert!(!s_sent.is_done(), "collective 0 was sent in full: its receive waits for its message");
        deliver(&mut mb, key(0, 1), &[6], &any);
        let s_early = post(&mut mb, Key::p2p(3).in_group(g), &mut p2p_early);
        assert_eq!((s_sent.result().unwrap().unwrap(), sent), (1, [6]));
        assert_eq!((s_early.result().unwrap().unwrap(), p2p_early), (1, [5]));
        let mut again = [0u8];
        let s_again = post(&mut mb, Key::p2p(3).in_group(g), &mut again);
        assert_eq!(s_again.result().unwrap().unwrap_err().message, "left", "no second message comes");
        let mut next = [0u8];
        assert!(post(&mut mb, key(2, 0), &mut next).result().unwrap().is_err(), "a later collective fails at once");
        // An abort after the notice: the point-to-point messages that came go too.
        deliver(&mut mb, Key::p2p(3).in_group(g), &[7], &any);
        mb.peer_left_group(g, 1, Error::peer_lost("gave up"));
        let mut dropped = [0u8];
        assert!(post(&mut mb, Key::p2p(3).in_group(g), &mut dropped).result().unwrap().is_err());
        assert_eq!(dropped, [0]);
    }

    #[test]
    fn any_source_receives_report_the_sender() {
        let any = Mutex::new(AnyPosted::default());
        let (mut m1, mut m2) = (Mailbox::new(1), Mailbox::new(2));
        // Posted first, then a message from peer 2 arrives.
        let mut a = [0u8; 2];
        let sa = Status::new();
        any.lock().unwrap().push(
            Key::p2p(0),
            PostedRecv {
                buf: RecvBuf { ptr: a.as_mut_ptr(), len: 2, fold: None },
                status: sa.clone(),
                any_source: Some(Sources::Owner),
            },
        );
        deliver(&mut m2, Key::p2p(0), &[4, 5], &any);
        assert_eq!(sa.result().unwrap().unwrap(), 2, "the source rank, not the length");
        assert_eq!(a, [4, 5]);
        // A message from peer 1 came early; the any-source receive takes it.
        deliver(&mut m1, Key::p2p(0), &[6, 7], &any);
        let mut b = [0u8; 2];
        let sb = Status::new();
        any.lock().unwrap().push(
            Key::p2p(0),
            PostedRecv {
                buf: RecvBuf { ptr: b.as_mut_ptr(), len: 2, fold: None },
                status: sb.clone(),
                any_source: Some(Sources::Owner),
            },
        );
        assert!(!m2.offer_early(Key::p2p(0), &sb, &any), "nothing early from peer 2");
        assert!(m1.offer_early(Key::p2p(0), &sb, &any));
        assert_eq!(sb.result().unwrap().unwrap(), 1);
        assert_eq!(b, [6, 7]);
        // A receive for a specific peer wins over an any-source one.
        let mut c = [0u8; 1];
        let mut d = [0u8; 1];
        let sd = Status::new();
        any.lock().unwrap().push(
            Key::p2p(3),
            PostedRecv {
                buf: RecvBuf { ptr: d.as_mut_ptr(), len: 1, fold: None },
                status: sd.clone(),
                any_source: Some(Sources::Owner),
            },
        );
        let sc = post(&mut m1, Key::p2p(3), &mut c);
        deliver(&mut m1, Key::p2p(3), &[9], &any);
        assert!(sc.is_done() && !sd.is_done());
        assert!(any.lock().unwrap().remove(Key::p2p(3), &sd).is_some());
    }

    // Whatever the interleaving of posts and arrivals, every receive gets the
    // message of its key in FIFO order, and nothing is lost or duplicated.
    proptest::proptest! {
        #[test]
        fn fifo_per_key_under_any_interleaving(ops in proptest::collection::vec((0u8..3, proptest::prelude::any::<bool>()), 0..60)) {
            let any = Mutex::new(AnyPosted::default());
            let mut mb = Mailbox::new(1);
            let (mut sent, mut posted) = ([0u8; 3], [0u8; 3]);
            // (key, nth receive of that key, buffer, status)
            type Posted = (u8, u8, Box<[u8; 1]>, Arc<Status>);
            let mut bufs: Vec<Posted> = Vec::new();
            for (key, is_post) in ops {
                let k = Key::p2p(key as i64);
                if is_post {
                    let mut b = Box::new([0xFFu8; 1]);
                    let status = Status::new();
                    mb.post(k, PostedRecv { buf: RecvBuf { ptr: b.as_mut_ptr(), len: 1, fold: None }, status: status.clone(), any_source: None });
                    bufs.push((key, posted[key as usize], b, status));
                    posted[key as usize] += 1;
                } else {
                    deliver(&mut mb, k, &[sent[key as usize]], &any);
                    sent[key as usize] += 1;
                }
            }
            for (key, nth, b, status) in &bufs {
                let done = *nth < sent[*key as usize];
                proptest::prop_assert_eq!(status.is_done(), done);
                if done {
                    proptest::prop_assert_eq!(b[0], *nth, "the nth receive of a key gets its nth message");
                }
            }
        }
    }
}
