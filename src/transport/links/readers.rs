//! Who reads a connection besides the reactor's wake-ups: threads that poll
//! it while they wait, and the reactor spinning on it for a while after it
//! was busy. When the last of them stops, somebody must arrange the next
//! read (spin again, or wait for the peer's wake-up), or the connection is
//! never read again and its peer's messages sit there until the op times out.
//!
//! Both live in one word. With two flags, the last poller leaving (pollers
//! down, then "is anyone spinning?") and a spin ending (spinning off, then
//! "is anyone polling?") could each read the other's old value, since a
//! store followed by a load of another variable may be reordered even on
//! x86: each left the connection to the other, and nobody read it (a W=4
//! allgather stalled for its whole timeout about once in ten benchmark runs).
//! Read-modify-writes of one word are totally ordered: whichever comes
//! second sees the first.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

/// Bit 0: the reactor spins on the connection; the rest: polling threads, times two.
#[derive(Default)]
pub struct Readers(AtomicUsize);

const SPINNING: usize = 1;
const POLLER: usize = 2;

/// What the caller does next for the connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Somebody else reads it (a poller, or a spin under way).
    Nothing,
    /// Have the reactor spin on it (this call marked it spinning).
    Spin,
    /// Wait for the peer to wake us: announce it, and read if something came meanwhile.
    Wait,
}

impl Readers {
    /// A thread starts polling; true if it is the first (the reactor's
    /// wake-ups can stop meanwhile).
    pub fn poll_begin(&self) -> bool {
        self.0.fetch_add(POLLER, SeqCst) < POLLER
    }

    /// A thread stops polling. The last one hands over: to a spin if `spin`
    /// (unless one is under way: its end sees no poller and waits), else to
    /// the peer's wake-up.
    pub fn poll_end(&self, spin: bool) -> Next {
        let before = self.update(|w| match w / POLLER {
            0 => panic!("poll_end without poll_begin"),
            1 if spin => (w - POLLER) | SPINNING,
            _ => w - POLLER,
        });
        match (before / POLLER, spin) {
            (1, true) if before & SPINNING == 0 => Next::Spin,
            (1, false) => Next::Wait,
            _ => Next::Nothing,
        }
    }

    /// The reactor read all there was: unless a thread polls, spin (if `spin`) or wait.
    pub fn drained(&self, spin: bool) -> Next {
        let before = self.update(|w| if w < POLLER && spin { w | SPINNING } else { w });
        match (before, spin) {
            (w, _) if w >= POLLER => Next::Nothing,
            (0, true) => Next::Spin,
            (_, true) => Next::Nothing, // already spinning
            (_, false) => Next::Wait,
        }
    }

    /// A spin is over: wait for the peer, unless a thread polls (the last
    /// one to stop then starts a new spin).
    pub fn spun(&self) -> Next {
        match self.0.fetch_and(!SPINNING, SeqCst) {
            w if w >= POLLER => Next::Nothing,
            _ => Next::Wait,
        }
    }

    fn update(&self, f: impl Fn(usize) -> usize) -> usize {
        self.0.fetch_update(SeqCst, SeqCst, |w| Some(f(w))).expect("always Some")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn the_last_reader_to_stop_always_hands_over() {
        let r = Readers::default();
        assert_eq!(r.drained(true), Next::Spin, "idle: spin");
        assert_eq!(r.drained(true), Next::Nothing, "already spinning");
        assert!(r.poll_begin());
        assert!(!r.poll_begin());
        assert_eq!(r.spun(), Next::Nothing, "pollers read: the spin ends without a hand-over");
        assert_eq!(r.drained(true), Next::Nothing, "pollers read");
        assert_eq!(r.poll_end(true), Next::Nothing, "another poller is left");
        assert_eq!(r.poll_end(true), Next::Spin, "the last poller starts a spin, as none is under way");
        assert_eq!(r.spun(), Next::Wait);
        assert!(r.poll_begin());
        assert_eq!(r.poll_end(false), Next::Wait, "no spinning: the last poller waits for the peer");
        assert_eq!(r.drained(false), Next::Wait);
        assert_eq!(r.0.load(SeqCst), 0);
    }

    /// The last poller leaves just as a spin ends, many times over, with
    /// the timing swept across the race: one of the two always arranges the
    /// next read. (Two flags lose about one race in a hundred here.)
    #[test]
    fn a_poller_leaving_and_a_spin_ending_never_both_step_back() {
        const ROUNDS: usize = 100_000;
        let r = Arc::new(Readers::default());
        let (go, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let spin_started = Arc::new(AtomicBool::new(false));
        let until = |flag: &AtomicUsize, round: usize| {
            let mut n = 0u32;
            while flag.load(SeqCst) != round {
                n += 1;
                if n.is_multiple_of(1024) {
                    std::thread::yield_now(); // the test threads may share a core
                }
                std::hint::spin_loop();
            }
        };
        let poller = {
            let (r, go, done, spin_started) = (r.clone(), go.clone(), done.clone(), spin_started.clone());
            std::thread::spawn(move || {
                for round in 1..=ROUNDS {
                    until(&go, round);
                    spin_started.store(r.poll_end(true) == Next::Spin, SeqCst);
                    done.store(round, SeqCst);
                }
            })
        };
        let mut lost = 0;
        for round in 1..=ROUNDS {
            // A spin is under way and a thread polls.
            assert_eq!(r.drained(true), Next::Spin);
            assert!(r.poll_begin());
            go.store(round, SeqCst);
            (0..round * 7919 % 13).for_each(|_| std::hint::spin_loop());
            let waits = r.spun() == Next::Wait;
            until(&done, round);
            if !waits && !spin_started.load(SeqCst) {
                lost += 1;
            }
            if spin_started.load(SeqCst) {
                assert_eq!(r.spun(), Next::Wait, "the spin the poller started ends");
            }
            assert_eq!(r.0.load(SeqCst), 0);
        }
        poller.join().unwrap();
        assert_eq!(lost, 0, "rounds in which nobody arranged the next read");
    }
}
