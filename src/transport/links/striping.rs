//! How many TCP connections carry the sends to one peer. One TCP stream
//! often cannot fill a fast link (a core's worth of kernel work per stream,
//! a window too small for the path, a per-flow limit in the network), so
//! with `nsocks=auto` each rank measures the throughput of its large sends
//! to each peer with 1 connection, then 2, 4, up to `AUTO_MAX_LANES`, and
//! keeps doubling while a doubling gains at least `GAIN`; at the first that
//! does not, it goes back to the best count and stays there. A count's rate
//! is the best of up to `SAMPLES_PER_COUNT` samples: on a shared machine a
//! sample is often slowed by something else (another process, the peer
//! still widening its own sends), rarely sped up, so one slow sample must
//! neither end the doubling nor set too low a bar for the next count.
//! A doubling that seems to gain is confirmed before it is kept: the count
//! before it is measured once more, and the doubled count must beat that
//! sample too, by `CONFIRM_GAIN`. Without it, a spell of load across all of
//! the first count's samples that lifted by the doubled count's first
//! sample passes for a gain (seen: 4 connections on a link that one fills).
//! The confirmation guards against a bar that load set too low, not against
//! a modest gain, so its margin is only above the noise: raising the bar
//! to `GAIN` times the best of three samples would turn down real gains
//! near `GAIN` (seen on the test bed: 4 connections measured at 1.25-1.5x
//! 2, where the op went nearly 2x faster, kept at 2).
//!
//! The throughput is bytes delivered per second while sends of at least
//! `MEASURED_SEND` bytes were queued to the peer: from when one is queued
//! with none before it to when the last is written into the sockets, less
//! the bytes the sockets still hold then (and plus those they held at the
//! start), so that bigger socket buffers with more connections do not pass
//! for speed. Small sends measure latency, not throughput, and are left out.
//!
//! No I/O and no clock: the link reports what it queued and wrote, with the
//! time and a way to ask the sockets what they still hold.

use std::time::{Duration, Instant};

/// Sends this large or larger are measured.
pub const MEASURED_SEND: usize = 256 << 10;
/// Bytes each measurement spans (several busy spells of the link add up).
pub const SAMPLE_BYTES: u64 = 32 << 20;
/// Samples taken of a count before it is judged (one suffices to keep a
/// doubling that gains enough).
pub const SAMPLES_PER_COUNT: usize = 2;
/// How much faster a doubled count must be to be kept.
pub const GAIN: f64 = 1.2;
/// How much faster a doubled count that cleared the bar must be than the
/// count before it, measured once more (see above).
pub const CONFIRM_GAIN: f64 = 1.1;
/// The most connections `auto` opens to one peer.
pub const AUTO_MAX_LANES: usize = 8;

/// What the configuration asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneCount {
    Fixed(usize),
    Auto,
}

#[derive(Debug)]
pub struct Striping {
    lanes: usize,
    tuning: Tuning,
    meter: Meter,
}

#[derive(Debug, Clone, PartialEq)]
enum Tuning {
    /// Nothing to choose.
    Fixed,
    /// Measuring `lanes`: the best count before it with its bytes per
    /// second, and this count's samples so far (how many, the fastest).
    Trying {
        best: Option<(usize, f64)>,
        samples: usize,
        fastest: f64,
    },
    /// Measuring `lanes` once more: `doubled` connections came out at the
    /// rate given, which cleared the bar of `lanes`' rate before.
    Confirming {
        doubled: (usize, f64),
    },
    Settled,
}

#[derive(Debug, Default)]
struct Meter {
    /// Bytes of measured sends queued and not yet written into the sockets.
    pending: u64,
    /// The busy spell under way: since when, what the sockets held then,
    /// and the bytes written since.
    spell: Option<(Instant, u64, u64)>,
    /// The sample so far: bytes delivered, in how long.
    bytes: u64,
    busy: Duration,
}

impl Striping {
    pub fn new(count: LaneCount) -> Striping {
        let (lanes, tuning) = match count {
            LaneCount::Fixed(n) => (n.max(1), Tuning::Fixed),
            LaneCount::Auto => (1, Tuning::Trying { best: None, samples: 0, fastest: 0.0 }),
        };
        Striping { lanes, tuning, meter: Meter::default() }
    }

    /// The connections to spread sends over now.
    pub fn lanes(&self) -> usize {
        self.lanes
    }

    /// Whether the count is chosen and will not change.
    pub fn settled(&self) -> bool {
        matches!(self.tuning, Tuning::Fixed | Tuning::Settled)
    }

    /// A send of `len` bytes was queued. `unsent`: the bytes the peer's
    /// sockets hold, not yet delivered (asked only when a busy spell starts).
    pub fn queued(&mut self, len: usize, now: Instant, unsent: impl FnOnce() -> u64) {
        if self.settled() || len < MEASURED_SEND {
            return;
        }
        let m = &mut self.meter;
        if m.pending == 0 {
            m.spell = Some((now, unsent(), 0));
        }
        m.pending += len as u64;
    }

