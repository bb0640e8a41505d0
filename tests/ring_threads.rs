//! The core end to end without torch: W ranks as threads of one process,
//! rendezvous through an in-memory Store, real TCP sockets on loopback or
//! real shared-memory segments (threads of one process share a host too).

use rustc10d::algorithms::RawBuf;
use rustc10d::config::{Config, TransportMode};
use rustc10d::dtype::{DType, ReduceOp};
use rustc10d::engine::{Device, Engine, Event, OpHandle, StagedBuffer, Staging, Waited};
use rustc10d::error::Error;
use rustc10d::fault::Faults;
use rustc10d::ops::{Collective, OpKind, Reduction};
use rustc10d::rendezvous::{connect, MemStore, Member, Store};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BOTH: [TransportMode; 2] = [TransportMode::Tcp, TransportMode::Shm];

fn group(world: usize, timeout: Duration) -> Vec<Engine> {
    group_via(TransportMode::Auto, world, timeout)
}

fn group_via(transport: TransportMode, world: usize, timeout: Duration) -> Vec<Engine> {
    group_with(world, timeout, Config { transport, ..Config::default() })
}

/// Small segments, so that modest buffers take many pipelined steps.
fn group_segmented(transport: TransportMode, world: usize) -> Vec<Engine> {
    group_with(world, Duration::from_secs(10), Config { transport, segment_bytes: 64, ..Config::default() })
}

/// `faults` in RUSTC10D_FAULT's grammar.
fn group_with_faults(world: usize, timeout: Duration, faults: &'static str) -> Vec<Engine> {
    group_with(world, timeout, Config { faults: Arc::new(Faults::parse(faults).unwrap()), ..Config::default() })
}

fn group_with(world: usize, timeout: Duration, cfg: Config) -> Vec<Engine> {
    group_on(Arc::new(MemStore::default()), world, timeout, "127.0.0.1", cfg)
}

fn member(rank: usize, size: usize, timeout: Duration, host: &str) -> Member {
    Member { rank, size, timeout, store_host: Some(host.into()) }
}

