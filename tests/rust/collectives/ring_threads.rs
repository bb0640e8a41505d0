//! Collectives end to end without torch, over real sockets and shared memory
//! (tests/rust/support/threads): every algorithm against arithmetic, mismatched calls, and
//! the connections kept full.
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../support/threads/mod.rs"]
mod threads;

use threads::*;

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
        let h2 = run(e, Collective::Broadcast { buf: raw(&mut b), root: 2, dtype: rustc10d::dtype::BYTES });
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

#[test]
fn empty_tensors_without_storage() {
    let engines = group(2, Duration::from_secs(5));
    on_all(&engines, |rank, e| {
        let empty = || RawBuf::new(std::ptr::null_mut(), 0);
        wait_ok(all_reduce(e, empty(), DType::F32, ReduceOp::Sum));
        wait_ok(run(e, Collective::Broadcast { buf: empty(), root: 1, dtype: rustc10d::dtype::BYTES }));
        let h = if rank == 0 {
            // SAFETY: an empty buffer (len 0): nothing to keep alive.
            unsafe { e.send(empty(), 1, 3, None, None, noop()).unwrap() }
        } else {
            // SAFETY: an empty buffer (len 0): nothing to keep alive.
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
    // SAFETY: every call is refused before it starts (is_err), so `v` and
    // `short` are never touched by the engine.
    let bad = |part| unsafe { e.submit(vec![part], None, None, noop()) }.is_err();
    assert!(bad(Collective::AllReduce { buf: raw(&mut v), red: Reduction::new(DType::F32, ReduceOp::BXor) }));
    assert!(bad(Collective::Broadcast { buf: raw(&mut v), root: 5, dtype: rustc10d::dtype::BYTES }));
    assert!(
        bad(Collective::AllGather { input: raw(&mut v), outputs: vec![raw(&mut v)], dtype: rustc10d::dtype::BYTES }),
        "one output per rank"
    );
    let mut short = vec![0f32; 2];
    assert!(
        bad(Collective::AllGather {
            input: raw(&mut v),
            outputs: vec![raw(&mut short), raw(&mut v)],
            dtype: rustc10d::dtype::BYTES
        }),
        "own block must fit"
    );
    // SAFETY: refused at once (send to self), so `v` is never touched.
    assert!(unsafe { e.send(raw(&mut v), 0, 0, None, None, noop()) }.is_err(), "send to self");
    // SAFETY: refused at once (no rank 7), so `v` is never touched.
    assert!(unsafe { e.recv(raw(&mut v), Some(7), 0, None, noop()) }.is_err());
    // Still usable.
    on_all(&engines, |_, e| {
        let mut v = vec![2i16; 3];
        wait_ok(all_reduce(e, raw(&mut v), DType::I16, ReduceOp::Product));
        assert_eq!(v, vec![4; 3]);
    });
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
            wait_ok(run(
                e,
                Collective::AllGather { input: raw(&mut input), outputs: slots, dtype: rustc10d::dtype::BYTES },
            ));
            // gather to the last rank, scatter from rank 0
            let root = world - 1;
            let mut at_root = vec![0u32; if rank == root { n * world } else { 0 }];
            let outs: Vec<RawBuf> = at_root.chunks_mut(n.max(1)).map(raw).collect();
            wait_ok(run(
                e,
                Collective::Gather { input: raw(&mut input), outputs: outs, root, dtype: rustc10d::dtype::BYTES },
            ));
            let mut pieces: Vec<Vec<u32>> = (0..world).map(|p| vec![p as u32 * 7; 5]).collect();
            let ins: Vec<RawBuf> = if rank == 0 { pieces.iter_mut().map(|v| raw(v)).collect() } else { vec![] };
            let mut mine = vec![0u32; 5];
            wait_ok(run(
                e,
                Collective::Scatter { inputs: ins, output: raw(&mut mine), root: 0, dtype: rustc10d::dtype::BYTES },
            ));
            // all-to-all with uneven (and zero) blocks: rank r sends r + p elements to p
            let mut send: Vec<Vec<u16>> = (0..world).map(|p| vec![(rank * 10 + p) as u16; rank + p]).collect();
            let mut recv: Vec<Vec<u16>> = (0..world).map(|p| vec![0u16; p + rank]).collect();
            let (si, ro): (Vec<RawBuf>, Vec<RawBuf>) =
                (send.iter_mut().map(|v| raw(v)).collect(), recv.iter_mut().map(|v| raw(v)).collect());
            wait_ok(run(e, Collective::AllToAll { inputs: si, outputs: ro, dtype: rustc10d::dtype::BYTES }));
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
fn allgather_with_blocks_of_different_sizes() {
    let engines = group_segmented(TransportMode::Auto, 3);
    let len = |r: usize| [0usize, 100, 17][r];
    let out = on_all(&engines, |rank, e| {
        let mut input: Vec<u8> = (0..len(rank)).map(|i| (i + rank) as u8).collect();
        let mut outs: Vec<Vec<u8>> = (0..3).map(|r| vec![0u8; len(r)]).collect();
        let slots = outs.iter_mut().map(|v| raw(v)).collect();
        wait_ok(run(
            e,
            Collective::AllGather { input: raw(&mut input), outputs: slots, dtype: rustc10d::dtype::BYTES },
        ));
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

/// An op whose caller waits for it at once (`run_now`) runs on the caller's
/// thread when the engine is idle, finished when `run_now` returns; behind
/// ops queued before it, it queues, and runs after them. Values right either
/// way.
fn ops_run_now_on_the_callers_thread_when_idle_and_in_order_behind_queued_ones_on(mode: TransportMode) {
    let engines = group_via(mode, 3, Duration::from_secs(10));
    let sum = |v: &mut Vec<i32>| Collective::AllReduce { buf: raw(v), red: Reduction::new(DType::I32, ReduceOp::Sum) };
    on_all(&engines, |rank, e| {
        let ran_on = Arc::new(Mutex::new(None));
        let noted = ran_on.clone();
        let done: rustc10d::status::Finisher = Box::new(move |_| {
            *noted.lock().unwrap() = Some(std::thread::current().id());
            Ok(())
        });
        let mut v = vec![rank as i32; 100];
        // SAFETY: `v` outlives the op, which is finished when run_now returns (asserted).
        let h = unsafe { e.run_now(vec![sum(&mut v)], None, None, done).unwrap() };
        assert!(h.is_done(), "rank {rank}: an op run now is finished when run_now returns");
        assert_eq!(
            *ran_on.lock().unwrap(),
            Some(std::thread::current().id()),
            "rank {rank}: ran on the caller's thread"
        );
        wait_ok(h);
        assert_eq!(v, vec![3; 100]);

        let mut queued: Vec<Vec<i32>> = (0..8).map(|k| vec![k + rank as i32; 33]).collect();
        let hs: Vec<_> = queued.iter_mut().map(|v| all_reduce(e, raw(v), DType::I32, ReduceOp::Sum)).collect();
        let mut last = vec![10 * rank as i32; 5];
        // SAFETY: `last` outlives the op, waited for at once.
        wait_ok(unsafe { e.run_now(vec![sum(&mut last)], None, None, noop()).unwrap() });
        for h in hs {
            assert!(h.is_done(), "rank {rank}: ops queued before an op run now are done when it is");
            wait_ok(h);
        }
        for (k, v) in queued.iter().enumerate() {
            assert_eq!(v, &vec![3 * k as i32 + 3; 33], "rank {rank}: queued op {k}");
        }
        assert_eq!(last, vec![30; 5]);
    });
}

#[test]
fn ops_run_now_on_the_callers_thread_when_idle_and_in_order_behind_queued_ones() {
    BOTH.into_iter().for_each(ops_run_now_on_the_callers_thread_when_idle_and_in_order_behind_queued_ones_on);
}
