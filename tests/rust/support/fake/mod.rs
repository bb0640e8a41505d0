//! What the tests on the in-memory `FakeNet` share: W ranks as threads of
//! one process, every op run through `engine::lend::run` as the engine's job
//! runs it (call check, algorithm, and on failure `abort_all`, as the
//! engine's break_group does), values to check against plain arithmetic.
//! Small segments, so that modest buffers take many pipelined steps. Each
//! test file uses part of it.
#![allow(dead_code, unused_imports)]

pub use rustc10d::algorithms::{self, call_check, OpCtx, ScratchPool, What};
pub use rustc10d::dtype::{DType, ReduceOp};
pub use rustc10d::error::{Error, ErrorKind, Result};
pub use rustc10d::ops::RawBuf;
pub use rustc10d::ops::{Collective, Reduction, SparseGathered, SparseShape};
pub use rustc10d::status::Status;
pub use rustc10d::transport::fake::{FakeNet, FakeTransport};
pub use rustc10d::transport::{Fold, Key, Transport};
pub use std::sync::{Arc, Mutex};
pub use std::time::{Duration, Instant};

pub const TIMEOUT: Duration = Duration::from_secs(5);
/// What a failure that spreads (no waiting for a timeout) must take at most.
pub const PROMPT: Duration = Duration::from_secs(2);
pub const SEGMENT: usize = 64;
/// `small_allreduce_bytes` that sends every all-reduce around the ring, or
/// every one through the direct exchange.
pub const RING: usize = 0;
pub const DIRECT: usize = usize::MAX;
pub const PATHS: [(&str, usize); 2] = [("ring", RING), ("direct", DIRECT)];

/// One rank of a group: what the engine keeps for it.
pub struct Rank<'a> {
    pub t: &'a FakeTransport,
    pub pool: ScratchPool,
    pub seq: u64,
    pub small: usize,
    /// Each op's timeout.
    pub timeout: Duration,
}

impl Rank<'_> {
    pub fn rank(&self) -> usize {
        self.t.rank()
    }

    pub fn world(&self) -> usize {
        self.t.size()
    }

    /// Run one collective as src/engine/job.rs does: refuse a bad call,
    /// check the call (inline with the smallest all-reduces and barriers),
    /// run the algorithm, and break the group if it failed.
    pub fn run(&mut self, part: Collective) -> Result<()> {
        part.check(self.rank(), self.world())?;
        self.run_unchecked(part)
    }

    /// `run` without refusing a bad call: what a peer that lies sends.
    pub fn run_unchecked(&mut self, part: Collective) -> Result<()> {
        let rank = self.rank();
        let seq = self.seq;
        self.seq += 1;
        let ctx = OpCtx {
            transport: self.t,
            seq,
            timeout: self.timeout,
            deadline: std::time::Instant::now() + self.timeout,
            what: What::new(part.kind().name(), seq, rank),
            segment_bytes: SEGMENT,
            small_allreduce_bytes: self.small,
            pool: &self.pool,
            spin: Duration::ZERO,
            piece: 0,
            phase: 0,
            cost: &Default::default(),
        };
        let fingerprint = call_check::Fingerprint::of(&part);
        let plan = algorithms::Plan::of(&ctx, &part, true);
        let checked = if plan.checks_inline { Ok(()) } else { call_check::agree(&ctx, &fingerprint) };
        let r = checked.and_then(|()| rustc10d::engine::lend::run(&ctx, &part, &plan, &fingerprint));
        if let Err(e) = &r {
            self.t.abort_all(e, seq);
        }
        r
    }
}

/// Run `f` on every rank of a new network of `world` ranks at once. A rank
/// that panics cuts its links first, so the others fail at once instead of
/// at their timeout; the first panic is then re-raised.
pub fn on_ranks<T: Send>(world: usize, small: usize, f: impl Fn(&mut Rank) -> T + Sync) -> Vec<T> {
    on_net(&FakeNet::new(world), small, f)
}

/// A kind of network the data-moving algorithms are checked on.
#[derive(Clone, Copy, Debug)]
pub enum Net {
    /// One host (the ring algorithms).
    Plain,
    /// One host where every message of this many bytes or more may go as its
    /// address (the single-copy algorithms, for buffers that large).
    SingleCopy(usize),
    /// Rank r of W on host `host(r, W)` (the algorithms for several hosts:
    /// hierarchical where every host holds as many ranks, at least two; a
    /// ring in host order otherwise).
    Hosts(fn(usize, usize) -> usize),
    /// One host with a shared arena of slots this large, where every message
    /// this large or more may go as its address (the arena's algorithms, but
    /// for buffers that take the single-copy ones).
    Arena(usize, Option<usize>),
    /// As `Hosts`, with an arena of slots this large for each host's ranks
    /// (the hierarchical algorithms' phases on the host go there).
    HostArenas(usize, fn(usize, usize) -> usize),
}