/// W ranks as threads rendezvousing through `store`, advertising the route to `host`.
fn group_on(store: Arc<MemStore>, world: usize, timeout: Duration, host: &'static str, cfg: Config) -> Vec<Engine> {
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, cfg) = (store.clone(), cfg.clone());
            std::thread::spawn(move || {
                let mesh = Arc::new(connect(&*store, &member(rank, world, timeout, host), &cfg).unwrap());
                Engine::new(mesh, &cfg, timeout).unwrap()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Run `f(rank, engine)` on every rank at once.
fn on_all<T: Send>(engines: &[Engine], f: impl Fn(usize, &Engine) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = engines
            .iter()
            .enumerate()
            .map(|(r, e)| {
                let f = &f;
                s.spawn(move || f(r, e))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn raw<T>(v: &mut [T]) -> RawBuf {
    RawBuf { ptr: v.as_mut_ptr().cast(), len: std::mem::size_of_val(v) }
}

fn noop() -> rustc10d::status::Callback {
    Box::new(|_| {})
}

fn wait_ok(h: OpHandle) {
    assert_eq!(h.wait(None), Waited::Done);
}

fn run(e: &Engine, part: Collective) -> OpHandle {
    unsafe { e.submit(vec![part], None, None, noop()).unwrap() }
}

fn all_reduce(e: &Engine, buf: RawBuf, dtype: DType, op: ReduceOp) -> OpHandle {
    run(e, Collective::AllReduce { buf, red: Reduction::new(dtype, op) })
}

fn allreduce_matches_arithmetic_for_many_sizes_and_worlds_on(mode: TransportMode) {
    for world in [2, 3, 4] {
        let engines = group_segmented(mode, world);
        for n in [0usize, 1, world - 1, 7, 1001, 4096] {
            let results = on_all(&engines, |rank, e| {
                let mut v: Vec<i64> = (0..n as i64).map(|i| i * 10 + rank as i64).collect();
                wait_ok(all_reduce(e, raw(&mut v), DType::I64, ReduceOp::Sum));
                let mut m: Vec<f32> = (0..n).map(|i| ((i + rank) % 5) as f32).collect();
                wait_ok(all_reduce(e, raw(&mut m), DType::F32, ReduceOp::Max));
                (v, m)
            });
            let w = world as i64;
            for (v, m) in results {
                let want: Vec<i64> = (0..n as i64).map(|i| i * 10 * w + w * (w - 1) / 2).collect();
                assert_eq!(v, want, "sum world={world} n={n}");
                let want: Vec<f32> =
                    (0..n).map(|i| (0..world).map(|r| ((i + r) % 5) as f32).fold(0.0, f32::max)).collect();
                assert_eq!(m, want, "max world={world} n={n}");
            }
        }
    }
}

#[test]
fn allreduce_matches_arithmetic_for_many_sizes_and_worlds() {
    BOTH.into_iter().for_each(allreduce_matches_arithmetic_for_many_sizes_and_worlds_on);
}

#[test]
fn avg_broadcast_barrier_and_many_in_flight() {
    let engines = group(3, Duration::from_secs(10));
    let out = on_all(&engines, |rank, e| {
        let mut avg = vec![rank as f64 * 3.0; 5];
        let h1 = all_reduce(e, raw(&mut avg), DType::F64, ReduceOp::Avg);
        let mut b = if rank == 2 { vec![7u8, 8, 9] } else { vec![0u8; 3] };
        let h2 = run(e, Collective::Broadcast { buf: raw(&mut b), root: 2 });
        let mut many: Vec<Vec<i32>> = (0..8).map(|k| vec![k + rank as i32; 33]).collect();
        let hs: Vec<_> = many.iter_mut().map(|v| all_reduce(e, raw(v), DType::I32, ReduceOp::Sum)).collect();
        wait_ok(run(e, Collective::Barrier));
        for h in [h1, h2].into_iter().chain(hs) {
            assert!(h.is_done(), "ops issued before a barrier are done when it is");
            wait_ok(h);
        }
        (avg, b, many)
    });
    for (avg, b, many) in out {
        assert_eq!(avg, vec![3.0; 5]);
        assert_eq!(b, vec![7, 8, 9]);
        for (k, v) in many.iter().enumerate() {
            assert_eq!(v, &vec![3 * k as i32 + 3; 33]);
        }
    }
}

fn p2p_in_any_order_and_recv_timeout_on(mode: TransportMode) {
    let engines = group_via(mode, 2, Duration::from_secs(10));
    on_all(&engines, |rank, e| {
        let peer = 1 - rank;
        let mut inbox = vec![vec![0u32; 4]; 3];
        let mut outbox: Vec<Vec<u32>> = (0..3).map(|t| vec![rank as u32 * 100 + t; 4]).collect();
        let order: [usize; 3] = if rank == 0 { [2, 0, 1] } else { [1, 2, 0] };
        let recvs: Vec<_> = order
            .iter()
            .map(|&t| unsafe { e.recv(raw(&mut inbox[t]), Some(peer), t as i64, None, noop()).unwrap() })
            .collect();
        let sends: Vec<_> = [0usize, 1, 2]
            .iter()
            .rev()
            .map(|&t| unsafe { e.send(raw(&mut outbox[t]), peer, t as i64, None, None, noop()).unwrap() })
            .collect();
        for h in recvs.into_iter().chain(sends) {
            wait_ok(h);
        }
        for (t, got) in inbox.iter().enumerate() {
            assert_eq!(got, &vec![peer as u32 * 100 + t as u32; 4]);
        }

        let mut never = vec![0u8; 4];
        let h = unsafe { e.recv(raw(&mut never), Some(peer), 999, Some(Duration::from_millis(300)), noop()).unwrap() };
        assert!(!h.is_done());
        assert_eq!(h.wait(Some(Duration::from_millis(50))), Waited::TimedOut, "caller timeout leaves the op running");
        let t0 = Instant::now();
        match h.wait(None) {
            Waited::Failed(Error { message: msg, .. }) => {
                assert!(msg.contains("Timed out after 300 ms") && msg.contains("tag 999"), "{msg}")
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(2));
    });
}

#[test]
fn p2p_in_any_order_and_recv_timeout() {
    BOTH.into_iter().for_each(p2p_in_any_order_and_recv_timeout_on);
}

fn lost_peer_fails_pending_ops_fast_and_breaks_the_group_on(mode: TransportMode) {
    let mut engines = group_via(mode, 3, Duration::from_secs(20));
    let dead = engines.pop().unwrap();
    let t0 = Instant::now();
    let handles = on_all(&engines, |_, e| {
        let mut v = vec![1.0f32; 1000];
        let h = all_reduce(e, raw(&mut v), DType::F32, ReduceOp::Sum);
        (h, v)
    });
    std::thread::sleep(Duration::from_millis(100));
    drop(dead);
    for (h, _v) in &handles {
        match h.wait(None) {
            Waited::Failed(Error { message: msg, .. }) => {
                assert!(msg.contains("rank 2") || msg.contains("rank 0") || msg.contains("rank 1"), "{msg}")
            }
            other => panic!("expected failure, got {other:?}"),
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "failure must not wait for the full timeout");
    let mut v = vec![1.0f32; 4];
    let h = all_reduce(&engines[0], raw(&mut v), DType::F32, ReduceOp::Sum);
    match h.wait(None) {
        Waited::Failed(Error { message: msg, .. }) => assert!(msg.contains("broken"), "{msg}"),
        other => panic!("expected broken group, got {other:?}"),
    }
}

#[test]
fn lost_peer_fails_pending_ops_fast_and_breaks_the_group() {
    BOTH.into_iter().for_each(lost_peer_fails_pending_ops_fast_and_breaks_the_group_on);
}

#[test]
fn empty_tensors_without_storage() {
    let engines = group(2, Duration::from_secs(5));
    on_all(&engines, |rank, e| {
        let empty = || RawBuf::new(std::ptr::null_mut(), 0);
        wait_ok(all_reduce(e, empty(), DType::F32, ReduceOp::Sum));
        wait_ok(run(e, Collective::Broadcast { buf: empty(), root: 1 }));
        let h = if rank == 0 {
            unsafe { e.send(empty(), 1, 3, None, None, noop()).unwrap() }
        } else {
            unsafe { e.recv(empty(), Some(0), 3, None, noop()).unwrap() }
        };
        wait_ok(h);
    });
}

#[test]
fn bad_input_is_refused_before_the_wire() {
    let engines = group(2, Duration::from_secs(5));
    let e = &engines[0];
    let mut v = vec![1.0f32; 3];
    let bad = |part| unsafe { e.submit(vec![part], None, None, noop()) }.is_err();
    assert!(bad(Collective::AllReduce { buf: raw(&mut v), red: Reduction::new(DType::F32, ReduceOp::BXor) }));
    assert!(bad(Collective::Broadcast { buf: raw(&mut v), root: 5 }));
    assert!(bad(Collective::AllGather { input: raw(&mut v), outputs: vec![raw(&mut v)] }), "one output per rank");
    let mut short = vec![0f32; 2];
    assert!(
        bad(Collective::AllGather { input: raw(&mut v), outputs: vec![raw(&mut short), raw(&mut v)] }),
        "own block must fit"
    );
    assert!(unsafe { e.send(raw(&mut v), 0, 0, None, None, noop()) }.is_err(), "send to self");
    assert!(unsafe { e.recv(raw(&mut v), Some(7), 0, None, noop()) }.is_err());
    // Still usable.
    on_all(&engines, |_, e| {
        let mut v = vec![2i16; 3];
        wait_ok(all_reduce(e, raw(&mut v), DType::I16, ReduceOp::Product));
        assert_eq!(v, vec![4; 3]);
    });
}

#[test]
fn init_without_peer_times_out_naming_it() {
    let store = MemStore::default();
    let cfg = Config { transport: TransportMode::Tcp, ..Config::default() };
    let t0 = Instant::now();
    let err = connect(&store, &member(0, 2, Duration::from_millis(500), "127.0.0.1"), &cfg).err().expect("no peer");
    assert!(err.message.contains("rank 1"), "{}", err.message);
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[test]
fn init_with_unreachable_peer_names_its_address() {
    let store = MemStore::default();
    // Rank 1 "published" an address where nothing listens (first incarnation: generation 0).
    let cfg = Config { transport: TransportMode::Tcp, ..Config::default() };
    let published =
        format!("v{} 127.0.0.1:1 elsewhere - {}", rustc10d::transport::frame::PROTOCOL_VERSION, cfg.shared());
    store.set("rustc10d/0/addr/1", published.as_bytes()).unwrap();
    let t0 = Instant::now();
    let member = member(0, 2, Duration::from_millis(800), "127.0.0.1");
    let err = connect(&store, &member, &cfg).err().expect("unreachable peer: must fail");
    assert!(err.message.contains("rank 1 (127.0.0.1:1)"), "{}", err.message);
    assert!(t0.elapsed() < Duration::from_secs(3));
}

fn data_movement_collectives_on(mode: TransportMode) {
    for world in [2usize, 3, 4] {
        let engines = group_segmented(mode, world);
        let n = 37usize; // several segments of 64 bytes
        let out = on_all(&engines, |rank, e| {
            let mut input: Vec<u32> = (0..n as u32).map(|i| i + 1000 * rank as u32).collect();
            // all-gather into one buffer
            let mut gathered = vec![0u32; n * world];
            let slots: Vec<RawBuf> = gathered.chunks_mut(n).map(raw).collect();
            wait_ok(run(e, Collective::AllGather { input: raw(&mut input), outputs: slots }));
            // gather to the last rank, scatter from rank 0
            let root = world - 1;
            let mut at_root = vec![0u32; if rank == root { n * world } else { 0 }];
            let outs: Vec<RawBuf> = at_root.chunks_mut(n.max(1)).map(raw).collect();
            wait_ok(run(e, Collective::Gather { input: raw(&mut input), outputs: outs, root }));
            let mut pieces: Vec<Vec<u32>> = (0..world).map(|p| vec![p as u32 * 7; 5]).collect();
            let ins: Vec<RawBuf> = if rank == 0 { pieces.iter_mut().map(|v| raw(v)).collect() } else { vec![] };
            let mut mine = vec![0u32; 5];
            wait_ok(run(e, Collective::Scatter { inputs: ins, output: raw(&mut mine), root: 0 }));
            // all-to-all with uneven (and zero) blocks: rank r sends r + p elements to p
            let mut send: Vec<Vec<u16>> = (0..world).map(|p| vec![(rank * 10 + p) as u16; rank + p]).collect();
            let mut recv: Vec<Vec<u16>> = (0..world).map(|p| vec![0u16; p + rank]).collect();
            let (si, ro): (Vec<RawBuf>, Vec<RawBuf>) =
                (send.iter_mut().map(|v| raw(v)).collect(), recv.iter_mut().map(|v| raw(v)).collect());
            wait_ok(run(e, Collective::AllToAll { inputs: si, outputs: ro }));
            (gathered, at_root, mine, recv)
        });
        for (rank, (gathered, at_root, mine, recv)) in out.into_iter().enumerate() {
            let want: Vec<u32> = (0..world as u32).flat_map(|r| (0..n as u32).map(move |i| i + 1000 * r)).collect();
            assert_eq!(gathered, want, "allgather world={world}");
            if rank == world - 1 {
                assert_eq!(at_root, want, "gather world={world}");
            }
            assert_eq!(mine, vec![rank as u32 * 7; 5], "scatter");
            for (p, v) in recv.iter().enumerate() {
                assert_eq!(v, &vec![(p * 10 + rank) as u16; p + rank], "alltoall from {p} to {rank}");
            }
        }
    }
}

#[test]
fn data_movement_collectives() {
    BOTH.into_iter().for_each(data_movement_collectives_on);
}

fn reducing_collectives_on(mode: TransportMode) {
    for world in [2usize, 3, 4] {
        let engines = group_segmented(mode, world);
        let n = 41usize;
        let out = on_all(&engines, |rank, e| {
            // reduce_scatter: block b of rank r holds b*100 + r + i
            let mut blocks: Vec<Vec<i32>> =
                (0..world).map(|b| (0..n as i32).map(|i| (b * 100 + rank) as i32 + i).collect()).collect();
            let inputs: Vec<RawBuf> = blocks.iter_mut().map(|v| raw(v)).collect();
            let mut mine = vec![0i32; n];
            let red = Reduction::new(DType::I32, ReduceOp::Sum);
            wait_ok(run(e, Collective::ReduceScatter { inputs, output: raw(&mut mine), red }));
            // reduce (MAX) to rank 1; other ranks keep their buffer
            let mut r: Vec<f32> = (0..n).map(|i| (i * (rank + 1)) as f32).collect();
            let before = r.clone();
            wait_ok(run(
                e,
                Collective::Reduce { buf: raw(&mut r), root: 1, red: Reduction::new(DType::F32, ReduceOp::Max) },
            ));
            // PREMUL_SUM allreduce
            let mut p = vec![1.0f64 + rank as f64; 3];
            let red = Reduction { dtype: DType::F64, op: ReduceOp::Sum, premul: Some(0.5) };
            wait_ok(run(e, Collective::AllReduce { buf: raw(&mut p), red }));
            (blocks, mine, r, before, p)
        });
        let w = world as i32;
        for (rank, (blocks, mine, r, before, p)) in out.into_iter().enumerate() {
            let want: Vec<i32> = (0..n as i32).map(|i| w * (rank as i32 * 100 + i) + w * (w - 1) / 2).collect();
            assert_eq!(mine, want, "reduce_scatter world={world} rank={rank}");
            assert_eq!(blocks[0][0], rank as i32, "reduce_scatter leaves inputs alone");
            if rank == 1 {
                assert_eq!(r, (0..n).map(|i| (i * world) as f32).collect::<Vec<_>>(), "reduce");
            } else {
                assert_eq!(r, before, "reduce leaves non-root buffers alone");
            }
            let s: f64 = (0..world).map(|k| 0.5 * (1.0 + k as f64)).sum();
            assert_eq!(p, vec![s; 3], "premul_sum");
        }
    }
}

#[test]
fn reducing_collectives() {
    BOTH.into_iter().for_each(reducing_collectives_on);
}

#[test]
fn monitored_barrier_names_the_missing_rank() {
    let engines = group(3, Duration::from_secs(10));
    let barrier = |wait_all, ms| Collective::MonitoredBarrier { wait_all, timeout: Some(Duration::from_millis(ms)) };
    // Rank 2 arrives long after rank 0 gave up on it; rank 0 tells the others why at once.
    let start = Instant::now();
    let out = on_all(&engines, |rank, e| {
        if rank == 2 {
            std::thread::sleep(Duration::from_millis(800));
        }
        run(e, barrier(true, 300)).wait(None)
    });
    assert!(start.elapsed() < Duration::from_secs(5), "the others waited for their own timeout");
    let failed = |w: &Waited, text: &str| matches!(w, Waited::Failed(Error { message: m, .. }) if m.contains(text));
    assert!(failed(&out[0], "[Rank 0]: Ranks 2 failed to pass monitoredBarrier in 300 ms"), "{:?}", out[0]);
    for (rank, w) in out.iter().enumerate().skip(1) {
        let told = format!("Rank {rank} successfully reached monitoredBarrier, but received errors");
        assert!(failed(w, &told) && failed(w, "rank 0 reported: rustc10d: [Rank 0]: Ranks 2"), "{w:?}");
    }
    // A zero timeout is one, not "unset": rank 0 fails at once, naming nobody.
    let out = on_all(&engines, |_, e| run(e, barrier(false, 0)).wait(None));
    let zero = "Rank 0 timed out in monitoredBarrier after 0 ms.\nNo ranks successfully processed in monitoredBarrier.";
    assert!(failed(&out[0], zero), "{:?}", out[0]);
    // All three enter: passes, and the group was not broken by the failures.
    let out = on_all(&engines, |_, e| run(e, barrier(false, 5000)).wait(None));
    assert!(out.iter().all(|w| *w == Waited::Done), "{out:?}");
}

fn recv_from_any_source_on(mode: TransportMode) {
    let engines = group_via(mode, 3, Duration::from_secs(10));
    on_all(&engines, |rank, e| {
        if rank == 0 {
            let mut got = Vec::new();
            for _ in 0..4 {
                let mut v = [0u32; 2];
                let h = unsafe { e.recv(raw(&mut v), None, 5, None, noop()).unwrap() };
                wait_ok_ref(&h);
                let src = h.source_rank();
                assert_eq!(v, [src as u32 * 11; 2], "data matches the reported source");
                got.push(src);
            }
            got.sort();
            assert_eq!(got, vec![1, 1, 2, 2]);
            let mut v = [0u32; 2];
            let h = unsafe { e.recv(raw(&mut v), None, 6, Some(Duration::from_millis(200)), noop()).unwrap() };
            assert!(matches!(h.wait(None), Waited::Failed(Error { message: m, .. }) if m.contains("any rank")));
        } else {
            let mut v = [rank as u32 * 11; 2];
            for _ in 0..2 {
                wait_ok(unsafe { e.send(raw(&mut v), 0, 5, None, None, noop()).unwrap() });
            }
        }
    });
}

#[test]
fn recv_from_any_source() {
    BOTH.into_iter().for_each(recv_from_any_source_on);
}

fn wait_ok_ref(h: &OpHandle) {
    assert_eq!(h.wait(None), Waited::Done);
}

#[test]
fn allgather_with_blocks_of_different_sizes() {
    let engines = group_segmented(TransportMode::Auto, 3);
    let len = |r: usize| [0usize, 100, 17][r];
    let out = on_all(&engines, |rank, e| {
        let mut input: Vec<u8> = (0..len(rank)).map(|i| (i + rank) as u8).collect();
        let mut outs: Vec<Vec<u8>> = (0..3).map(|r| vec![0u8; len(r)]).collect();
        let slots = outs.iter_mut().map(|v| raw(v)).collect();
        wait_ok(run(e, Collective::AllGather { input: raw(&mut input), outputs: slots }));
        outs
    });
    for outs in out {
        for (r, v) in outs.iter().enumerate() {
            assert_eq!(v, &(0..len(r)).map(|i| (i + r) as u8).collect::<Vec<_>>());
        }
    }
}

fn mismatched_calls_fail_on_every_rank_without_touching_data_on(mode: TransportMode) {
    let engines = group_via(mode, 3, Duration::from_secs(10));
    let t0 = Instant::now();
    let out = on_all(&engines, |rank, e| {
        // Rank 1 reduces int32 where the others reduce float32 (same byte count).
        let dtype = if rank == 1 { DType::I32 } else { DType::F32 };
        let mut v = vec![1.0f32; 8];
        let h = all_reduce(e, raw(&mut v), dtype, ReduceOp::Sum);
        (h.wait(None), v)
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "no waiting for the timeout");
    let mut named = 0;
    for (waited, v) in out {
        assert_eq!(v, vec![1.0f32; 8], "nothing was reduced");
        match waited {
            Waited::Failed(Error { message: msg, .. }) => named += msg.contains("does not match") as usize,
            other => panic!("expected a failure, got {other:?}"),
        }
    }
    assert!(named >= 2, "the neighbours of the odd rank name the mismatch");
}

#[test]
fn mismatched_calls_fail_on_every_rank_without_touching_data() {
    BOTH.into_iter().for_each(mismatched_calls_fail_on_every_rank_without_touching_data_on);
}

/// Small all-reduces check the call alongside their exchange with every peer,
/// so even calls that only differ between non-neighbours (A, A, B, B) fail on
/// every rank, each naming the mismatch, with no buffer touched. A split in
/// size (one rank large enough for the ring, which checks its neighbour only)
/// fails everywhere too.
#[test]
fn small_allreduce_checks_every_peer() {
    fn aabb(r: usize) -> (DType, usize) {
        (if r < 2 { DType::F32 } else { DType::I32 }, 16)
    }
    fn one_large(r: usize) -> (DType, usize) {
        (DType::F32, if r == 2 { 1 << 20 } else { 16 })
    }
    for (case, call) in [aabb as fn(usize) -> (DType, usize), one_large].into_iter().enumerate() {
        let engines = group(4, Duration::from_secs(10));
        let t0 = Instant::now();
        let out = on_all(&engines, |rank, e| {
            let (dtype, len) = call(rank);
            let mut v = vec![1.0f32; len];
            let h = all_reduce(e, raw(&mut v), dtype, ReduceOp::Sum);
            (h.wait(None), v.iter().all(|&x| x == 1.0))
        });
        assert!(t0.elapsed() < Duration::from_secs(5), "case {case}: no waiting for the timeout");
        for (rank, (waited, untouched)) in out.into_iter().enumerate() {
            assert!(untouched, "case {case}: rank {rank}'s buffer was touched");
            match waited {
                Waited::Failed(Error { message: msg, .. }) => {
                    assert!(case == 1 || msg.contains("does not match"), "case {case}: rank {rank}: {msg}")
                }
                other => panic!("case {case}: rank {rank} completed: {other:?}"),
            }
        }
    }
}

#[test]
#[ignore = "timing probe, run by hand: cargo test --release -- --ignored latency"]
fn latency_probe() {
    for mode in BOTH {
        eprintln!("{mode:?}");
        let engines = group_via(mode, 2, Duration::from_secs(10));
        for n in [2usize, 1024, 262144, 4 << 20] {
            let t = on_all(&engines, |_, e| {
                let mut v = vec![1.0f32; n];
                for _ in 0..50 {
                    wait_ok(all_reduce(e, raw(&mut v), DType::F32, ReduceOp::Sum));
                }
                let t0 = Instant::now();
                for _ in 0..500 {
                    wait_ok(all_reduce(e, raw(&mut v), DType::F32, ReduceOp::Sum));
                }
                t0.elapsed() / 500
            });
            eprintln!("allreduce {} B: {:?}", n * 4, t[0]);
        }
    }
}

#[test]
fn the_transport_is_the_one_asked_for() {
    for (mode, want) in [(TransportMode::Tcp, "tcp"), (TransportMode::Shm, "shm"), (TransportMode::Auto, "shm")] {
        let engines = group_via(mode, 3, Duration::from_secs(10));
        on_all(&engines, |_, e| {
            let mut v = vec![1u8; 10];
            wait_ok(all_reduce(e, raw(&mut v), DType::U8, ReduceOp::Sum));
        });
        for (rank, e) in engines.iter().enumerate() {
            assert_eq!(e.link_kind((rank + 1) % 3), Some(want), "{mode:?}");
        }
    }
}

#[test]
fn injected_faults_fail_stall_and_drop() {
    let faults = "rank=1,op=allreduce,seq=2,action=fail; rank=0,op=barrier,action=stall,secs=0.3";
    let engines = group_with_faults(2, Duration::from_secs(10), faults);
    let out = on_all(&engines, |_, e| {
        let t0 = Instant::now();
        wait_ok(run(e, Collective::Barrier));
        let stalled = t0.elapsed();
        let mut v = vec![1i64; 4];
        wait_ok(all_reduce(e, raw(&mut v), DType::I64, ReduceOp::Sum));
        let second = all_reduce(e, raw(&mut v), DType::I64, ReduceOp::Sum).wait(None);
        (stalled, second, e.stats().snapshot())
    });
    for (rank, (stalled, second, stats)) in out.into_iter().enumerate() {
        assert!(stalled >= Duration::from_millis(300), "rank {rank}: the barrier waits for the stalled rank 0");
        match second {
            Waited::Failed(Error { message: msg, .. }) if rank == 1 => assert!(msg.contains("RUSTC10D_FAULT"), "{msg}"),
            Waited::Failed(_) => {}
            other => panic!("rank {rank}: expected failure, got {other:?}"),
        }
        let ar = stats[&OpKind::AllReduce];
        assert_eq!((ar.count, ar.failed, ar.bytes), (2, 1, 64));
        assert_eq!(stats[&OpKind::Barrier].count, 1);
    }
}

#[test]
fn a_group_recreated_over_the_same_store_ignores_the_old_keys() {
    let store = Arc::new(MemStore::default());
    for round in 0..3 {
        let engines = group_on(store.clone(), 2, Duration::from_secs(5), "127.0.0.1", Config::default());
        let sums = on_all(&engines, |rank, e| {
            let mut v = vec![rank as i32 + round; 2];
            wait_ok(all_reduce(e, raw(&mut v), DType::I32, ReduceOp::Sum));
            v
        });
        assert!(sums.iter().all(|v| v == &vec![1 + 2 * round; 2]), "round {round}");
    }
}

#[test]
fn ipv6_group_when_the_store_host_is_ipv6() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("no IPv6 loopback here; skipped");
        return;
    }
    let store = Arc::new(MemStore::default());
    let cfg = Config { transport: TransportMode::Tcp, ..Config::default() };
    let engines = group_on(store.clone(), 2, Duration::from_secs(5), "::1", cfg);
    let addr = String::from_utf8(store.get("rustc10d/0/addr/0", Duration::from_secs(1)).unwrap()).unwrap();
    assert!(addr.contains("[::1]:"), "{addr}");
    let out = on_all(&engines, |rank, e| {
        let mut v = vec![rank as u8 + 1; 3];
        wait_ok(all_reduce(e, raw(&mut v), DType::U8, ReduceOp::Sum));
        v
    });
    assert!(out.iter().all(|v| v == &vec![3u8; 3]));
}

/// Host memory standing in for a device: copies happen at once, and every
/// call is logged.
struct FakeDevice {
    device: RawBuf,
    host: RawBuf,
    log: Arc<Mutex<Vec<String>>>,
}
unsafe impl Send for FakeDevice {}

impl Device for FakeDevice {
    fn to_host(&mut self, _: usize, start: usize, len: usize) -> rustc10d::error::Result<Event> {
        self.log.lock().unwrap().push(format!("in {start}+{len}"));
        unsafe { std::ptr::copy_nonoverlapping(self.device.ptr.add(start), self.host.ptr.add(start), len) };
        Ok(start as Event)
    }
    fn wait(&mut self, event: Event) -> rustc10d::error::Result<()> {
        self.log.lock().unwrap().push(format!("wait {event}"));
        Ok(())
    }
    fn to_device(&mut self, _: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        self.log.lock().unwrap().push(format!("out {start}+{len}"));
        unsafe { std::ptr::copy_nonoverlapping(self.host.ptr.add(start), self.device.ptr.add(start), len) };
        Ok(())
    }
}

/// `host` staged for `device`, in pieces of `piece_bytes`; the log of device calls.
fn staged<T>(device: &mut [T], host: &mut [T], piece_bytes: usize) -> (Staging, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let buffer = StagedBuffer { host: raw(host), copy_in: true, copy_out: true, contiguous: true };
    let device = FakeDevice { device: raw(device), host: raw(host), log: log.clone() };
    (Staging { buffers: vec![buffer], device: Box::new(device), piece_bytes }, log)
}

/// A staged all_reduce or broadcast runs piece by piece: every piece's copy
/// in is queued first, then each piece runs once its copy is done and is
/// copied out right after; the cut is rounded to whole elements, and the
/// "device" ends with the right values although the host buffer started as
/// garbage.
#[test]
fn staged_ops_run_in_pieces() {
    let engines = group(3, Duration::from_secs(10));
    let out = on_all(&engines, |rank, e| {
        let n = 1001; // f64: 8008 bytes, in pieces of 2999 / 8 * 8 = 2992 bytes
        let mut device: Vec<f64> = (0..n).map(|i| (i * 3 + rank) as f64).collect();
        let mut host = vec![f64::NAN; n];
        let (staging, log) = staged(&mut device, &mut host, 2999);
        let part = Collective::AllReduce { buf: raw(&mut host), red: Reduction::new(DType::F64, ReduceOp::Sum) };
        wait_ok(unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() });
        let reduce_log = log.lock().unwrap().clone();

        let mut bdevice: Vec<u8> = if rank == 1 { (0..=255).cycle().take(7000).collect() } else { vec![0; 7000] };
        let mut bhost = vec![0xEEu8; 7000];
        let (staging, blog) = staged(&mut bdevice, &mut bhost, 2999);
        let part = Collective::Broadcast { buf: raw(&mut bhost), root: 1 };
        wait_ok(unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() });
        let bcast_log = blog.lock().unwrap().clone();
        (device, reduce_log, bdevice, bcast_log)
    });
    for (device, reduce_log, bdevice, bcast_log) in out {
        let want: Vec<f64> = (0..1001).map(|i| (i * 9 + 3) as f64).collect();
        assert_eq!(device, want);
        let pieces = |n: usize, len: usize| {
            let ranges: Vec<(usize, usize)> = (0..len).step_by(n).map(|s| (s, n.min(len - s))).collect();
            let ins = ranges.iter().map(|(s, l)| format!("in {s}+{l}"));
            let runs = ranges.iter().flat_map(|(s, l)| [format!("wait {s}"), format!("out {s}+{l}")]);
            ins.chain(runs).collect::<Vec<_>>()
        };
        assert_eq!(reduce_log, pieces(2992, 8008));
        assert_eq!(bdevice, (0..=255).cycle().take(7000).collect::<Vec<u8>>());
        assert_eq!(bcast_log, pieces(2999, 7000));
    }
}

/// Ranks that cut the same all_reduce differently (one stages in pieces, the
/// others do not) would match messages of different pieces: the call check
/// names the difference instead, and no buffer is touched.
#[test]
fn ranks_that_cut_an_op_differently_are_refused() {
    let engines = group(3, Duration::from_secs(10));
    let t0 = Instant::now();
    let out = on_all(&engines, |rank, e| {
        let mut device = vec![1.0f32; 1 << 14];
        let mut host = vec![1.0f32; 1 << 14];
        let (staging, _) = staged(&mut device, &mut host, if rank == 2 { 1 << 12 } else { 0 });
        let part = Collective::AllReduce { buf: raw(&mut host), red: Reduction::new(DType::F32, ReduceOp::Sum) };
        let h = unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() };
        (h.wait(None), device)
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "no waiting for the timeout");
    let mut named = 0;
    for (waited, device) in out {
        assert_eq!(device, vec![1.0f32; 1 << 14], "nothing was copied back");
        match waited {
            Waited::Failed(Error { message: msg, .. }) => {
                named += msg.contains("staged in pieces of 4096 bytes") as usize
            }
            other => panic!("expected a failure, got {other:?}"),
        }
    }
    assert!(named >= 2, "the neighbours of the odd rank name the piece size");
}

/// A send whose bytes are filled by `ready` on the sending thread (a device
/// tensor's copy to the host) neither blocks its caller nor lets a later send
/// to the same peer overtake it; a `ready` that fails fails that send alone.
#[test]
fn send_after_ready_keeps_order_and_fails_alone() {
    for mode in BOTH {
        let engines = group_via(mode, 2, Duration::from_secs(10));
        on_all(&engines, |rank, e| {
            if rank == 0 {
                let mut slow = vec![0u32; 1000];
                let mut fast = vec![2u32; 1000];
                let (slow_buf, t0) = (raw(&mut slow), Instant::now());
                struct Fill(RawBuf);
                unsafe impl Send for Fill {}
                let fill = Fill(slow_buf);
                let ready = Box::new(move || {
                    let fill = fill;
                    std::thread::sleep(Duration::from_millis(100));
                    unsafe { fill.0.slice_mut(0, fill.0.len).copy_from_slice(&[1u8; 4000]) };
                    Ok(())
                });
                let h1 = unsafe { e.send(slow_buf, 1, 7, None, Some(ready), noop()).unwrap() };
                assert!(t0.elapsed() < Duration::from_millis(50), "the caller does not wait for ready");
                let failing = Box::new(|| Err(rustc10d::error::Error::io("no device copy")));
                let mut lost = vec![9u32; 1000];
                let h2 = unsafe { e.send(raw(&mut lost), 1, 7, None, Some(failing), noop()).unwrap() };
                let h3 = unsafe { e.send(raw(&mut fast), 1, 7, None, None, noop()).unwrap() };
                wait_ok(h1);
                match h2.wait(None) {
                    Waited::Failed(Error { message: msg, .. }) => assert!(msg.contains("no device copy"), "{msg}"),
                    other => panic!("a failed ready fails its send: {other:?}"),
                }
                wait_ok(h3);
            } else {
                let (mut a, mut b) = (vec![0u32; 1000], vec![0u32; 1000]);
                wait_ok(unsafe { e.recv(raw(&mut a), Some(0), 7, None, noop()).unwrap() });
                wait_ok(unsafe { e.recv(raw(&mut b), Some(0), 7, None, noop()).unwrap() });
                assert_eq!(a, vec![u32::from_ne_bytes([1; 4]); 1000], "the slow send arrives first, filled");
                assert_eq!(b, vec![2u32; 1000], "then the fast one; the failed one never");
            }
        });
    }
}

/// Many large all-reduces back to back keep every connection full, so that
/// the sending thread and the reactor flush the same queue at once: none may
/// be left waiting for room it never watches for (a lost wake-up hangs here
/// until the timeout instead).
#[test]
fn back_to_back_large_allreduces_never_stall() {
    for mode in BOTH {
        let cfg = Config { transport: mode, segment_bytes: 256 << 10, ..Config::default() };
        let engines = group_with(4, Duration::from_secs(30), cfg);
        let t0 = Instant::now();
        on_all(&engines, |rank, e| {
            let mut v = vec![1.0f32 + rank as f32; 2 << 20];
            for _ in 0..12 {
                wait_ok(all_reduce(e, raw(&mut v), DType::F32, ReduceOp::Max));
            }
            assert!(v.iter().all(|&x| x == 4.0));
        });
        assert!(t0.elapsed() < Duration::from_secs(25), "{mode:?}: {:?}", t0.elapsed());
    }
}
