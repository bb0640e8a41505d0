//! A one-shot completion cell: the truth behind every Work and every posted
//! transfer. Finishing runs the owner's callback first (the shim completes the
//! torch future there), then publishes the result, so `wait()` never returns
//! before the future is complete.

use crate::error::Result;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Runs once, on the thread that finishes the operation.
pub type Callback = Box<dyn FnOnce(&Result<i64>) + Send>;

/// How long a waiter polls before it sleeps: a futex sleep and wake-up cost
/// tens of microseconds on a busy machine, as much as a small message's whole
/// round trip. Yields while polling, so it never holds a core from the threads
/// doing the work.
pub const ENV_SPIN_US: &str = "RUSTC10D_SPIN_US";
const DEFAULT_SPIN_US: u64 = 50;

pub(crate) fn spin_budget() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var(ENV_SPIN_US).ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_SPIN_US);
        Duration::from_micros(us)
    })
}

#[derive(Default)]
pub struct Status {
    state: Mutex<State>,
    cv: Condvar,
    /// Set once `state.result` is, so waiters can poll without the lock.
    done: AtomicBool,
}

#[derive(Default)]
struct State {
    claimed: bool,
    result: Option<Result<i64>>,
    callback: Option<Callback>,
}

impl Status {
    pub fn new() -> Arc<Status> {
        Arc::new(Status::default())
    }

    pub fn with_callback(callback: Callback) -> Arc<Status> {
        let s = Status::default();
        s.state.lock().unwrap().callback = Some(callback);
        Arc::new(s)
    }

    /// Complete with `result`. The first call wins; later calls return false.
    pub fn finish(&self, result: Result<i64>) -> bool {
        let callback = {
            let mut st = self.state.lock().unwrap();
            if st.claimed {
                return false;
            }
            st.claimed = true;
            st.callback.take()
        };
        if let Some(cb) = callback {
            cb(&result);
        }
        self.state.lock().unwrap().result = Some(result);
        self.done.store(true, Ordering::Release);
        self.cv.notify_all();
        true
    }

    pub fn is_done(&self) -> bool {
        self.state.lock().unwrap().result.is_some()
    }

    /// The result once finished, without blocking.
    pub fn result(&self) -> Option<Result<i64>> {
        self.state.lock().unwrap().result.clone()
    }

    /// Block until finished or `deadline` (None: no deadline). Returns None on expiry.
    pub fn wait(&self, deadline: Option<Instant>) -> Option<Result<i64>> {
        let spin_until = Instant::now() + spin_budget();
        while !self.done.load(Ordering::Acquire) && Instant::now() < spin_until.min(deadline.unwrap_or(spin_until)) {
            std::thread::yield_now();
        }
        let mut st = self.state.lock().unwrap();
        loop {
            if let Some(r) = &st.result {
                return Some(r.clone());
            }
            match deadline {
                None => st = self.cv.wait(st).unwrap(),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    st = self.cv.wait_timeout(st, d - now).unwrap().0;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn callback_runs_before_result_is_visible() {
        let seen = Arc::new(AtomicBool::new(false));
        let s2 = seen.clone();
        let status = Status::with_callback(Box::new(move |r| {
            assert!(r.is_ok());
            s2.store(true, Ordering::SeqCst);
        }));
        let st = status.clone();
        let t = std::thread::spawn(move || st.wait(None).unwrap().unwrap());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!status.is_done());
        assert!(status.finish(Ok(7)));
        assert_eq!(t.join().unwrap(), 7);
        assert!(seen.load(Ordering::SeqCst));
        assert!(!status.finish(Err(Error::io("late"))), "first finish wins");
        assert_eq!(status.result().unwrap().unwrap(), 7);
    }

    #[test]
    fn wait_honours_deadline() {
        let status = Status::new();
        let t0 = Instant::now();
        assert!(status.wait(Some(t0 + Duration::from_millis(50))).is_none());
        assert!(t0.elapsed() >= Duration::from_millis(50));
    }
}