    /// A send of `len` bytes was written into its socket in full (or failed
    /// with its connection). `unsent` as for `queued` (asked when a spell ends).
    pub fn written(&mut self, len: usize, now: Instant, unsent: impl FnOnce() -> u64) {
        if self.settled() || len < MEASURED_SEND {
            return;
        }
        let m = &mut self.meter;
        let Some((start, held, written)) = m.spell.as_mut() else { return };
        *written += len as u64;
        m.pending = m.pending.saturating_sub(len as u64);
        if m.pending > 0 {
            return;
        }
        // Delivered in the spell: what was written, plus what the sockets
        // held at its start, less what they still hold.
        m.bytes += (*written + *held).saturating_sub(unsent());
        m.busy += now.saturating_duration_since(*start);
        m.spell = None;
        if m.bytes >= SAMPLE_BYTES && !m.busy.is_zero() {
            let rate = m.bytes as f64 / m.busy.as_secs_f64();
            self.measured(rate);
        }
    }

    /// A sample at `self.lanes` came out at `rate` bytes per second (the
    /// meter is idle: its spell has just ended).
    fn measured(&mut self, rate: f64) {
        self.meter = Meter::default();
        tracing::debug!("rustc10d: {} connection(s) to a peer: {:.0} MB/s ({:?})", self.lanes, rate / 1e6, self.tuning);
        match self.tuning {
            Tuning::Trying { best, samples, fastest } => {
                let (samples, fastest) = (samples + 1, fastest.max(rate));
                let gained = best.is_none_or(|(_, best_rate)| fastest >= best_rate * GAIN);
                // The first count has no bar to clear: its rate is the bar for the
                // next, so it gets all its samples; a later one gets them until it clears.
                if samples < SAMPLES_PER_COUNT && (best.is_none() || !gained) {
                    self.tuning = Tuning::Trying { best, samples, fastest };
                    return;
                }
                match best {
                    None => self.double((self.lanes, fastest)),
                    Some((lanes, _)) if gained => {
                        self.tuning = Tuning::Confirming { doubled: (self.lanes, fastest) };
                        self.lanes = lanes;
                    }
                    Some((lanes, _)) => self.settle(lanes),
                }
            }
            Tuning::Confirming { doubled } => {
                if doubled.1 >= rate * CONFIRM_GAIN {
                    self.double(doubled);
                } else {
                    self.settle(self.lanes);
                }
            }
            Tuning::Fixed | Tuning::Settled => {}
        }
    }

    /// `kept` (a count and its rate) is the best so far: try twice as many,
    /// unless that would be too many.
    fn double(&mut self, kept: (usize, f64)) {
        if kept.0 >= AUTO_MAX_LANES {
            self.settle(kept.0);
        } else {
            self.tuning = Tuning::Trying { best: Some(kept), samples: 0, fastest: 0.0 };
            self.lanes = kept.0 * 2;
        }
    }

