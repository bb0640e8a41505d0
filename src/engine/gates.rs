//! Stream-ordered completion on a device whose streams can wait for a word
//! of host memory (CUDA's `cuStreamWaitValue32`, or the host stream test
//! staging runs): at issue, an op queues on its group's held stream a wait
//! for its ticket, then its copies back; the engine writes the word when
//! the op has ended, and the device goes on. So `Work.wait()` only orders
//! the caller's stream after those copies and returns; the host never blocks.
//!
//! One word per group and device, and tickets in issue order: the word is
//! only ever raised to a ticket whose op and every op before it have ended,
//! so a wait for ticket t goes on exactly when ops 1..=t have released
//! theirs, as one NCCL stream orders every op of a communicator. Ops end in
//! any order (point-to-point ops by tag and source, ops issued from several
//! threads).
//!
//! A failed op first makes its host copies equal to the device's bytes
//! (its `Restore`), so that what its held copies write back leaves every
//! tensor as it was. That restore waits for the caller's work queued before
//! the op, which may itself wait for the held copies of earlier tickets: so
//! restores run on the gates' own thread, in ticket order, each once every
//! earlier ticket is released. Never on the thread that ended the op (a
//! transport thread, which an earlier op may need to end at all).
//!
//! Nobody waits on the host for a stream-ordered op, so nobody enforces a
//! point-to-point op's timeout by waiting: the gates' thread fires the
//! `Expire` of a ticket past its deadline (collectives enforce their own on
//! the engine). Every path ends every ticket: success, failure, timeout, an
//! op dropped unrun, the group's shutdown (`close`); no stream waits forever.

