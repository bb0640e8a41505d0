//! Per-op counters a user can read without a rebuild (`rustc10d.stats()`):
//! how many ops of each kind finished, how many bytes they moved, how long
//! they took.

use crate::ops::OpKind;
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
}

#[derive(Debug, Default)]
pub struct Stats(Mutex<BTreeMap<OpKind, OpStats>>);

impl Stats {
    pub fn record(&self, op: OpKind, bytes: u64, took: Duration, ok: bool) {
        let mut map = self.0.lock().unwrap();
        let s = map.entry(op).or_default();
        s.count += 1;
        s.failed += u64::from(!ok);
        s.bytes += bytes;
        s.total += took;
        s.max = s.max.max(took);
    }

    pub fn snapshot(&self) -> BTreeMap<OpKind, OpStats> {
        self.0.lock().unwrap().clone()
    }
}
