//! Per-op counters a user can read without a rebuild (`rustc10d.stats()`):
//! how many ops of each kind finished, how many bytes they moved, how long
//! they took, and what they cost in copies and sleeps (see `Cost`).

use crate::ops::OpKind;
use crate::status::Cost;
use std::collections::BTreeMap;
use std::sync::Mutex;
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

#[derive(Debug, Default)]
pub struct Stats(Mutex<BTreeMap<OpKind, OpStats>>);

impl Stats {
    pub fn record(&self, op: OpKind, bytes: u64, took: Duration, ok: bool, cost: &Cost) {
        let c = cost.totals();
        let mut map = self.0.lock().unwrap();
        let s = map.entry(op).or_default();
        s.count += 1;
        s.failed += u64::from(!ok);
        s.bytes += bytes;
        s.total += took;
        s.max = s.max.max(took);
        s.copied_bytes += c.copied;
        s.wakeups += c.wakeups;
        s.early_bytes += c.early;
    }

    pub fn snapshot(&self) -> BTreeMap<OpKind, OpStats> {
        self.0.lock().unwrap().clone()
    }
}