use crate::error::{Error, Result};
use crate::locks::{level, Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The device side of a gate: a word that a held stream waits for.
pub trait GateWord: Send + Sync {
    /// Queue on the held stream: wait until the word reaches `value`.
    fn hold_until(&self, value: u32) -> Result<()>;
    /// Write the word.
    fn release_to(&self, value: u32);
}

impl GateWord for crate::cuda::DeviceGate {
    fn hold_until(&self, value: u32) -> Result<()> {
        crate::cuda::DeviceGate::hold_until(self, value)
    }
    fn release_to(&self, value: u32) {
        crate::cuda::DeviceGate::release_to(self, value)
    }
}

/// A failed op's restore (see the module doc); its error is logged, the op
/// has failed already.
pub type Restore = Box<dyn FnOnce() -> Result<()> + Send>;

/// Ends an op past its deadline: with None, as its own timeout; with an
/// error, for that reason (the group shut down).
pub type Expire = Box<dyn FnOnce(Option<Error>) + Send>;

/// One issued ticket.
struct Slot {
    state: SlotState,
    /// When and how to end its op, if nobody else will.
    expire: Option<(Instant, Expire)>,
}

enum SlotState {
    Open,
    /// Failed: its restore, taken (None) while it runs.
    Restoring(Option<Restore>),
    Ended,
}

/// Which tickets have been released, and what is left to do for the rest:
/// pure state, no device, no thread, no clock of its own.
#[derive(Default)]
pub struct Tickets {
    /// The word's value: every ticket up to it is released.
    released: u32,
    /// Tickets issued after `released`, in order.
    pending: VecDeque<Slot>,
}

impl Tickets {
    /// The ticket the next op takes (not taken until `issue`).
    pub fn next(&self) -> u32 {
        self.released.wrapping_add(self.pending.len() as u32).wrapping_add(1)
    }

    pub fn issue(&mut self) -> u32 {
        let t = self.next();
        self.pending.push_back(Slot { state: SlotState::Open, expire: None });
        t
    }

    fn slot(&mut self, t: u32) -> Option<&mut Slot> {
        let i = t.wrapping_sub(self.released).wrapping_sub(1) as usize;
        self.pending.get_mut(i)
    }

    /// Ticket `t`'s op has ended; `restore`: it failed, and this runs before
    /// its ticket is released. A ticket released already (given up on at
    /// shutdown, `release_all`) stays as it is.
    pub fn end(&mut self, t: u32, restore: Option<Restore>) {
        let Some(slot) = self.slot(t) else { return };
        assert!(matches!(slot.state, SlotState::Open), "ticket {t} ended twice");
        slot.state = match restore {
            Some(r) => SlotState::Restoring(Some(r)),
            None => SlotState::Ended,
        };
        slot.expire = None;
    }

    /// Release every ended ticket at the front: the word's new value, if it moves.
    pub fn advance(&mut self) -> Option<u32> {
        let before = self.released;
        while self.pending.front().is_some_and(|s| matches!(s.state, SlotState::Ended)) {
            self.pending.pop_front();
            self.released = self.released.wrapping_add(1);
        }
        (self.released != before).then_some(self.released)
    }

    /// The restore of the first unreleased ticket, once every ticket before
    /// it is released; it is then running until `restored`.
    pub fn take_restore(&mut self) -> Option<Restore> {
        match &mut self.pending.front_mut()?.state {
            SlotState::Restoring(r) => r.take(),
            _ => None,
        }
    }

    /// Whether the first unreleased ticket's restore waits to be taken.
    pub fn restore_due(&self) -> bool {
        self.pending.front().is_some_and(|s| matches!(s.state, SlotState::Restoring(Some(_))))
    }

    /// The restore `take_restore` gave has run.
    pub fn restored(&mut self) {
        let front = self.pending.front_mut().expect("a restore was running");
        assert!(matches!(front.state, SlotState::Restoring(None)), "no restore was running");
        front.state = SlotState::Ended;
    }

    /// End ticket `t`'s op with `expire` once `deadline` passes, unless it
    /// has ended (or been released) by then.
    pub fn expire_at(&mut self, t: u32, deadline: Instant, expire: Expire) {
        if let Some(slot) = self.slot(t).filter(|s| matches!(s.state, SlotState::Open)) {
            slot.expire = Some((deadline, expire));
        }
    }

    /// The expiries due at `now` (with `all`, every one set), taken.
    pub fn take_expired(&mut self, now: Instant, all: bool) -> Vec<Expire> {
        let due = |s: &Slot| s.expire.as_ref().is_some_and(|(at, _)| all || *at <= now);
        self.pending.iter_mut().filter(|s| due(s)).filter_map(|s| s.expire.take().map(|(_, f)| f)).collect()
    }

    /// The next deadline of an op still open.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.iter().filter_map(|s| s.expire.as_ref().map(|(at, _)| *at)).min()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Give up on what is left: every issued ticket is released as it is.
    pub fn release_all(&mut self) -> u32 {
        self.released = self.released.wrapping_add(self.pending.len() as u32);
        self.pending.clear();
        self.released
    }
}

/// How long `close` waits for the ops still holding tickets to end once
/// it has expired them.
const CLOSE_GRACE: Duration = Duration::from_secs(10);

/// How long the gates' thread sleeps when no deadline is near.
const IDLE: Duration = Duration::from_secs(3600);

/// A group's gates on one device, and the thread that settles failed ops
/// and expires overdue ones.
pub struct StreamGates {
    shared: Arc<Shared>,
    thread: Mutex<level::GatesThread, Option<JoinHandle<()>>>,
}

struct Shared {
    word: Box<dyn GateWord>,
    /// `GateWord` calls run under it (the host stream's lock comes after it
    /// in locks.rs); nothing that can block on the device or on an op does.
    state: Mutex<level::GatesState, State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    tickets: Tickets,
    closing: bool,
}

impl StreamGates {
    pub fn new(word: Box<dyn GateWord>) -> Result<StreamGates> {
        let shared = Arc::new(Shared { word, state: Mutex::default(), changed: Condvar::new() });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("rustc10d-gates".into())
            .spawn(move || s.run())
            .map_err(|e| Error::resource(format!("rustc10d: could not start the gates' thread: {e}")))?;
        Ok(StreamGates { shared, thread: Mutex::new(Some(thread)) })
    }

    /// Queue a wait for a new ticket on the held stream; what is queued
    /// there next runs once the ticket is released.
    pub fn hold(&self) -> Result<u32> {
        let mut state = self.shared.state.lock().unwrap();
        if state.closing {
            return Err(Error::aborted("rustc10d: the process group was shut down"));
        }
        self.shared.word.hold_until(state.tickets.next())?;
        Ok(state.tickets.issue())
    }

    /// Ticket `t`'s op has succeeded: released as soon as every earlier one is.
    pub fn release(&self, t: u32) {
        self.end(t, None);
    }

    /// Ticket `t`'s op has failed: `restore` runs on the gates' thread once
    /// every earlier ticket is released, then `t` is.
    pub fn fail(&self, t: u32, restore: Restore) {
        self.end(t, Some(restore));
    }

    fn end(&self, t: u32, restore: Option<Restore>) {
        let mut state = self.shared.state.lock().unwrap();
        state.tickets.end(t, restore);
        self.shared.advance(&mut state);
    }

    /// Expire ticket `t`'s op at `deadline` if it has not ended by then.
    pub fn expire_at(&self, t: u32, deadline: Instant, expire: Expire) {
        let mut state = self.shared.state.lock().unwrap();
        state.tickets.expire_at(t, deadline, expire);
        self.shared.changed.notify_all();
    }

    /// The group shuts down: ops still holding tickets are expired now
    /// (those that can be), then waited for a while; what is left is
    /// released as it is, so that no stream waits forever. New ops are refused.
    pub fn close(&self) {
        let expired = {
            let mut state = self.shared.state.lock().unwrap();
            state.closing = true;
            state.tickets.take_expired(Instant::now(), true)
        };
        let why = Error::aborted("rustc10d: the process group was shut down");
        for f in expired {
            contained("expiring an op at shutdown", || f(Some(why.clone())));
        }
        let state = self.shared.state.lock().unwrap();
        let (mut state, waited) =
            self.shared.changed.wait_timeout_while(state, CLOSE_GRACE, |s| !s.tickets.is_empty()).unwrap();
        if waited.timed_out() {
            tracing::warn!("rustc10d: ops still held stream-ordered copies at shutdown; let through as they are");
            let word = state.tickets.release_all();
            self.shared.word.release_to(word);
        }
        self.shared.changed.notify_all();
        drop(state);
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

impl Drop for StreamGates {
    fn drop(&mut self) {
        self.close();
    }
}

fn contained(what: &str, f: impl FnOnce()) {
    if let Err(e) = crate::panics::contain(what, f) {
        tracing::error!("{}", e.message);
    }
}

impl Shared {
    /// Release what has ended at the front (under the lock, so the word only
    /// rises), and wake the thread where a restore is now due: a failed op's
    /// restore becomes due when the last op before it ends, which may be a
    /// success (its thread would otherwise sleep on, and the held stream
    /// with it, until the group's shutdown).
    fn advance(&self, state: &mut State) {
        if let Some(v) = state.tickets.advance() {
            self.word.release_to(v);
        }
        if state.tickets.is_empty() || state.tickets.restore_due() {
            self.changed.notify_all();
        }
    }

    fn run(&self) {
        let mut state = self.state.lock().unwrap();
        loop {
            if let Some(restore) = state.tickets.take_restore() {
                drop(state);
                let restored = crate::panics::contain("restoring a failed op's tensors", restore).and_then(|r| r);
                if let Err(e) = restored {
                    tracing::error!("rustc10d: a failed op could not restore its tensors: {}", e.message);
                }
                state = self.state.lock().unwrap();
                state.tickets.restored();
                self.advance(&mut state);
                continue;
            }
            let now = Instant::now();
            let expired = state.tickets.take_expired(now, false);
            if !expired.is_empty() {
                drop(state);
                for f in expired {
                    contained("expiring an overdue op", || f(None));
                }
                state = self.state.lock().unwrap();
                continue;
            }
            if state.closing && state.tickets.is_empty() {
                return;
            }
            let sleep = state.tickets.next_deadline().map_or(IDLE, |d| d.saturating_duration_since(now));
            state = self.changed.wait_timeout(state, sleep.max(Duration::from_millis(1))).unwrap().0;
        }
    }
}

/// What the device offers for copies back held behind a gate.
pub trait HeldCopies: super::Device {
    /// Queue the copy of bytes [start, start + len) of buffer `index` back
    /// to the device on the held stream (behind the gate queued there).
    fn to_device_held(&mut self, index: usize, start: usize, len: usize) -> Result<()>;
    /// Make bytes [start, start + len) of buffer `index`'s host copy what
    /// the device holds there, after the caller's work queued before the
    /// op, and block until it does (on the gates' thread).
    fn restore(&mut self, index: usize, start: usize, len: usize) -> Result<()>;
    /// Where the op's consumer is the host (test staging): what runs its
    /// completion once its copies back have run. None: at once (a device
    /// stream is ordered after them by the shim's events).
    fn after_copies(&self) -> Option<super::AfterCopies> {
        None
    }
}

/// One op's copies on a device with gates.
pub struct GatedOp<D> {
    /// Moved into the restore of a failed op.
    device: Option<D>,
    gates: Arc<StreamGates>,
    /// Taken with the op's first held copy; ended once.
    ticket: Option<u32>,
}

impl<D: HeldCopies + 'static> GatedOp<D> {
    pub fn new(device: D, gates: Arc<StreamGates>) -> GatedOp<D> {
        GatedOp { device: Some(device), gates, ticket: None }
    }

    fn device(&mut self) -> &mut D {
        self.device.as_mut().expect("an op's device is used until it fails")
    }
}

impl<D: HeldCopies + 'static> super::Device for GatedOp<D> {
    fn to_host(&mut self, index: usize, start: usize, len: usize) -> Result<super::Event> {
        self.device().to_host(index, start, len)
    }
    fn wait(&mut self, event: super::Event) -> Result<()> {
        self.device().wait(event)
    }
    fn to_device(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        self.device().to_device(index, start, len)
    }
    fn gates(&mut self) -> Option<&mut dyn super::Gates> {
        Some(self)
    }
}

impl<D: HeldCopies + 'static> super::Gates for GatedOp<D> {
    fn to_device_held(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        if self.ticket.is_none() {
            self.ticket = Some(self.gates.hold()?);
        }
        self.device().to_device_held(index, start, len)
    }

    fn open(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.gates.release(t);
        }
    }

    fn open_unchanged(&mut self, outs: Vec<(usize, usize)>) {
        let (Some(t), Some(mut device)) = (self.ticket.take(), self.device.take()) else { return };
        self.gates.fail(t, Box::new(move || outs.into_iter().try_for_each(|(i, n)| device.restore(i, 0, n))));
    }

    fn ticket(&self) -> Option<(Arc<StreamGates>, u32)> {
        self.ticket.map(|t| (self.gates.clone(), t))
    }

    fn after_copies(&self) -> Option<super::AfterCopies> {
        self.device.as_ref().and_then(|d| d.after_copies())
    }
}

