//! The collective algorithms on the in-memory `FakeNet`, without sockets or
//! the engine: W ranks as threads of one process, every op run through
//! `algorithms::run` as the engine's job runs it (call check, algorithm, and
//! on failure `abort_all`, as the engine's break_group does), every result
//! checked against plain arithmetic. Small segments, so that modest buffers
//! take many pipelined steps. Every wait is bounded by the op's timeout.

use rustc10d::algorithms::{self, call_check, OpCtx, RawBuf, ScratchPool};
use rustc10d::dtype::{DType, ReduceOp};
use rustc10d::error::{Error, ErrorKind, Result};
use rustc10d::ops::{Collective, Reduction};
use rustc10d::status::Status;
use rustc10d::transport::fake::{FakeNet, FakeTransport};
use rustc10d::transport::{Fold, Key, Transport};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(5);
/// What a failure that spreads (no waiting for a timeout) must take at most.
const PROMPT: Duration = Duration::from_secs(2);
const SEGMENT: usize = 64;
/// `small_allreduce_bytes` that sends every all-reduce around the ring, or
/// every one through the direct exchange.
const RING: usize = 0;
const DIRECT: usize = usize::MAX;
const PATHS: [(&str, usize); 2] = [("ring", RING), ("direct", DIRECT)];

/// One rank of a group: what the engine keeps for it.
struct Rank<'a> {
    t: &'a FakeTransport,
    pool: ScratchPool,
    seq: u64,
    small: usize,
}

impl Rank<'_> {
    fn rank(&self) -> usize {
        self.t.rank()
    }

    fn world(&self) -> usize {
        self.t.size()
    }

    /// Run one collective as src/engine/job.rs does: refuse a bad call,
    /// check the call (inline with the smallest all-reduces and barriers),
    /// run the algorithm, and break the group if it failed.
    fn run(&mut self, part: Collective) -> Result<()> {
        let (rank, world) = (self.rank(), self.world());
        part.check(rank, world)?;
        let seq = self.seq;
        self.seq += 1;
        let ctx = OpCtx {
            transport: self.t,
            seq,
            timeout: TIMEOUT,
            what: format!("{} #{seq} on rank {rank}", part.kind().name()),
            segment_bytes: SEGMENT,
            small_allreduce_bytes: self.small,
            pool: &self.pool,
            spin: Duration::ZERO,
            piece: 0,
        };
        let fingerprint = call_check::Fingerprint::of(&part);
        let inline = algorithms::checks_inline(&ctx, &part);
        let checked = if inline { Ok(()) } else { call_check::agree(&ctx, &fingerprint) };
        let r = checked.and_then(|()| algorithms::run(&ctx, &part, inline.then_some(&fingerprint)));
        if let Err(e) = &r {
            self.t.abort_all(e);
        }
        r
    }
}

/// Run `f` on every rank of a new network of `world` ranks at once. A rank
/// that panics cuts its links first, so the others fail at once instead of
/// at their timeout; the first panic is then re-raised.
fn on_ranks<T: Send>(world: usize, small: usize, f: impl Fn(&mut Rank) -> T + Sync) -> Vec<T> {
    on_net(&FakeNet::new(world), small, f)
}

