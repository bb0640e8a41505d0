//! A one-shot completion cell: the truth behind every Work and every posted
//! transfer. Finishing runs the owner's callback first (the shim completes the
//! torch future there), then publishes the result, so `wait()` never returns
//! before the future is complete. A callback that fails (the shim could not
//! hand the result over) fails the op: Work and future tell the same story.

use crate::error::Result;
use crate::locks::{level, Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs once, on the thread that finishes the operation.
pub type Callback = Box<dyn FnOnce(&Result<i64>) + Send>;

/// The owner's callback: runs once, on the thread that finishes the
/// operation, before the result is published; an error it returns becomes
/// the result of an op that had succeeded.
pub type Finisher = Box<dyn FnOnce(&Result<i64>) -> Result<()> + Send>;

/// What a waiting thread does while it polls (`Transport::polling`): make
/// progress without blocking. Dropped when it stops polling.
pub trait Polling {
    fn poll(&self);
}

/// What an op cost this rank, in counts that do not depend on the machine
/// (`rustc10d.stats()`): bytes its CPU moved through copies and folds
/// (reads and writes of shared-memory rings, socket reads and writes,
/// folds, copies between buffers, reads of a peer's memory), and how often a
/// thread waiting for it went to sleep. Also how many bytes arrived before
/// their receive was posted and waited in memory for it: each costs one
/// copy more than if it had gone straight into place (a folded receive
/// folds from there instead, at no extra cost).
#[derive(Debug, Default)]
pub struct Cost {
    copied: AtomicU64,
    wakeups: AtomicU64,
    early: AtomicU64,
}

/// What a `Cost` has counted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CostTotals {
    pub copied: u64,
    pub wakeups: u64,
    pub early: u64,
}