impl Net {
    pub fn endpoints(self, world: usize) -> Vec<Arc<FakeTransport>> {
        match self {
            Net::Plain => FakeNet::new(world),
            Net::SingleCopy(from) => FakeNet::with_single_copy(world, Some(from)),
            Net::Hosts(host) => FakeNet::on_hosts((0..world).map(|r| host(r, world)).collect()),
            Net::Arena(slot, single_copy) => FakeNet::with_arena(world, slot, single_copy),
            Net::HostArenas(slot, host) => {
                FakeNet::on_hosts_with_arenas((0..world).map(|r| host(r, world)).collect(), slot)
            }
        }
    }

    /// From what size messages may go as their address.
    pub fn single_copy(self) -> Option<usize> {
        match self {
            Net::SingleCopy(from) | Net::Arena(_, Some(from)) => Some(from),
            _ => None,
        }
    }

    /// Whether the ranks run on several hosts (for more than one rank).
    pub fn hosts(self) -> bool {
        matches!(self, Net::Hosts(_) | Net::HostArenas(..))
    }

    /// The bytes of a slot of the group's shared arena of all its ranks, if it has one.
    pub fn arena_slot(self) -> Option<usize> {
        match self {
            Net::Arena(slot, _) => Some(slot),
            _ => None,
        }
    }

    /// Whether the group has a shared arena of all its ranks.
    pub fn arena(self) -> bool {
        matches!(self, Net::Arena(..))
    }
}

/// The networks every data-moving algorithm is checked on.
pub const NETS: [(&str, Net); 8] = [
    ("ring", Net::Plain),
    ("single copy from 64 bytes", Net::SingleCopy(64)),
    // Small slots: the tests' buffers take many rounds.
    ("arena of 256-byte slots", Net::Arena(256, None)),
    ("arena, single copy from 256 bytes", Net::Arena(4096, Some(256))),
    ("hosts of two ranks", Net::Hosts(|r, _| r / 2)),
    ("two hosts, ranks alternating", Net::Hosts(|r, _| r % 2)),
    ("hosts of two ranks, an arena of 256-byte slots each", Net::HostArenas(256, |r, _| r / 2)),
    ("two hosts, ranks alternating, an arena each", Net::HostArenas(4096, |r, _| r % 2)),
];

/// `on_ranks` on one of `NETS`.
pub fn on_ranks_via<T: Send>(net: Net, world: usize, small: usize, f: impl Fn(&mut Rank) -> T + Sync) -> Vec<T> {
    on_net(&net.endpoints(world), small, f)
}

