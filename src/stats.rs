//! Per-op counters a user can read without a rebuild (`rustc10d.stats()`):
//! how many ops of each kind finished, how many bytes they moved, how long
//! they took, and what they cost in copies and sleeps (see `Cost`).

use crate::locks::{level, Mutex};
use crate::ops::OpKind;
use crate::status::Cost;
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct OpStats {
    pub count: u64,
    pub failed: u64,
    /// The op's buffer size (for collectives: what the call passed).
    pub bytes: u64,
    pub total: Duration,
    pub max: Duration,
    /// Bytes moved through copies and folds, sleeps, and bytes that waited
    /// in memory for their receive (`Cost`).
    pub copied_bytes: u64,
    pub wakeups: u64,
    pub early_bytes: u64,
}

/// A slot per kind (in `OpKind::ALL`'s order, which is the codes'), so that
/// recording touches one slot, not a map's nodes.
#[derive(Debug, Default)]
pub struct Stats(Mutex<level::Stats, [OpStats; OpKind::ALL.len()]>);

// A kind's slot is its code.
const _: () = {
    let mut i = 0;
    while i < OpKind::ALL.len() {
        assert!(OpKind::ALL[i] as usize == i);
        i += 1;
    }
};

impl Stats {
    pub fn record(&self, op: OpKind, bytes: u64, took: Duration, ok: bool, cost: &Cost) {
        let c = cost.totals();
        let mut slots = self.0.lock().unwrap();
        let s = &mut slots[op as usize];
        s.count += 1;
        s.failed += u64::from(!ok);
        s.bytes += bytes;
        s.total += took;
        s.max = s.max.max(took);
        s.copied_bytes += c.copied;
        s.wakeups += c.wakeups;
        s.early_bytes += c.early;
    }

    /// The kinds that ran (or failed) at least once.
    pub fn snapshot(&self) -> BTreeMap<OpKind, OpStats> {
        let slots = *self.0.lock().unwrap();
        OpKind::ALL.into_iter().zip(slots).filter(|(_, s)| s.count > 0).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_has_the_kinds_that_ran_each_with_its_own_counts() {
        let stats = Stats::default();
        assert!(stats.snapshot().is_empty());
        let cost = Cost::default();
        stats.record(OpKind::Recv, 8, Duration::from_micros(3), true, &cost);
        stats.record(OpKind::AllReduce, 100, Duration::from_micros(5), false, &cost);
        stats.record(OpKind::AllReduce, 28, Duration::from_micros(2), true, &cost);
        let snap = stats.snapshot();
        assert_eq!(snap.keys().copied().collect::<Vec<_>>(), [OpKind::AllReduce, OpKind::Recv]);
        let a = snap[&OpKind::AllReduce];
        assert_eq!((a.count, a.failed, a.bytes), (2, 1, 128));
        assert_eq!((a.total, a.max), (Duration::from_micros(7), Duration::from_micros(5)));
        let r = snap[&OpKind::Recv];
        assert_eq!((r.count, r.failed, r.bytes), (1, 0, 8));
    }
}
