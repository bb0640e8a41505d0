//! An operation's transfers: what it sends and receives, waited for with
//! the op's deadline, and, whatever happens, done with before the memory
//! they touch is let go.
//!
//! Memory is lent inside `Transfers::scope`: `send` borrows the bytes for
//! the scope, `recv` and `send_mut` take a mutable slice and hand back a
//! `Lent`, which `give_back` returns as the slice once the transfer is done,
//! and `recv_after` hands a slice lent to a send on to a receive that the
//! transport posts once the send is done (`gate.rs`). The borrow checker then
//! proves what the algorithms' SAFETY comments used to argue: nothing writes
//! a range being sent, nothing touches one being received, and a slice whose
//! transfer was never waited for stays lent until the scope ends, which waits
//! for it (or withdraws it). The scope owns the `Transfers`, so it cannot be
//! leaked (`mem::forget`) with memory still lent. A `Transfers` may also own
//! a message's memory itself (`send_copy`, `recv_owned`): small messages a
//! helper builds.
//!
//! What the compiler keeps: a slice is written only once it is given back,
//!
//! ```no_run
//! # use rustc10d::transport::{Key, Transfers};
//! fn receive<'b>(tr: &mut Transfers<'_, 'b>, buf: &'b mut [u8]) {
//!     let lent = tr.recv(0, Key::collective(0, 0), buf).unwrap();
//!     let buf = tr.give_back(lent).unwrap();
//!     buf[0] = 1;
//! }
//! ```
//!
//! not while the transport may be filling it,
//!
//! ```compile_fail
//! # use rustc10d::transport::{Key, Transfers};
//! fn receive<'b>(tr: &mut Transfers<'_, 'b>, buf: &'b mut [u8]) {
//!     let lent = tr.recv(0, Key::collective(0, 0), buf).unwrap();
//!     buf[0] = 1;
//!     let _ = tr.give_back(lent);
//! }
//! ```
//!
//! nor while it is being sent.
//!
//! ```compile_fail
//! # use rustc10d::transport::{Key, Transfers};
//! fn send<'b>(tr: &mut Transfers<'_, 'b>, buf: &'b mut [u8]) {
//!     tr.send(1, Key::collective(0, 0), buf).unwrap();
//!     buf[0] = 1;
//! }
//! ```
//!
//! And a `Transfers` that `new` made, which may be leaked, lends only what
//! lives for ever: it does not pass for one of a shorter lifetime.
//!
//! ```compile_fail
//! # use rustc10d::transport::Transfers;
//! fn shorten<'t, 'b>(tr: Transfers<'t, 'static>) -> Transfers<'t, 'b> {
//!     tr
//! }
//! ```