    fn settle(&mut self, lanes: usize) {
        self.lanes = lanes;
        self.tuning = Tuning::Settled;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: usize = 1 << 20;

    /// Sends `count` messages of `len` bytes back to back on a link that
    /// delivers `rate(lanes)` bytes per second, with sockets that hold
    /// `buffer` bytes per connection; returns the clock after.
    fn spell(
        s: &mut Striping,
        t: Instant,
        count: usize,
        len: usize,
        rate: impl Fn(usize) -> f64,
        buffer: u64,
    ) -> Instant {
        let lanes = s.lanes();
        let held = buffer * lanes as u64;
        for _ in 0..count {
            s.queued(len, t, || 0);
        }
        // The sockets take the bytes as fast as the link delivers them, and
        // hold `held` of them when the last is written.
        let delivered = (count * len) as u64 - held;
        let t = t + Duration::from_secs_f64(delivered as f64 / rate(lanes));
        for _ in 0..count {
            s.written(len, t, || held);
        }
        t + Duration::from_secs_f64(held as f64 / rate(lanes)) + Duration::from_millis(5)
    }

    fn tune(rate: impl Fn(usize) -> f64 + Copy, buffer: u64) -> Striping {
        let mut s = Striping::new(LaneCount::Auto);
        let mut t = Instant::now();
        for _ in 0..40 {
            t = spell(&mut s, t, 16, 4 * MB, rate, buffer);
        }
        assert!(s.settled());
        s
    }

    #[test]
    fn doubles_while_it_pays_and_stops_where_the_link_is_full() {
        // A per-stream limit of 60 MB/s under a 250 MB/s link: 4 connections fill it.
        let capped = |lanes: usize| (lanes as f64 * 60e6).min(250e6);
        assert_eq!(tune(capped, 4 * MB as u64).lanes(), 4);
        // One stream fills the link: stays at one, however big the socket buffers.
        assert_eq!(tune(|_| 250e6, 4 * MB as u64).lanes(), 1);
        assert_eq!(tune(|_| 250e6, 0).lanes(), 1);
        // Every doubling pays: stops at the most it opens.
        assert_eq!(tune(|lanes| lanes as f64 * 1e8, MB as u64).lanes(), AUTO_MAX_LANES);
        // A gain under GAIN is noise, not a reason for more connections.
        assert_eq!(tune(|lanes| if lanes == 1 { 1e8 } else { 1.1e8 }, 0).lanes(), 1);
    }

    #[test]
    fn one_slow_sample_neither_stops_the_doubling_nor_lowers_the_bar() {
        // Per-stream limit of 60 MB/s under 250 MB/s; every other sample at
        // each count is slowed to a third by something else on the machine.
        let mut s = Striping::new(LaneCount::Auto);
        let mut t = Instant::now();
        let mut slow = true;
        for _ in 0..80 {
            slow = !slow;
            let lanes_rate = move |lanes: usize| (lanes as f64 * 60e6).min(250e6) / if slow { 3.0 } else { 1.0 };
            t = spell(&mut s, t, 8, 4 * MB, lanes_rate, 0);
        }
        assert_eq!((s.settled(), s.lanes()), (true, 4));
        // One stream fills the link, but its first sample is slow: the fast
        // second sample is the bar, and 2 connections do not clear it.
        let mut s = Striping::new(LaneCount::Auto);
        let mut t = Instant::now();
        for i in 0..80 {
            let first = i == 0;
            t = spell(&mut s, t, 8, 4 * MB, move |_| if first { 100e6 } else { 250e6 }, 0);
        }
        assert_eq!((s.settled(), s.lanes()), (true, 1));
    }

    /// Tunes on a link whose `i`th sample (from 0) at `lanes` comes out at
    /// `rate(i, lanes)`; returns the count it settles at.
    fn tune_by_sample(rate: impl Fn(usize, usize) -> f64) -> usize {
        let mut s = Striping::new(LaneCount::Auto);
        let mut t = Instant::now();
        // Each spell here is exactly one sample (8 sends of 4 MB = SAMPLE_BYTES).
        for i in 0..80 {
            let r = rate(i, s.lanes());
            t = spell(&mut s, t, 8, 4 * MB, move |_| r, 0);
        }
        assert!(s.settled());
        s.lanes()
    }

    /// As `tune_by_sample` on a link of `rate(lanes)`, the samples where
    /// `slow(i)` slowed to a third.
    fn tune_under_load(rate: fn(usize) -> f64, slow: fn(usize) -> bool) -> usize {
        tune_by_sample(|i, lanes| rate(lanes) / if slow(i) { 3.0 } else { 1.0 })
    }

    #[test]
    fn a_gain_that_was_only_load_lifting_is_not_kept() {
        // One connection fills the link, but both of its samples fall in a
        // spell of load that lifts just before 2 connections are measured:
        // 2 seem 3x faster. Measured again, 1 is as fast: stays at one.
        assert_eq!(tune_under_load(|_| 250e6, |i| i < 2), 1);
        // The same with the doubled count's first sample slowed as well: it
        // clears the bar with its second.
        assert_eq!(tune_under_load(|_| 250e6, |i| i < 3), 1);
        // A real gain stays one when the confirming sample of the count
        // before it is slowed: that sample cannot lower the bar. Per-stream
        // limit of 60 MB/s under 250 MB/s, every confirmation slowed
        // (samples 3 and 5: 1, 1, 2, [1], 4, [2], 8, 8).
        assert_eq!(tune_under_load(|l| (l as f64 * 60e6).min(250e6), |i| i == 3 || i == 5), 4);
    }

    #[test]
    fn a_modest_gain_is_kept_when_its_confirmation_comes_out_a_little_faster() {
        // 4 connections give 1.25x what 2 do (two of them share a capped
        // bucket); the confirming sample of 2 comes out 5% faster than its
        // first (samples: 1, 1, 2, [1], 4, [2], 8, 8).
        let rate = |i: usize, lanes: usize| match (i, lanes) {
            (5, 2) => 126e6,
            (_, 1) => 62e6,
            (_, 2) => 120e6,
            _ => 150e6,
        };
        assert_eq!(tune_by_sample(rate), 4);
    }

    #[test]
    fn small_sends_and_fixed_counts_are_left_alone() {
        let mut s = Striping::new(LaneCount::Auto);
        let mut t = Instant::now();
        for _ in 0..1000 {
            t = spell(&mut s, t, 8, MEASURED_SEND - 1, |_| 1e6, 0);
        }
        assert!(!s.settled() && s.lanes() == 1, "latency-bound sends do not count");
        let mut f = Striping::new(LaneCount::Fixed(3));
        spell(&mut f, t, 40, 4 * MB, |l| l as f64 * 1e8, 0);
        assert!(f.settled() && f.lanes() == 3);
    }

    #[test]
    fn idle_time_between_spells_is_not_counted() {
        // 1 MB at a time with long gaps: still 100 MB/s, so one connection.
        let mut s = Striping::new(LaneCount::Auto);
        let mut t = Instant::now();
        for _ in 0..200 {
            t = spell(&mut s, t, 1, MB, |lanes| if lanes == 1 { 1e8 } else { 1.05e8 }, 0) + Duration::from_secs(1);
        }
        assert_eq!((s.settled(), s.lanes()), (true, 1));
    }
}