fn on_net<T: Send>(net: &[Arc<FakeTransport>], small: usize, f: impl Fn(&mut Rank) -> T + Sync) -> Vec<T> {
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = net
            .iter()
            .map(|t| {
                let f = &f;
                s.spawn(move || {
                    let mut rank = Rank { t, pool: ScratchPool::default(), seq: 0, small };
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut rank)));
                    if r.is_err() {
                        t.abort_all(&Error::aborted(format!("rank {} panicked", t.rank())));
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
struct Buf {
    words: Vec<u64>,
    len: usize,
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{:?}", self.bytes())
    }
}

impl Buf {
    fn bytes_of(bytes: &[u8]) -> Buf {
        let mut b = Buf { words: vec![0; bytes.len().div_ceil(8)], len: bytes.len() };
        b.bytes_mut().copy_from_slice(bytes);
        b
    }

    /// `vals` as elements of `dtype` (the values are small integers or
    /// exact fractions, so every dtype holds them exactly).
    fn of(dtype: DType, vals: &[f64]) -> Buf {
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

    fn filled(len: usize, byte: u8) -> Buf {
        Buf::bytes_of(&vec![byte; len])
    }

    fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }

    fn raw(&mut self) -> RawBuf {
        RawBuf::new(self.words.as_mut_ptr().cast(), self.len)
    }
}

fn raws(bufs: &mut [Buf]) -> Vec<RawBuf> {
    bufs.iter_mut().map(Buf::raw).collect()
}

/// A reduction, and the same in plain arithmetic.
#[derive(Clone, Copy, Debug)]
struct Red {
    dtype: DType,
    op: ReduceOp,
    premul: Option<f64>,
}

const REDS: [Red; 5] = [
    Red { dtype: DType::I64, op: ReduceOp::Sum, premul: None },
    Red { dtype: DType::F32, op: ReduceOp::Max, premul: None },
    Red { dtype: DType::F64, op: ReduceOp::Avg, premul: None },
    Red { dtype: DType::F64, op: ReduceOp::Min, premul: None },
    // PREMUL_SUM: every contribution times 0.25, then summed (exact in binary).
    Red { dtype: DType::F64, op: ReduceOp::Sum, premul: Some(0.25) },
];

impl Red {
    fn reduction(self) -> Reduction {
        Reduction { dtype: self.dtype, op: self.op, premul: self.premul }
    }

    fn combine(self, vals: impl Iterator<Item = f64>) -> f64 {
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
fn value(r: usize, i: usize, salt: usize) -> f64 {
    ((i * 7919 + r * 104_729 + salt * 31) % 2001) as f64 - 1000.0
}

fn values(r: usize, n: usize, salt: usize) -> Vec<f64> {
    (0..n).map(|i| value(r, i, salt)).collect()
}

/// Bytes with a pattern of their own per (a, b).
fn pattern(a: usize, b: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (a * 59 + b * 17 + j * 3 + 1) as u8).collect()
}

fn ok(r: Result<()>, what: impl std::fmt::Display) {
    if let Err(e) = r {
        panic!("{what}: {}", e.message);
    }
}

/// Element counts: empty, one, fewer than the ranks, odd, either side of
/// 64 bytes, and many segments.
const COUNTS: [usize; 12] = [0, 1, 2, 3, 7, 8, 9, 16, 17, 64, 257, 1000];

#[test]
fn all_reduce_on_both_paths_matches_arithmetic() {
    for world in 1..=5 {
        for (path, small) in PATHS.into_iter().chain([("up to 64 bytes direct", 64)]) {
            let out = on_ranks(world, small, |rk| {
                let mut got = Vec::new();
                for n in COUNTS {
                    for (salt, red) in REDS.into_iter().enumerate() {
                        let mut b = Buf::of(red.dtype, &values(rk.rank(), n, salt));
                        let before = rk.t.sent();
                        ok(rk.run(Collective::AllReduce { buf: b.raw(), red: red.reduction() }), "all_reduce");
                        got.push((n, salt, red, b, rk.t.sent() - before));
                    }
                }
                got
            });
            // The direct exchange sends at most a fingerprint and the data
            // to every peer; the ring a segment per step and more.
            let exchange = 2 * (world as u64 - 1);
            for (rank, got) in out.into_iter().enumerate() {
                for (n, salt, red, b, sent) in got {
                    let want: Vec<f64> = (0..n).map(|i| red.combine((0..world).map(|r| value(r, i, salt)))).collect();
                    let at = format!("world {world}, {path}, rank {rank}, {n} x {red:?}");
                    assert_eq!(b, Buf::of(red.dtype, &want), "{at}");
                    if n * red.dtype.size() <= small {
                        assert!(sent <= exchange, "{at}: sent {sent}, not the direct path");
                    } else if world > 1 {
                        assert!(sent > exchange, "{at}: sent {sent}, not the ring");
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_to_every_root_leaves_the_other_ranks_buffers_alone() {
    for world in 1..=5 {
        for root in 0..world {
            let out = on_ranks(world, RING, |rk| {
                let mut got = Vec::new();
                for n in [0, 1, 7, 257] {
                    for (salt, red) in REDS.into_iter().enumerate() {
                        let mut b = Buf::of(red.dtype, &values(rk.rank(), n, salt));
                        ok(rk.run(Collective::Reduce { buf: b.raw(), root, red: red.reduction() }), "reduce");
                        got.push((n, salt, red, b));
                    }
                }
                got
            });
            for (rank, got) in out.into_iter().enumerate() {
                for (n, salt, red, b) in got {
                    let want = if rank == root {
                        (0..n).map(|i| red.combine((0..world).map(|r| value(r, i, salt)))).collect()
                    } else {
                        values(rank, n, salt)
                    };
                    assert_eq!(b, Buf::of(red.dtype, &want), "world {world}, root {root}, rank {rank}, {n} x {red:?}");
                }
            }
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    for world in 1..=5 {
        for root in 0..world {
            let out = on_ranks(world, RING, |rk| {
                [0, 1, 63, 64, 65, 1000]
                    .map(|len| {
                        let mut b = if rk.rank() == root {
                            Buf::bytes_of(&pattern(root, len, len))
                        } else {
                            Buf::filled(len, 0xEE)
                        };
                        ok(rk.run(Collective::Broadcast { buf: b.raw(), root }), "broadcast");
                        (len, b)
                    })
                    .to_vec()
            });
            for (rank, got) in out.into_iter().enumerate() {
                for (len, b) in got {
                    assert_eq!(
                        b.bytes(),
                        pattern(root, len, len),
                        "world {world}, root {root}, rank {rank}, {len} bytes"
                    );
                }
            }
        }
    }
}

#[test]
fn all_gather_with_blocks_of_different_sizes() {
    let sizes: [fn(usize) -> usize; 5] =
        [|_| 0, |r| r, |r| 64 * r + 1, |r| (37 * r + 3) % 101, |r| if r % 2 == 0 { 0 } else { 130 }];
    for world in 1..=5 {
        let out = on_ranks(world, RING, |rk| {
            let r = rk.rank();
            sizes
                .map(|len| {
                    let mut input = Buf::bytes_of(&pattern(r, 0, len(r)));
                    let mut outputs: Vec<Buf> = (0..world).map(|p| Buf::filled(len(p), 0xEE)).collect();
                    let part = Collective::AllGather { input: input.raw(), outputs: raws(&mut outputs) };
                    ok(rk.run(part), "all_gather");
                    (input, outputs)
                })
                .to_vec()
        });
        for (rank, got) in out.into_iter().enumerate() {
            for ((input, outputs), len) in got.into_iter().zip(sizes) {
                assert_eq!(input.bytes(), pattern(rank, 0, len(rank)), "world {world}: rank {rank}'s input changed");
                for (p, b) in outputs.iter().enumerate() {
                    assert_eq!(b.bytes(), pattern(p, 0, len(p)), "world {world}, rank {rank}, block {p}");
                }
            }
        }
    }
}

#[test]
fn gather_and_scatter_with_every_root() {
    for world in 1..=5 {
        for root in 0..world {
            let out = on_ranks(world, RING, |rk| {
                let r = rk.rank();
                let at_root = |n: usize| if r == root { n } else { 0 };
                [0, 1, 65, 300]
                    .map(|len| {
                        let mut input = Buf::bytes_of(&pattern(r, len, len));
                        let mut gathered: Vec<Buf> = (0..at_root(world)).map(|_| Buf::filled(len, 0xEE)).collect();
                        let part = Collective::Gather { input: input.raw(), outputs: raws(&mut gathered), root };
                        ok(rk.run(part), "gather");
                        let mut blocks: Vec<Buf> =
                            (0..at_root(world)).map(|p| Buf::bytes_of(&pattern(p, 7, len))).collect();
                        let mut output = Buf::filled(len, 0xEE);
                        let part = Collective::Scatter { inputs: raws(&mut blocks), output: output.raw(), root };
                        ok(rk.run(part), "scatter");
                        (len, gathered, output)
                    })
                    .to_vec()
            });
            for (rank, got) in out.into_iter().enumerate() {
                for (len, gathered, output) in got {
                    let at = format!("world {world}, root {root}, rank {rank}, {len} bytes");
                    assert_eq!(gathered.len(), if rank == root { world } else { 0 });
                    for (p, b) in gathered.iter().enumerate() {
                        assert_eq!(b.bytes(), pattern(p, len, len), "{at}: gathered block {p}");
                    }
                    assert_eq!(output.bytes(), pattern(rank, 7, len), "{at}: scattered block");
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_matches_arithmetic_and_keeps_the_inputs() {
    // Rank r's contribution to block c, element i.
    let contribution = |r: usize, c: usize, i: usize, salt: usize| value(r, i + 1000 * c, salt);
    for world in 1..=5 {
        let out = on_ranks(world, RING, |rk| {
            let r = rk.rank();
            let mut got = Vec::new();
            for n in [0, 1, 7, 65] {
                for (salt, red) in REDS.into_iter().enumerate() {
                    let block = |c: usize| (0..n).map(|i| contribution(r, c, i, salt)).collect::<Vec<_>>();
                    let mut inputs: Vec<Buf> = (0..world).map(|c| Buf::of(red.dtype, &block(c))).collect();
                    let kept = inputs.clone();
                    let mut output = Buf::of(red.dtype, &vec![-7.0; n]);
                    let part = Collective::ReduceScatter {
                        inputs: raws(&mut inputs),
                        output: output.raw(),
                        red: red.reduction(),
                    };
                    ok(rk.run(part), "reduce_scatter");
                    assert_eq!(inputs, kept, "world {world}, rank {r}, {n} x {red:?}: inputs changed");
                    got.push((n, salt, red, output));
                }
            }
            got
        });
        for (rank, got) in out.into_iter().enumerate() {
            for (n, salt, red, output) in got {
                let want: Vec<f64> =
                    (0..n).map(|i| red.combine((0..world).map(|k| contribution(k, rank, i, salt)))).collect();
                assert_eq!(output, Buf::of(red.dtype, &want), "world {world}, rank {rank}, {n} x {red:?}");
            }
        }
    }
}

#[test]
fn all_to_all_with_uneven_blocks() {
    for world in 1..=5 {
        for scale in [1, 13, 70] {
            // Bytes from rank p to rank q: a few blocks empty (2 to 1 and 3),
            // none to itself, most of a size of their own.
            let len = |p: usize, q: usize| ((p * 7 + q * 3 + 1) % 6) * scale;
            let out = on_ranks(world, RING, |rk| {
                let r = rk.rank();
                let mut inputs: Vec<Buf> = (0..world).map(|q| Buf::bytes_of(&pattern(r, q, len(r, q)))).collect();
                let mut outputs: Vec<Buf> = (0..world).map(|p| Buf::filled(len(p, r), 0xEE)).collect();
                let part = Collective::AllToAll { inputs: raws(&mut inputs), outputs: raws(&mut outputs) };
                ok(rk.run(part), "all_to_all");
                outputs
            });
            for (q, outputs) in out.into_iter().enumerate() {
                for (p, b) in outputs.iter().enumerate() {
                    assert_eq!(
                        b.bytes(),
                        pattern(p, q, len(p, q)),
                        "world {world}, x{scale}: rank {q}'s block from {p}"
                    );
                }
            }
        }
    }
}

#[test]
fn barrier_waits_for_the_last_rank_on_both_paths() {
    for world in 1..=5 {
        for (path, small) in PATHS {
            let arrived = Mutex::new(None::<Instant>);
            let out = on_ranks(world, small, |rk| {
                let late = rk.rank() == world - 1;
                if late {
                    std::thread::sleep(Duration::from_millis(50));
                    *arrived.lock().unwrap() = Some(Instant::now());
                }
                ok(rk.run(Collective::Barrier), "barrier");
                *arrived.lock().unwrap()
            });
            for (rank, seen) in out.into_iter().enumerate() {
                assert!(seen.is_some(), "world {world}, {path}: rank {rank} left before the last rank arrived");
            }
        }
    }
}

/// Byte counts that differ, or ops that differ, between one rank and the
/// others: every rank fails promptly naming the mismatch (the ranks that do
/// not see it themselves learn it from the abort), and no buffer changes.
/// The ring only with up to 3 ranks: there every rank that passes its check
/// has a left neighbour that fails it (see the ignored test below).
#[test]
fn mismatched_calls_fail_on_every_rank_and_touch_no_buffer() {
    for world in 2..=5 {
        for (path, small) in PATHS.into_iter().filter(|&(path, _)| path == "direct" || world <= 3) {
            for odd in 0..world {
                for case in ["byte count", "op"] {
                    let t0 = Instant::now();
                    let out = on_ranks(world, small, |rk| {
                        let r = rk.rank();
                        let n = if case == "byte count" && r == odd { 9 } else { 8 };
                        let mut b = Buf::of(DType::I64, &values(r, n, 0));
                        let kept = b.clone();
                        let red = Reduction::new(DType::I64, ReduceOp::Sum);
                        let part = if case == "op" && r == odd {
                            Collective::Reduce { buf: b.raw(), root: 0, red }
                        } else {
                            Collective::AllReduce { buf: b.raw(), red }
                        };
                        (rk.run(part), b == kept)
                    });
                    let at = format!("world {world}, {path}, rank {odd} differs in {case}");
                    assert!(t0.elapsed() < PROMPT, "{at}: took {:?}", t0.elapsed());
                    for (rank, (r, untouched)) in out.into_iter().enumerate() {
                        let e = r.expect_err(&format!("{at}: rank {rank} completed"));
                        assert!(e.message.contains("does not match"), "{at}: rank {rank}: {}", e.message);
                        assert!(untouched, "{at}: rank {rank}'s buffer changed");
                    }
                }
            }
        }
    }
}

/// Why the test above leaves out the ring with 4 or more ranks: ranks 1 and
/// 2 agree with their left neighbours, so they start; rank 2 folds rank 1's
/// chunk into its buffer before rank 3 (late, and different) is checked by
/// rank 0 and itself. The op fails everywhere, but a buffer has changed.
#[test]
#[ignore = "documents a gap: on the ring, W >= 4, a mismatch changes buffers of ranks that passed their check"]
fn ring_mismatch_far_from_a_rank_leaves_its_buffer_alone() {
    let out = on_ranks(4, RING, |rk| {
        let r = rk.rank();
        if r == 3 {
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut b = Buf::of(DType::I64, &values(r, if r == 3 { 9 } else { 8 }, 0));
        let kept = b.clone();
        let res = rk.run(Collective::AllReduce { buf: b.raw(), red: Reduction::new(DType::I64, ReduceOp::Sum) });
        (res.is_err(), b == kept)
    });
    for (rank, (failed, untouched)) in out.into_iter().enumerate() {
        assert!(failed, "rank {rank} completed");
        assert!(untouched, "rank {rank}'s buffer changed");
    }
}

/// The link between rank 0 and the last rank is cut while the others are in
/// a large ring all-reduce (the last rank joins only after the cut): every
/// rank's op fails within moments, not at its timeout. The two ends of the
/// cut name each other; the others learn of it from the aborts, whose
/// reasons name the lost rank.
#[test]
fn a_cut_link_during_an_op_fails_every_rank_promptly_naming_the_lost_peer() {
    for world in 2..=5 {
        let net = FakeNet::new(world);
        let victim = world - 1;
        let (joined, join) = std::sync::mpsc::channel::<()>();
        let join = Mutex::new(join);
        let out = std::thread::scope(|s| {
            let ops = s.spawn(|| {
                on_net(&net, RING, |rk| {
                    if rk.rank() == victim {
                        join.lock().unwrap().recv_timeout(TIMEOUT).expect("the cut");
                    }
                    let mut b = Buf::of(DType::F32, &values(rk.rank(), 4096, 0));
                    let t0 = Instant::now();
                    let r =
                        rk.run(Collective::AllReduce { buf: b.raw(), red: Reduction::new(DType::F32, ReduceOp::Sum) });
                    (r, t0.elapsed())
                })
            });
            std::thread::sleep(Duration::from_millis(50));
            net[0].break_peer(victim, &Error::peer_lost("the test cut the cable"));
            joined.send(()).unwrap();
            ops.join().unwrap()
        });
        for (rank, (r, took)) in out.into_iter().enumerate() {
            let e = r.expect_err(&format!("world {world}: rank {rank} completed"));
            let lost = if rank == victim { 0 } else { victim };
            let at = format!("world {world}, rank {rank}: {}", e.message);
            assert!(e.message.contains(&format!("rank {lost} (fake)")), "{at}");
            assert!(e.kind != ErrorKind::Timeout && took < PROMPT, "{at} (after {took:?})");
        }
    }
}

// The fake itself: what the tests above rely on.

fn posted(t: &FakeTransport, peer: usize, key: Key, buf: &mut [u8], fold: Option<Fold>) -> Arc<Status> {
    let status = Status::new();
    unsafe { t.recv(peer, key, buf.as_mut_ptr(), buf.len(), fold, status.clone()).unwrap() };
    status
}

fn send(t: &FakeTransport, peer: usize, key: Key, data: &[u8]) -> Result<Arc<Status>> {
    let status = Status::new();
    let far = Instant::now() + TIMEOUT;
    unsafe { t.send(peer, key, data.as_ptr(), data.len(), status.clone(), far, None) }.map(|()| status)
}

fn result(s: &Status) -> Result<i64> {
    s.result().expect("finished")
}

#[test]
fn fake_delivers_as_a_connection_does() {
    let net = FakeNet::new(3);
    let (a, b) = (&net[0], &net[1]);
    let k = Key::collective(1, 0);
    // Posted, then sent: filled, and the send finishes with its length.
    let mut buf = [0u8; 3];
    let r = posted(b, 0, k, &mut buf, None);
    assert!(!r.is_done());
    assert_eq!(result(&send(a, 1, k, &[1, 2, 3]).unwrap()).unwrap(), 3);
    assert_eq!((result(&r).unwrap(), buf), (3, [1, 2, 3]));
    // Sent, then posted: kept early; the same key matches in order.
    send(a, 1, k, &[4]).unwrap();
    send(a, 1, k, &[5]).unwrap();
    let (mut x, mut y) = ([0u8], [0u8]);
    assert!(posted(b, 2, k, &mut x, None).result().is_none(), "nothing came from rank 2");
    posted(b, 0, k, &mut y, None);
    assert_eq!(y, [4]);
    // Folded into what the buffer holds, whether posted before or after.
    let add = Fold { unit: 1, f: Arc::new(|d: &mut [u8], s: &[u8]| d.iter_mut().zip(s).for_each(|(d, s)| *d += s)) };
    let mut acc = [10u8, 20];
    let r = posted(b, 0, Key::p2p(7), &mut acc, Some(add.clone()));
    send(a, 1, Key::p2p(7), &[1, 2]).unwrap();
    assert!(result(&r).is_ok());
    assert_eq!(acc, [11, 22]);
    // A receive of another size fails with the mailbox's error.
    let mut four = [0u8; 4];
    let r = posted(b, 0, Key::p2p(8), &mut four, None);
    send(a, 1, Key::p2p(8), &[1, 2]).unwrap();
    assert!(result(&r).unwrap_err().message.contains("size mismatch"));
    // Any source: the sender's rank.
    let mut any = [0u8; 2];
    let s = Status::new();
    unsafe { b.recv_any(Key::p2p(9), any.as_mut_ptr(), 2, s.clone()).unwrap() };
    send(&net[2], 1, Key::p2p(9), &[8, 9]).unwrap();
    assert_eq!((result(&s).unwrap(), any), (2, [8, 9]));
    // Withdrawn receives get nothing.
    let mut c = [0u8; 1];
    let r = posted(b, 0, Key::p2p(10), &mut c, None);
    assert!(b.cancel_recv(0, Key::p2p(10), &r) && !b.cancel_recv(0, Key::p2p(10), &r));
    // `ready` runs before the bytes are read; its error fails that send alone.
    let data = Arc::new(Mutex::new([0u8; 2]));
    let filled = data.clone();
    let ready: rustc10d::transport::Ready = Box::new(move || {
        *filled.lock().unwrap() = [6, 7];
        Ok(())
    });
    let mut got = [0u8; 2];
    let r = posted(b, 0, Key::p2p(11), &mut got, None);
    let ptr = data.lock().unwrap().as_ptr();
    unsafe { a.send(1, Key::p2p(11), ptr, 2, Status::new(), Instant::now(), Some(ready)).unwrap() };
    assert_eq!((result(&r).unwrap(), got), (2, [6, 7]));
    let s = Status::new();
    let fails: rustc10d::transport::Ready = Box::new(|| Err(Error::io("no bytes")));
    unsafe { a.send(1, Key::p2p(12), ptr, 2, s.clone(), Instant::now(), Some(fails)).unwrap() };
    assert_eq!(result(&s).unwrap_err().message, "no bytes");
    assert_eq!((a.describe_peer(2), a.link_kind(1), a.link_kind(0)), ("rank 2 (fake)".into(), Some("fake"), None));
}

#[test]
fn fake_break_peer_fails_both_sides_naming_the_peer() {
    let net = FakeNet::new(3);
    let k = Key::collective(0, 0);
    let (mut x, mut y, mut z) = ([0u8; 1], [0u8; 1], [0u8; 1]);
    let at0 = posted(&net[0], 1, k, &mut x, None);
    let at1 = posted(&net[1], 0, k, &mut y, None);
    send(&net[1], 0, Key::p2p(1), &[5]).unwrap();
    net[0].break_peer(1, &Error::peer_lost("cut"));
    // Pending receives on both sides fail, naming the other side.
    assert_eq!(result(&at0).unwrap_err().message, "lost connection to rank 1 (fake): cut");
    assert_eq!(result(&at1).unwrap_err().message, "rank 0 (fake) closed its connection");
    // Later ones too, and sends both ways; what landed before still counts.
    assert!(result(&posted(&net[1], 0, k, &mut y, None)).unwrap_err().message.contains("rank 0 (fake)"));
    let refused = |from: usize, to: usize| send(&net[from], to, k, &[1]).err().map(|e| e.message);
    assert!(refused(0, 1).expect("refused").contains("rank 1 (fake)"));
    assert!(refused(1, 0).expect("refused").contains("rank 0 (fake)"));
    assert!(result(&posted(&net[0], 1, Key::p2p(1), &mut z, None)).is_ok() && z == [5]);
    // Other links are not cut; abort_all tells every peer why.
    assert!(send(&net[2], 0, k, &[1]).is_ok());
    let at2 = posted(&net[2], 1, k, &mut z, None);
    net[1].abort_all(&Error::io("rank 1's op failed"));
    assert_eq!(result(&at2).unwrap_err().message, "rank 1 (fake) gave up on the group: rank 1's op failed");
    // Shutdown closes what is left, for good.
    let at0 = posted(&net[0], 2, Key::p2p(2), &mut x, None);
    net[2].shutdown();
    net[2].shutdown();
    assert_eq!(result(&at0).unwrap_err().message, "rank 2 (fake) closed its connection");
    assert!(send(&net[2], 0, k, &[1]).err().expect("refused").message.contains("shut down"));
}