impl<D> Drop for GatedOp<D> {
    /// An op dropped before it settled still lets its copies through.
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.gates.release(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_rises_only_over_ended_tickets() {
        let mut o = Tickets::default();
        let (a, b, c) = (o.issue(), o.issue(), o.issue());
        assert_eq!((a, b, c), (1, 2, 3));
        o.end(b, None);
        assert_eq!(o.advance(), None, "1 has not ended");
        o.end(a, None);
        assert_eq!(o.advance(), Some(2), "1 and 2 go together");
        assert_eq!(o.next(), 4);
        o.end(c, None);
        assert_eq!(o.advance(), Some(3));
    }

    #[test]
    fn tickets_wrap_around() {
        let mut o = Tickets { released: u32::MAX - 1, pending: VecDeque::new() };
        let (a, b, c) = (o.issue(), o.issue(), o.issue());
        assert_eq!((a, b, c), (u32::MAX, 0, 1));
        o.end(c, None);
        o.end(b, None);
        assert_eq!(o.advance(), None);
        o.end(a, None);
        assert_eq!(o.advance(), Some(1));
    }

    #[test]
    #[should_panic(expected = "ended twice")]
    fn a_ticket_ends_once() {
        let mut o = Tickets::default();
        let (_a, b) = (o.issue(), o.issue());
        o.end(b, None);
        o.end(b, None);
    }

    /// A failed op's restore is offered only once every ticket before it is
    /// released, and holds back the tickets after it until it has run.
    #[test]
    fn restores_run_in_ticket_order() {
        let mut o = Tickets::default();
        let (a, b, c) = (o.issue(), o.issue(), o.issue());
        o.end(b, Some(Box::new(|| Ok(()))));
        o.end(c, None);
        assert!(o.take_restore().is_none(), "1 is still open");
        assert!(!o.restore_due());
        assert_eq!(o.advance(), None);
        o.end(a, None);
        assert_eq!(o.advance(), Some(1));
        assert!(o.restore_due(), "a success before it makes 2's restore due (the thread is woken for it)");
        let restore = o.take_restore().expect("2's restore, now first");
        assert!(o.take_restore().is_none(), "taken once");
        assert!(!o.restore_due(), "running");
        assert_eq!(o.advance(), None, "2 restores before it is released");
        restore().unwrap();
        o.restored();
        assert_eq!(o.advance(), Some(3));
        assert!(o.is_empty());
    }

    /// Expiries are due at their deadline, only for ops still open, once.
    #[test]
    fn expiries_fire_once_for_open_ops() {
        let t0 = Instant::now();
        let mut o = Tickets::default();
        let (a, b, c) = (o.issue(), o.issue(), o.issue());
        let fired = Arc::new(Mutex::<level::TestRecord, _>::new(Vec::new()));
        for (t, after) in [(a, 10), (b, 20), (c, 30)] {
            let fired = fired.clone();
            o.expire_at(t, t0 + Duration::from_millis(after), Box::new(move |_| fired.lock().unwrap().push(t)));
        }
        o.end(b, None);
        assert_eq!(o.next_deadline(), Some(t0 + Duration::from_millis(10)), "2 ended: its expiry is gone");
        o.take_expired(t0 + Duration::from_millis(25), false).into_iter().for_each(|f| f(None));
        assert_eq!(*fired.lock().unwrap(), vec![a]);
        assert!(o.take_expired(t0 + Duration::from_millis(25), false).is_empty(), "fired once");
        o.take_expired(t0, true).into_iter().for_each(|f| f(None));
        assert_eq!(*fired.lock().unwrap(), vec![a, c], "at shutdown, every one left");
        o.expire_at(99, t0, Box::new(|_| panic!("not an issued ticket")));
        assert!(o.take_expired(t0, true).is_empty());
    }
}