pub fn on_net<T: Send>(net: &[Arc<FakeTransport>], small: usize, f: impl Fn(&mut Rank) -> T + Sync) -> Vec<T> {
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = net
            .iter()
            .map(|t| {
                let f = &f;
                s.spawn(move || {
                    let mut rank = Rank { t, pool: ScratchPool::default(), seq: 0, small, timeout: TIMEOUT };
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut rank)));
                    if r.is_err() {
                        t.abort_all(&Error::aborted(format!("rank {} panicked", t.rank())), 0);
                    }
                    r
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    results.into_iter().map(|r| r.unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect()
}

/// 8-byte aligned bytes (reduction kernels view them as any dtype).
#[derive(Clone, PartialEq, Eq)]
pub struct Buf {
    words: Vec<u64>,
    len: usize,
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{:?}", self.bytes())
    }
}

impl Buf {
    pub fn bytes_of(bytes: &[u8]) -> Buf {
        let mut b = Buf { words: vec![0; bytes.len().div_ceil(8)], len: bytes.len() };
        b.bytes_mut().copy_from_slice(bytes);
        b
    }

    /// `vals` as elements of `dtype` (the values are small integers or
    /// exact fractions, so every dtype holds them exactly).
    pub fn of(dtype: DType, vals: &[f64]) -> Buf {
        let bytes: Vec<u8> = vals
            .iter()
            .flat_map(|&v| match dtype {
                DType::I64 => (v as i64).to_le_bytes().to_vec(),
                DType::F32 => (v as f32).to_le_bytes().to_vec(),
                DType::F64 => v.to_le_bytes().to_vec(),
                _ => unreachable!("not used here"),
            })
            .collect();
        Buf::bytes_of(&bytes)
    }

    pub fn filled(len: usize, byte: u8) -> Buf {
        Buf::bytes_of(&vec![byte; len])
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` <= 8 * words.len() (`bytes_of`, the only maker of a
        // Buf, makes it so), u8 has no alignment, and the bytes are borrowed
        // with `self`.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; borrowed mutably with `self`.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }

    pub fn raw(&mut self) -> RawBuf {
        RawBuf::new(self.words.as_mut_ptr().cast(), self.len)
    }
}

pub fn raws(bufs: &mut [Buf]) -> Vec<RawBuf> {
    bufs.iter_mut().map(Buf::raw).collect()
}

/// A reduction, and the same in plain arithmetic.
#[derive(Clone, Copy, Debug)]
pub struct Red {
    pub dtype: DType,
    pub op: ReduceOp,
    pub premul: Option<f64>,
}

pub const REDS: [Red; 5] = [
    Red { dtype: DType::I64, op: ReduceOp::Sum, premul: None },
    Red { dtype: DType::F32, op: ReduceOp::Max, premul: None },
    Red { dtype: DType::F64, op: ReduceOp::Avg, premul: None },
    Red { dtype: DType::F64, op: ReduceOp::Min, premul: None },
    // PREMUL_SUM: every contribution times 0.25, then summed (exact in binary).
    Red { dtype: DType::F64, op: ReduceOp::Sum, premul: Some(0.25) },
];

impl Red {
    pub fn reduction(self) -> Reduction {
        Reduction { dtype: self.dtype, op: self.op, premul: self.premul }
    }

    pub fn combine(self, vals: impl Iterator<Item = f64>) -> f64 {
        let vals: Vec<f64> = vals.collect();
        let sum = || vals.iter().sum::<f64>();
        match (self.premul, self.op) {
            (Some(f), _) => vals.iter().map(|v| v * f).sum(),
            (None, ReduceOp::Sum) => sum(),
            (None, ReduceOp::Avg) => sum() / vals.len() as f64,
            (None, ReduceOp::Max) => vals.iter().copied().fold(f64::MIN, f64::max),
            (None, ReduceOp::Min) => vals.iter().copied().fold(f64::MAX, f64::min),
            _ => unreachable!("not used here"),
        }
    }
}

/// Rank `r`'s element `i` in variant `salt`: integers in [-1000, 1000].
pub fn value(r: usize, i: usize, salt: usize) -> f64 {
    ((i * 7919 + r * 104_729 + salt * 31) % 2001) as f64 - 1000.0
}

pub fn values(r: usize, n: usize, salt: usize) -> Vec<f64> {
    (0..n).map(|i| value(r, i, salt)).collect()
}

/// Bytes with a pattern of their own per (a, b).
pub fn pattern(a: usize, b: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (a * 59 + b * 17 + j * 3 + 1) as u8).collect()
}

pub fn ok(r: Result<()>, what: impl std::fmt::Display) {
    if let Err(e) = r {
        panic!("{what}: {}", e.message);
    }
}

/// Element counts: empty, one, fewer than the ranks, odd, either side of
/// 64 bytes, and many segments.
pub const COUNTS: [usize; 12] = [0, 1, 2, 3, 7, 8, 9, 16, 17, 64, 257, 1000];

/// Run on rank `rk` an all-reduce of 8 i64, or, on rank `odd`, the call of
/// `case`: "byte count" (9 i64), "larger than small" (16 i64: past a small
/// threshold between 72 and 128 bytes), "op" (a reduce of 8), "gather
/// root" (a gather of the 8 i64 to rank 1, where the others gather to rank
/// 0). Returns how the op ended, and whether the buffer (the gather's
/// outputs) is as it was.
pub fn mismatched_call(rk: &mut Rank, odd: usize, case: &str) -> (Result<()>, bool) {
    let r = rk.rank();
    let n = match case {
        "byte count" if r == odd => 9,
        "larger than small" if r == odd => 16,
        _ => 8,
    };
    let mut b = Buf::of(DType::I64, &values(r, n, 0));
    let kept = b.clone();
    if case == "gather root" {
        // The odd rank gathers to rank 1, the others to rank 0.
        let root = usize::from(r == odd);
        let mut outputs: Vec<Buf> =
            (0..if r == root { rk.t.size() } else { 0 }).map(|_| Buf::filled(64, 0xEE)).collect();
        let part =
            Collective::Gather { input: b.raw(), outputs: raws(&mut outputs), root, dtype: rustc10d::dtype::BYTES };
        return (rk.run(part), outputs.iter().all(|o| o == &Buf::filled(64, 0xEE)));
    }
    let red = Reduction::new(DType::I64, ReduceOp::Sum);
    let part = if case == "op" && r == odd {
        Collective::Reduce { buf: b.raw(), root: 0, red }
    } else {
        Collective::AllReduce { buf: b.raw(), red }
    };
    (rk.run(part), b == kept)
}

/// Every rank of a mismatched call (`mismatched_call`) failed naming the
/// mismatch, promptly (since `t0`), and left its buffer alone.
pub fn assert_mismatch_everywhere(out: Vec<(Result<()>, bool)>, t0: Instant, at: &str) {
    assert!(t0.elapsed() < PROMPT, "{at}: took {:?}", t0.elapsed());
    for (rank, (r, untouched)) in out.into_iter().enumerate() {
        let e = r.expect_err(&format!("{at}: rank {rank} completed"));
        assert!(e.message.contains("does not match"), "{at}: rank {rank}: {}", e.message);
        assert!(untouched, "{at}: rank {rank}'s buffer changed");
    }
}