impl Cost {
    pub fn copied(&self, bytes: usize) {
        self.copied.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// A waiting thread slept (and was woken, or timed out).
    pub fn slept(&self) {
        self.wakeups.fetch_add(1, Ordering::Relaxed);
    }

    fn early(&self, bytes: usize) {
        self.early.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn totals(&self) -> CostTotals {
        CostTotals {
            copied: self.copied.load(Ordering::Relaxed),
            wakeups: self.wakeups.load(Ordering::Relaxed),
            early: self.early.load(Ordering::Relaxed),
        }
    }
}

#[derive(Default)]
pub struct Status {
    /// The op this transfer belongs to, charged for the transfer's copies
    /// and for the sleeps of threads that wait for it.
    cost: Option<Arc<Cost>>,
    /// The op, named in every error ("recv #3 from rank 1 (...) ..."):
    /// prefixed to one that does not name it already.
    context: Option<String>,
    state: Mutex<level::StatusState, State>,
    cv: Condvar,
    /// Set once `state.result` is, so waiters can poll without the lock.
    done: AtomicBool,
}

#[derive(Default)]
struct State {
    claimed: bool,
    result: Option<Result<i64>>,
    callback: Option<Finisher>,
    /// Run after the result is published (`then`).
    observers: Vec<Callback>,
    /// Threads asleep on `cv`: only then does `finish` pay for a wake-up
    /// (a system call even when nobody waits).
    sleepers: u32,
}

impl Status {
    pub fn new() -> Arc<Status> {
        Arc::new(Status::default())
    }

    pub fn with_callback(callback: Finisher) -> Arc<Status> {
        let s = Status::default();
        s.state.lock().unwrap().callback = Some(callback);
        Arc::new(s)
    }

    /// A transfer of an op that is charged `cost`.
    pub fn costed(cost: Arc<Cost>) -> Arc<Status> {
        Arc::new(Status { cost: Some(cost), ..Status::default() })
    }

    /// A cell whose errors name the op (`context`), whoever finishes it,
    /// charged `cost`.
    pub fn named(context: String, cost: Arc<Cost>, callback: Finisher) -> Arc<Status> {
        let s = Status { context: Some(context), cost: Some(cost), ..Status::default() };
        s.state.lock().unwrap().callback = Some(callback);
        Arc::new(s)
    }

    /// Complete with `result`. The first call wins; later calls return false.
    /// One with a callback or observers to run, made while this thread holds
    /// a lock of the transport's, is published once the thread lets go of it
    /// (`locks::when_unlocked`): they run torch's callbacks, the user's code.
    pub fn finish(self: &Arc<Self>, result: Result<i64>) -> bool {
        let result = match (result, &self.context) {
            (Err(e), Some(op)) if !e.message.contains(op.as_str()) => Err(e.context(format_args!("rustc10d: {op}"))),
            (r, _) => r,
        };
        let (callback, observed) = {
            let mut st = self.state.lock().unwrap();
            if st.claimed {
                return false;
            }
            st.claimed = true;
            (st.callback.take(), !st.observers.is_empty())
        };
        if (callback.is_some() || observed) && crate::locks::holding_io() {
            let me = self.clone();
            crate::locks::when_unlocked(Box::new(move || me.publish(callback, result)));
        } else {
            self.publish(callback, result);
        }
        true
    }

    /// The claimed cell's callback, then its result for waiters and observers.
    fn publish(&self, callback: Option<Finisher>, result: Result<i64>) {
        // A callback that panics must not leave the cell claimed but never
        // published (every waiter would wait forever): it fails the op.
        let handed_over = callback.map(|cb| crate::panics::contain("finishing the op", || cb(&result)).and_then(|r| r));
        let result = match (handed_over, result) {
            (Some(Err(e)), Ok(_)) => Err(e),
            (_, result) => result,
        };
        let (observers, sleepers) = {
            let mut st = self.state.lock().unwrap();
            st.result = Some(result.clone());
            (std::mem::take(&mut st.observers), st.sleepers)
        };
        self.done.store(true, Ordering::Release);
        // A waiter counts itself under the lock before it sleeps, after it
        // saw no result there: one not counted yet will see this one.
        if sleepers > 0 {
            self.cv.notify_all();
        }
        for f in observers {
            if let Err(e) = crate::panics::contain("an observer of a finished op", || f(&result)) {
                tracing::error!("{}", e.message);
            }
        }
    }

    /// Run `f` with the result once finished (at once if it is).
    pub fn then(&self, f: Callback) {
        let result = {
            let mut st = self.state.lock().unwrap();
            match &st.result {
                Some(r) => r.clone(),
                None => return st.observers.push(f),
            }
        };
        f(&result)
    }

    /// A cell that finishes once every one of `all` has, with the first
    /// failure among them if any; `callback` runs then.
    pub fn all(all: &[Arc<Status>], callback: Finisher) -> Arc<Status> {
        let combined = Status::with_callback(callback);
        if all.is_empty() {
            combined.finish(Ok(0));
            return combined;
        }
        let left = Arc::new(AtomicUsize::new(all.len()));
        let failure = Arc::new(Mutex::<level::FirstFailure, _>::new(None));
        for s in all {
            let (combined, left, failure) = (combined.clone(), left.clone(), failure.clone());
            s.then(Box::new(move |r| {
                if let Err(e) = r {
                    failure.lock().unwrap().get_or_insert_with(|| e.clone());
                }
                if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                    // Not under the lock: finishing runs the combined op's callbacks.
                    let failure = failure.lock().unwrap().take();
                    combined.finish(failure.map_or(Ok(0), Err));
                }
            }));
        }
        combined
    }

    /// The transfer moved `bytes` through a copy or a fold (see `Cost`).
    pub fn copied(&self, bytes: usize) {
        if let Some(c) = &self.cost {
            c.copied(bytes);
        }
    }

    /// The transfer's `bytes` arrived before its receive (see `Cost`).
    pub fn early(&self, bytes: usize) {
        if let Some(c) = &self.cost {
            c.early(bytes);
        }
    }

    pub fn is_done(&self) -> bool {
        self.state.lock().unwrap().result.is_some()
    }

    /// The result once finished, without blocking.
    pub fn result(&self) -> Option<Result<i64>> {
        self.state.lock().unwrap().result.clone()
    }

    /// Block until finished or `deadline` (None: no deadline); None on
    /// expiry. Polls for up to `spin` first: a futex sleep and wake-up cost
    /// tens of microseconds on a busy machine, as much as a small message's
    /// whole round trip. Yields while polling, so it never holds a core from
    /// the threads doing the work.
    pub fn wait(&self, deadline: Option<Instant>, spin: Duration) -> Option<Result<i64>> {
        self.wait_polling(deadline, spin, None)
    }

    /// `wait`, making progress with `polling` while it polls (to read the
    /// awaited message itself rather than wait for another thread to hand
    /// it over); `polling` ends (is dropped) before the wait sleeps.
    pub fn wait_polling(
        &self,
        deadline: Option<Instant>,
        spin: Duration,
        polling: Option<Box<dyn Polling + '_>>,
    ) -> Option<Result<i64>> {
        let spin_until = Instant::now() + spin;
        while !self.done.load(Ordering::Acquire) && Instant::now() < spin_until.min(deadline.unwrap_or(spin_until)) {
            if let Some(p) = &polling {
                p.poll();
                if self.done.load(Ordering::Acquire) {
                    break;
                }
            }
            std::thread::yield_now();
        }
        drop(polling);
        let mut st = self.state.lock().unwrap();
        loop {
            if let Some(r) = &st.result {
                return Some(r.clone());
            }
            if let Some(c) = &self.cost {
                c.slept();
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return None;
            }
            st.sleepers += 1;
            st = match deadline {
                None => self.cv.wait(st).unwrap(),
                Some(d) => self.cv.wait_timeout(st, d - now).unwrap().0,
            };
            st.sleepers -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::sync::atomic::AtomicBool;

    /// Finishing a receive under its mailbox's lock ran its callback there,
    /// and a callback that posted the next receive (the same lock) hung the
    /// thread for good; now it runs once the lock is let go.
    #[test]
    fn a_callback_finished_under_an_io_lock_runs_once_it_is_let_go() {
        let mailbox = Arc::new(Mutex::<level::Mailbox, u32>::new(0));
        let m = mailbox.clone();
        let status = Status::with_callback(Box::new(move |_| {
            *m.lock().unwrap() += 1;
            Ok(())
        }));
        let plain = Status::new();
        let held = mailbox.lock().unwrap();
        assert!(status.finish(Ok(3)), "claimed at once");
        assert!(!status.finish(Ok(4)), "the first finish wins, deferred or not");
        assert!(!status.is_done(), "its callback waits for the lock");
        assert!(plain.finish(Ok(5)) && plain.is_done(), "a cell with nothing to run is published at once");
        drop(held);
        assert_eq!(status.result().unwrap().unwrap(), 3);
        assert_eq!(*mailbox.lock().unwrap(), 1);
    }

    #[test]
    fn callback_runs_before_result_is_visible() {
        let seen = Arc::new(AtomicBool::new(false));
        let s2 = seen.clone();
        let status = Status::with_callback(Box::new(move |r| {
            assert!(r.is_ok());
            s2.store(true, Ordering::SeqCst);
            Ok(())
        }));
        let st = status.clone();
        let t = std::thread::spawn(move || st.wait(None, Duration::ZERO).unwrap().unwrap());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!status.is_done());
        assert!(status.finish(Ok(7)));
        assert_eq!(t.join().unwrap(), 7);
        assert!(seen.load(Ordering::SeqCst));
        assert!(!status.finish(Err(Error::io("late"))), "first finish wins");
        assert_eq!(status.result().unwrap().unwrap(), 7);
    }

    #[test]
    fn all_finishes_after_every_part_with_the_first_failure() {
        let parts = [Status::new(), Status::new(), Status::new()];
        let seen = Arc::new(Mutex::<level::TestRecord, _>::new(None));
        let s2 = seen.clone();
        let all = Status::all(
            &parts,
            Box::new(move |r| {
                *s2.lock().unwrap() = Some(r.is_ok());
                Ok(())
            }),
        );
        parts[1].finish(Err(Error::io("first")));
        parts[0].finish(Ok(1));
        assert!(!all.is_done());
        parts[2].finish(Err(Error::io("second")));
        assert_eq!(all.result().unwrap().unwrap_err().message, "first");
        assert_eq!(*seen.lock().unwrap(), Some(false));
        assert!(Status::all(&[], Box::new(|_| Ok(()))).result().unwrap().is_ok(), "nothing to wait for");
    }

    #[test]
    fn a_failing_callback_fails_an_op_that_had_succeeded_but_not_one_that_had_failed() {
        let handed_over = Status::with_callback(Box::new(|_| Err(Error::io("could not build the result"))));
        handed_over.finish(Ok(0));
        assert_eq!(handed_over.result().unwrap().unwrap_err().message, "could not build the result");
        let failed = Status::with_callback(Box::new(|_| Err(Error::io("later"))));
        failed.finish(Err(Error::peer_lost("first")));
        assert_eq!(failed.result().unwrap().unwrap_err().message, "first");
    }

    #[test]
    fn a_callback_that_panics_fails_the_op_and_still_publishes_it() {
        let status = Status::with_callback(Box::new(|_| panic!("the shim's hand-over broke")));
        status.finish(Ok(0));
        let e = status.wait(Some(Instant::now() + Duration::from_secs(5)), Duration::ZERO).unwrap().unwrap_err();
        assert!(e.message.contains("the shim's hand-over broke"), "{}", e.message);
    }

    #[test]
    fn named_errors_say_which_op_once() {
        let op = "recv #3 from rank 1";
        let lost = Status::named(op.into(), Arc::default(), Box::new(|_| Ok(())));
        lost.finish(Err(Error::peer_lost("rank 1 closed its connection")));
        let msg = lost.result().unwrap().unwrap_err().message;
        assert_eq!(msg, "rustc10d: recv #3 from rank 1: rank 1 closed its connection");
        let late = Status::named(op.into(), Arc::default(), Box::new(|_| Ok(())));
        late.finish(Err(Error::timeout("rustc10d: Timed out after 5 ms: recv #3 from rank 1 was waiting for data")));
        assert!(late.result().unwrap().unwrap_err().message.starts_with("rustc10d: Timed out"), "named once");
    }

    #[test]
    fn wait_honours_deadline() {
        let status = Status::new();
        let t0 = Instant::now();
        assert!(status.wait(Some(t0 + Duration::from_millis(50)), Duration::from_micros(50)).is_none());
        assert!(t0.elapsed() >= Duration::from_millis(50));
    }
}