use super::group::waits;
use super::{Fold, Gate, Key, RecvBuf, Transport, Wait, WaitOn};
use crate::error::{Error, Result};
use crate::status::{Cost, Status};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a transfer that cannot be withdrawn (it is being filled or
/// written right now) gets to finish before its connection is cut.
const CUT_GRACE: Duration = Duration::from_millis(500);

/// Give up on a transfer with `peer` (None: an any-source receive): withdraw
/// it if it has not begun, finishing it with `reason`; otherwise give it
/// CUT_GRACE to finish, then break the connection so that it does. Once this
/// returns, the transfer no longer touches its buffer, or soon will not (an
/// any-source receive being filled finishes on its own).
pub fn withdraw(
    transport: &dyn Transport,
    peer: Option<usize>,
    recv_key: Option<Key>,
    status: &Arc<Status>,
    reason: &Error,
) {
    if status.is_done() {
        return;
    }
    let withdrawn = match (recv_key, peer) {
        (Some(key), Some(peer)) => transport.cancel_recv(peer, key, status),
        (Some(key), None) => transport.cancel_recv_any(key, status),
        (None, _) => false,
    };
    if withdrawn {
        status.finish(Err(reason.clone()));
        return;
    }
    if status.wait(Some(Instant::now() + CUT_GRACE), Duration::ZERO).is_none() {
        if let Some(peer) = peer {
            transport.break_peer(peer, reason);
        }
    }
}

/// The transfers of one operation. It waits with the op's deadline and, when
/// dropped (success or error), makes sure no transfer still touches the
/// memory lent to it: that is what makes lending it safe. `'b`: how long
/// the memory lent to it (`send`, `recv`) stays lent (see the module doc).
pub struct Transfers<'t, 'b> {
    transport: &'t dyn Transport,
    deadline: Instant,
    timeout: Duration,
    what: String,
    spin: Duration,
    cost: Arc<Cost>,
    pending: Vec<Pending>,
    // Invariant in 'b: a Transfers made for one lifetime never passes for
    // one of a shorter (which would let it be leaked with memory of the
    // shorter lent).
    lent: PhantomData<&'b mut &'b ()>,
}

/// A slice lent to a transfer (`Transfers::recv`, `send_mut`): `give_back`
/// returns it once the transfer is done. Dropped, it stays lent until its
/// `Transfers` is dropped.
#[must_use = "a lent slice comes back through `give_back`"]
pub struct Lent<'b> {
    id: TransferId,
    /// Its transfer's, to tell it apart from another `Transfers`' of the
    /// same number (one lent in another scope of the same lifetime).
    status: Arc<Status>,
    ptr: *mut u8,
    len: usize,
    slice: PhantomData<&'b mut [u8]>,
}

impl Lent<'_> {
    /// The transfer, for `wait` or `finished_by` (the slice stays lent).
    pub fn id(&self) -> TransferId {
        self.id
    }
}

struct Pending {
    peer: usize,
    /// Some for receives (they can be cancelled), None for sends.
    recv_key: Option<Key>,
    status: Arc<Status>,
    /// The message's memory, where this `Transfers` owns it (`send_copy`,
    /// `recv_owned`): freed only after the transfer is done, when the
    /// `Transfers` is, however early its user returned.
    owned: Option<Vec<u8>>,
    /// A receive posted once a send is done (`recv_after`): whether it is yet.
    gate: Option<Arc<Gate>>,
}

/// Index of a transfer within its `Transfers`.
#[derive(Clone, Copy, Debug)]
pub struct TransferId(usize);

impl<'t> Transfers<'t, 'static> {
    /// `what` names the op for errors, e.g. "allreduce #4 on rank 1"; waits
    /// poll for `spin` before they sleep; the transfers are charged to `cost`.
    /// It lends memory by raw pointer only (or what lives for ever): `scope`
    /// lends borrowed slices.
    pub fn new(transport: &'t dyn Transport, timeout: Duration, what: String, spin: Duration, cost: Arc<Cost>) -> Self {
        Transfers::make(transport, timeout, what, spin, cost)
    }
}

impl<'t, 'b> Transfers<'t, 'b> {
    /// Runs `f` with transfers that may borrow memory for `'b`, and waits for
    /// (or withdraws) every one of them before it returns, `f`'s error or
    /// panic included. Arguments as for `new`.
    pub fn scope<R>(
        transport: &'t dyn Transport,
        timeout: Duration,
        what: String,
        spin: Duration,
        cost: Arc<Cost>,
        f: impl FnOnce(&mut Transfers<'t, 'b>) -> R,
    ) -> R {
        // 'b outlives this call (a lifetime parameter does), and `tr`, which
        // no one else can own (`f` gets it by reference, and there is no
        // other way to make one for 'b), is dropped, waiting, before it returns.
        let mut tr = Transfers::make(transport, timeout, what, spin, cost);
        f(&mut tr)
    }

    fn make(transport: &'t dyn Transport, timeout: Duration, what: String, spin: Duration, cost: Arc<Cost>) -> Self {
        Transfers {
            transport,
            deadline: Instant::now() + timeout,
            timeout,
            what,
            spin,
            cost,
            pending: Vec::new(),
            lent: PhantomData,
        }
    }

    /// Send `data`, borrowed until the scope ends (so nothing writes it meanwhile).
    pub fn send(&mut self, peer: usize, key: Key, data: &'b [u8]) -> Result<TransferId> {
        // SAFETY: `data` stays borrowed, unwritten, for 'b, which this
        // Transfers outlives only in `new`'s form, where 'b is 'static.
        unsafe { self.send_raw(peer, key, data) }
    }

    /// Send `data`, which `give_back` returns once the send is done (to be
    /// written again, say by a later receive).
    pub fn send_mut(&mut self, peer: usize, key: Key, data: &'b mut [u8]) -> Result<Lent<'b>> {
        let len = data.len();
        self.send_head(peer, key, data, len)
    }

    /// Send the first `len` bytes of `data`, and lend all of it: `give_back`
    /// returns it whole, so that memory cut once carries messages of
    /// several sizes (a ring's rotating buffers, blocks of different sizes).
    pub fn send_head(&mut self, peer: usize, key: Key, data: &'b mut [u8], len: usize) -> Result<Lent<'b>> {
        assert!(len <= data.len(), "a message is sent from inside its slice");
        let (ptr, whole) = (data.as_mut_ptr(), data.len());
        // SAFETY: the slice is moved into the Lent, out of everyone's reach
        // until `give_back` returns it, after the send is done; or it stays
        // lent for 'b, see `send`. Its first `len` bytes are in it (asserted).
        let id = unsafe { self.send_raw(peer, key, std::slice::from_raw_parts(ptr, len))? };
        Ok(self.lent(id, ptr, whole))
    }

    /// Receive into `data`, which `give_back` returns once the message is in.
    pub fn recv(&mut self, peer: usize, key: Key, data: &'b mut [u8]) -> Result<Lent<'b>> {
        self.recv_folded(peer, key, data, None)
    }

    /// Like `recv`, folding the message into what `data` holds (see `Fold`).
    pub fn recv_folded(&mut self, peer: usize, key: Key, data: &'b mut [u8], fold: Option<Fold>) -> Result<Lent<'b>> {
        let len = data.len();
        self.recv_head(peer, key, data, len, fold)
    }

    /// Like `recv_folded`, into the first `len` bytes of `data`, lending all
    /// of it (see `send_head`).
    pub fn recv_head(
        &mut self,
        peer: usize,
        key: Key,
        data: &'b mut [u8],
        len: usize,
        fold: Option<Fold>,
    ) -> Result<Lent<'b>> {
        assert!(len <= data.len(), "a message is received inside its slice");
        let (ptr, whole) = (data.as_mut_ptr(), data.len());
        // SAFETY: as in `send_head`: nobody touches the slice until the
        // receive is done (`give_back`) or the Transfers is dropped; the
        // receive writes its first `len` bytes (asserted) only.
        let id = unsafe { self.recv_folded_raw(peer, key, ptr, len, fold)? };
        Ok(self.lent(id, ptr, whole))
    }

    /// Receive into the slice `sent` lends (a `send_mut` or `send_head` of
    /// it), once that send is done, from `peer` (all of it, folded as
    /// `fold` says): the slice goes from the send to the receive without
    /// coming back in between, so the receive can be posted now, ahead of
    /// the message, and `give_back` returns it once the message is in.
    pub fn recv_after(&mut self, sent: Lent<'b>, peer: usize, key: Key, fold: Option<Fold>) -> Result<Lent<'b>> {
        let send = self.mine(&sent);
        let (gate, status) = (Gate::after(self.pending[send.0].status.clone()), Status::costed(self.cost.clone()));
        // SAFETY: the slice was moved into `sent`, out of everyone's reach: the
        // transport writes it only once the send that reads it is done
        // (`recv_after`), and it stays lent (the Lent made below) until a wait
        // for this receive returns Ok or this Transfers is dropped, which waits
        // for it or withdraws it (`Gate::withdraw` before it is posted).
        unsafe {
            self.transport.recv_after(&gate, peer, key, RecvBuf { ptr: sent.ptr, len: sent.len, fold }, status.clone())
        }
        .map_err(|e| e.context(format!("rustc10d: {} failed", self.what)))?;
        self.pending.push(Pending { peer, recv_key: Some(key), status, owned: None, gate: Some(gate) });
        Ok(self.lent(TransferId(self.pending.len() - 1), sent.ptr, sent.len))
    }

    /// The transfer `lent` was lent to, which must be one of this `Transfers`'.
    fn mine(&self, lent: &Lent<'b>) -> TransferId {
        let mine = self.pending.get(lent.id.0).is_some_and(|p| Arc::ptr_eq(&p.status, &lent.status));
        assert!(mine, "a slice is given back by the Transfers it was lent to");
        lent.id
    }

    fn lent(&self, id: TransferId, ptr: *mut u8, len: usize) -> Lent<'b> {
        Lent { id, status: self.pending[id.0].status.clone(), ptr, len, slice: PhantomData }
    }

    /// Wait for a lent slice's transfer, bounded by the op's deadline, and
    /// return the slice. On an error it stays lent until the scope ends.
    pub fn give_back(&self, lent: Lent<'b>) -> Result<&'b mut [u8]> {
        self.wait(self.mine(&lent))?;
        // SAFETY: the transfer is done (the wait returned Ok), so the
        // transport no longer touches the slice; the Lent held the only
        // borrow of it, for 'b, and is consumed here.
        Ok(unsafe { std::slice::from_raw_parts_mut(lent.ptr, lent.len) })
    }

    /// # Safety
    /// `data` must stay valid and unchanged until this `Transfers` is dropped.
    unsafe fn send_raw(&mut self, peer: usize, key: Key, data: &[u8]) -> Result<TransferId> {
        let status = Status::costed(self.cost.clone());
        // SAFETY: the caller keeps `data` valid and unchanged until this
        // Transfers is dropped, and dropping it waits until `status` finishes.
        unsafe { self.transport.send(peer, key, data.as_ptr(), data.len(), status.clone(), self.deadline, None) }
            .map_err(|e| e.context(format!("rustc10d: {} failed", self.what)))?;
        self.pending.push(Pending { peer, recv_key: None, status, owned: None, gate: None });
        Ok(TransferId(self.pending.len() - 1))
    }

    /// Send a copy of `data` that this `Transfers` keeps until the send is
    /// done: for a small message that a helper builds and may return before
    /// the op's transfers end (a send may still read its memory then).
    pub fn send_copy(&mut self, peer: usize, key: Key, data: &[u8]) -> Result<TransferId> {
        let owned = data.to_vec();
        // SAFETY: `owned` is kept in this Transfers (`pending`, below) until it is
        // dropped, after every transfer is done; moving the Vec does not move
        // its heap memory, and nothing writes it.
        let id = unsafe { self.send_raw(peer, key, &owned)? };
        self.pending[id.0].owned = Some(owned);
        Ok(id)
    }

    /// Receive `len` bytes into memory this `Transfers` owns; `received`
    /// reads them once the receive is waited for.
    pub fn recv_owned(&mut self, peer: usize, key: Key, len: usize) -> Result<TransferId> {
        let mut owned = vec![0u8; len];
        // SAFETY: `owned` is `len` bytes kept in this Transfers until it is dropped
        // (after every transfer is done), and read (`received`) only once this
        // receive has finished.
        let id = unsafe { self.recv_raw(peer, key, owned.as_mut_ptr(), len)? };
        self.pending[id.0].owned = Some(owned);
        Ok(id)
    }

    /// What a `recv_owned` received. Panics unless it finished well.
    pub fn received(&self, id: TransferId) -> &[u8] {
        let p = &self.pending[id.0];
        assert!(matches!(p.status.result(), Some(Ok(_))), "read before the receive finished");
        p.owned.as_deref().expect("a recv_owned")
    }

    /// # Safety
    /// `data` must stay valid, and not be read, until a wait for the transfer
    /// has returned Ok (one that timed out leaves it pending) or this
    /// `Transfers` is dropped.
    unsafe fn recv_raw(&mut self, peer: usize, key: Key, data: *mut u8, len: usize) -> Result<TransferId> {
        // SAFETY: the same contract, passed on (without a fold nothing else
        // needs to stay away from the buffer: it is only written).
        unsafe { self.recv_folded_raw(peer, key, data, len, None) }
    }

    /// Like `recv_raw`, folding the message into what `data` holds (see `Fold`).
    ///
    /// # Safety
    /// As for `recv_raw`; nobody else may touch `data` until then either.
    unsafe fn recv_folded_raw(
        &mut self,
        peer: usize,
        key: Key,
        data: *mut u8,
        len: usize,
        fold: Option<Fold>,
    ) -> Result<TransferId> {
        let status = Status::costed(self.cost.clone());
        // SAFETY: the caller keeps `data` valid and untouched until a wait for
        // it returns Ok, which is once `status` has finished, or until this
        // Transfers is dropped, which waits until `status` finishes.
        unsafe { self.transport.recv(peer, key, data, len, fold, status.clone()) }
            .map_err(|e| e.context(format!("rustc10d: {} failed", self.what)))?;
        self.pending.push(Pending { peer, recv_key: Some(key), status, owned: None, gate: None });
        Ok(TransferId(self.pending.len() - 1))
    }

    /// Wait for one transfer, bounded by the op's deadline.
    pub fn wait(&self, id: TransferId) -> Result<()> {
        let p = &self.pending[id.0];
        let noted = (!p.status.is_done()).then(|| {
            let on = if p.recv_key.is_some() { WaitOn::Data } else { WaitOn::Send };
            let wait = Wait { what: self.what.clone(), peer: p.peer, on, since: Instant::now() };
            self.transport.begin_wait(wait)
        });
        let waited = p.status.wait_polling(Some(self.deadline), self.spin, self.transport.polling(Some(p.peer)));
        let end = |said: Option<String>| noted.map(|id| self.transport.end_wait(id, said));
        match waited {
            Some(Ok(_)) => {
                end(None);
                Ok(())
            }
            Some(Err(e)) => {
                let e = self.failed_with(p.peer, e);
                // A peer that times out waiting for this rank learns why it stopped.
                end(Some(e.message.clone()));
                Err(e)
            }
            None => {
                // The peer may be waiting, in turn, for the rank really at fault.
                let said = format!(
                    "{} was waiting for {} {}",
                    self.what,
                    if p.recv_key.is_some() { "data from" } else { "a send to" },
                    self.transport.describe_peer(p.peer)
                );
                let said = waits::in_turn(said, self.transport.ask(p.peer));
                end(Some(format!("{said} (and timed out)")));
                Err(Error::timed_out(self.timeout, format_args!("{said}")))
            }
        }
    }

    /// Wait for one transfer until `until` at the latest (and the op's
    /// deadline): None if it has not finished by then. Unlike `wait`, a wait
    /// that ends so is not an error and tells no peer anything: it is for a
    /// rank that has already failed and only looks for a better reason.
    pub fn finished_by(&self, id: TransferId, until: Instant) -> Option<Result<()>> {
        let p = &self.pending[id.0];
        let waited =
            p.status.wait_polling(Some(until.min(self.deadline)), self.spin, self.transport.polling(Some(p.peer)));
        waited.map(|r| r.map(|_| ()).map_err(|e| self.failed_with(p.peer, e)))
    }

    fn failed_with(&self, peer: usize, e: Error) -> Error {
        let peer = self.transport.describe_peer(peer);
        Error::new(e.kind, format!("rustc10d: {} failed with {peer}: {}", self.what, e.message))
    }

    /// Wait for every transfer (the sends that nobody waited for, too).
    pub fn wait_all(&self) -> Result<()> {
        (0..self.pending.len()).try_for_each(|i| self.wait(TransferId(i)))
    }
}

impl Drop for Transfers<'_, '_> {
    fn drop(&mut self) {
        let reason = Error::aborted(format!("rustc10d: {} was abandoned", self.what));
        for p in &self.pending {
            // A receive still waiting for its send is never posted now.
            if p.gate.as_ref().is_some_and(|g| g.withdraw()) {
                p.status.finish(Err(reason.clone()));
                continue;
            }
            withdraw(self.transport, Some(p.peer), p.recv_key, &p.status, &reason);
            p.status.wait(None, Duration::ZERO);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::fake::FakeNet;

    const TIMEOUT: Duration = Duration::from_secs(5);

    fn scope<'t, 'b, R>(t: &'t dyn Transport, f: impl FnOnce(&mut Transfers<'t, 'b>) -> R) -> R {
        Transfers::scope(t, TIMEOUT, "test #0".into(), Duration::ZERO, Default::default(), f)
    }

    #[test]
    fn a_lent_slice_comes_back_holding_what_was_received() {
        let net = FakeNet::new(2);
        let key = Key::collective(0, 0);
        let mut inbox = [0u8; 8];
        scope(&*net[1], |tr| {
            let lent = tr.recv(0, key, &mut inbox).unwrap();
            let message = [7u8; 8];
            scope(&*net[0], |tr| tr.send(1, key, &message).and_then(|_| tr.wait_all())).unwrap();
            let back = tr.give_back(lent).unwrap();
            back[0] = 1;
        });
        assert_eq!(inbox, [1, 7, 7, 7, 7, 7, 7, 7]);
    }

    #[test]
    fn a_sent_slice_comes_back_once_the_send_is_done() {
        let net = FakeNet::new(2);
        let key = Key::collective(0, 0);
        let (mut outbox, mut inbox) = ([3u8; 4], [0u8; 4]);
        net[0].hold(1);
        scope(&*net[0], |tr| {
            let lent = tr.send_mut(1, key, &mut outbox).unwrap();
            assert!(tr.finished_by(lent.id(), Instant::now() + Duration::from_millis(50)).is_none(), "held");
            net[0].release(1);
            tr.give_back(lent).unwrap().fill(9);
        });
        scope(&*net[1], |tr| tr.recv(0, key, &mut inbox).and_then(|l| tr.give_back(l).map(drop))).unwrap();
        assert_eq!((outbox, inbox), ([9; 4], [3; 4]));
    }

    /// A slice cut once carries a shorter message at its head, and comes
    /// back whole: what lies past the message is neither sent nor written.
    #[test]
    fn a_message_at_the_head_of_a_slice_lends_and_returns_all_of_it() {
        let net = FakeNet::new(2);
        let key = Key::collective(0, 0);
        let (mut outbox, mut inbox) = ([3u8, 4, 5, 6], [0u8; 4]);
        scope(&*net[1], |tr| {
            let lent = tr.recv_head(0, key, &mut inbox, 2, None).unwrap();
            scope(&*net[0], |tr| {
                let sent = tr.send_head(1, key, &mut outbox, 2)?;
                assert_eq!(tr.give_back(sent)?.len(), 4);
                Ok::<(), Error>(())
            })
            .unwrap();
            assert_eq!(tr.give_back(lent).unwrap(), [3, 4, 0, 0]);
        });
    }

    /// A receive into a slice still being sent waits for the send: a message
    /// that comes first is kept, and written only once the send has read
    /// the slice (a held send reads it when released).
    #[test]
    fn a_receive_after_a_send_writes_only_once_the_send_has_read() {
        let net = FakeNet::new(2);
        let (out, back) = (Key::collective(0, 0), Key::collective(0, 1));
        let (mut buf, mut got) = ([3u8; 4], [0u8; 4]);
        net[0].hold(1);
        scope(&*net[0], |tr| {
            let sent = tr.send_mut(1, out, &mut buf).unwrap();
            let lent = tr.recv_after(sent, 1, back, None).unwrap();
            // Rank 1's answer comes before the send has gone.
            scope(&*net[1], |tr| tr.send(0, back, &[9u8; 4]).and_then(|_| tr.wait_all())).unwrap();
            assert!(tr.finished_by(lent.id(), Instant::now() + Duration::from_millis(50)).is_none());
            net[0].release(1);
            assert_eq!(tr.give_back(lent).unwrap(), [9; 4]);
        });
        scope(&*net[1], |tr| tr.recv(0, out, &mut got).and_then(|l| tr.give_back(l).map(drop))).unwrap();
        assert_eq!(got, [3; 4], "the send read the slice before the receive wrote it");
    }

    /// A send that fails fails the receive that waited for it, which never
    /// touches the slice; one that a scope left early is never posted.
    #[test]
    fn a_receive_after_a_failed_or_abandoned_send_leaves_the_slice_alone() {
        let net = FakeNet::new(3);
        let mut buf = [3u8; 4];
        net[0].hold(1);
        let r = scope(&*net[0], |tr| {
            let sent = tr.send_mut(1, Key::collective(0, 0), &mut buf)?;
            let lent = tr.recv_after(sent, 2, Key::collective(0, 1), None)?;
            net[0].break_peer(1, &Error::io("cut"));
            tr.give_back(lent).map(drop)
        });
        assert!(r.unwrap_err().message.contains("the send it waited for failed"), "names why");
        let net = FakeNet::new(3);
        net[0].hold(1);
        let r: Result<()> = scope(&*net[0], |tr| {
            let sent = tr.send_mut(1, Key::collective(1, 0), &mut buf)?;
            let _never_given_back = tr.recv_after(sent, 2, Key::collective(1, 1), None)?;
            Err(Error::aborted("the op failed elsewhere"))
        });
        assert!(r.is_err());
        // Its message comes now: kept for a later receive, not written here.
        scope(&*net[2], |tr| tr.send(0, Key::collective(1, 1), &[5u8; 4]).and_then(|_| tr.wait_all())).unwrap();
        assert_eq!(buf, [3; 4]);
    }

    /// Another scope of the same lifetime, whose own transfer of the same
    /// number is done, cannot hand back a slice still being filled.
    #[test]
    #[should_panic(expected = "given back by the Transfers it was lent to")]
    fn a_slice_comes_back_only_through_its_own_transfers() {
        let net = FakeNet::new(2);
        let (key, other) = (Key::collective(0, 0), Key::collective(1, 0));
        let (mut inbox, mut done) = ([0u8; 8], [0u8; 8]);
        scope(&*net[1], |outer| {
            let lent = outer.recv(0, key, &mut inbox).unwrap();
            scope(&*net[1], |inner| {
                let finished = inner.recv(0, other, &mut done).unwrap();
                scope(&*net[0], |tr| tr.send(1, other, &[1u8; 8]).and_then(|_| tr.wait_all())).unwrap();
                inner.give_back(finished).unwrap();
                let _ = inner.give_back(lent);
            });
        });
    }

    #[test]
    fn a_scope_left_early_withdraws_what_it_lent_before_it_returns() {
        let net = FakeNet::new(2);
        let key = Key::collective(0, 0);
        let mut inbox = [0u8; 8];
        let r: Result<()> = scope(&*net[1], |tr| {
            let _never_given_back = tr.recv(0, key, &mut inbox)?;
            Err(Error::aborted("the op failed elsewhere"))
        });
        assert!(r.is_err());
        // Withdrawn: a message that comes now is kept for a later receive,
        // not written into memory the scope no longer has.
        scope(&*net[0], |tr| {
            tr.send(1, key, &[5u8; 8]).and_then(|_| {
                tr.finished_by(TransferId(0), Instant::now() + Duration::from_millis(50)).unwrap_or(Ok(()))
            })
        })
        .unwrap();
        assert_eq!(inbox, [0; 8]);
    }
}
