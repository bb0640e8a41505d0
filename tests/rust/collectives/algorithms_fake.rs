//! The collective algorithms on the in-memory `FakeNet`, without sockets or
//! the engine: W ranks as threads of one process, every op run through
//! `algorithms::run` as the engine's job runs it (call check, algorithm, and
//! on failure `abort_all`, as the engine's break_group does), every result
//! checked against plain arithmetic. Small segments, so that modest buffers
//! take many pipelined steps. Every wait is bounded by the op's timeout.
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../support/fake/mod.rs"]
mod fake;

use fake::*;

#[test]
fn all_reduce_on_both_paths_matches_arithmetic() {
    for (net, kind) in NETS {
        let single_copy = kind.single_copy();
        for world in 1..=5 {
            for (path, small) in PATHS.into_iter().chain([("up to 64 bytes direct", 64)]) {
                let out = on_ranks_via(kind, world, small, |rk| {
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
                        let want: Vec<f64> =
                            (0..n).map(|i| red.combine((0..world).map(|r| value(r, i, salt)))).collect();
                        let at = format!("{net}, world {world}, {path}, rank {rank}, {n} x {red:?}");
                        assert_eq!(b, Buf::of(red.dtype, &want), "{at}");
                        let premul = red.reduction().premul.is_some();
                        let block = n / world * red.dtype.size();
                        // One that fits a round of the arena runs there.
                        let fits_round = kind.arena_slot().is_some_and(|slot| n * red.dtype.size() <= slot);
                        let single =
                            world > 1 && !premul && !fits_round && single_copy.is_some_and(|from| block >= from);
                        if kind.arena() {
                            // The arena's sends nothing; the single-copy one a block and the
                            // reduced block to every peer (the call is checked in the arena).
                            let want = if single { 2 * (world as u64 - 1) } else { 0 };
                            assert_eq!(sent, want, "{at}: not the arena's (or single-copy) all-reduce");
                        } else if n * red.dtype.size() <= small {
                            assert!(sent <= exchange, "{at}: sent {sent}, not the direct path");
                        } else if single {
                            // A fingerprint, a block and the reduced block to every peer.
                            assert_eq!(sent, 3 * (world as u64 - 1), "{at}: not the single-copy all-reduce");
                        } else if world > 1 && !kind.hosts() {
                            assert!(sent > exchange, "{at}: sent {sent}, not the ring");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_to_every_root_leaves_the_other_ranks_buffers_alone() {
    for (net, kind) in NETS {
        for world in 1..=5 {
            for (root, (path, small)) in (0..world).flat_map(|root| PATHS.map(|p| (root, p))) {
                let out = on_ranks_via(kind, world, small, |rk| {
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
                        assert_eq!(
                            b,
                            Buf::of(red.dtype, &want),
                            "{net}, {path}, world {world}, root {root}, rank {rank}, {n} x {red:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    for (net, kind) in NETS {
        let single_copy = kind.single_copy();
        for world in 1..=5 {
            for (root, (path, small)) in (0..world).flat_map(|root| PATHS.map(|p| (root, p))) {
                let out = on_ranks_via(kind, world, small, |rk| {
                    [0, 1, 63, 64, 65, 1000]
                        .map(|len| {
                            let mut b = if rk.rank() == root {
                                Buf::bytes_of(&pattern(root, len, len))
                            } else {
                                Buf::filled(len, 0xEE)
                            };
                            let before = rk.t.sent();
                            ok(
                                rk.run(Collective::Broadcast { buf: b.raw(), root, dtype: rustc10d::dtype::BYTES }),
                                "broadcast",
                            );
                            (len, b, rk.t.sent() - before)
                        })
                        .to_vec()
                });
                for (rank, got) in out.into_iter().enumerate() {
                    for (len, b, sent) in got {
                        let at = format!("{net}, world {world}, {path}, root {root}, rank {rank}, {len} bytes");
                        assert_eq!(b.bytes(), pattern(root, len, len), "{at}");
                        let single = single_copy.is_some_and(|from| len >= from) && world > 1;
                        if kind.arena() {
                            // Nothing through the arena; the root's buffer to every peer with single copy.
                            let want = if single && rank == root { world - 1 } else { 0 };
                            assert_eq!(sent, want as u64, "{at}: not the arena's (or single-copy) broadcast");
                        } else if single {
                            // A fingerprint to every peer, and the root its buffer to every peer.
                            let want = if rank == root { 2 * (world - 1) } else { world - 1 };
                            assert_eq!(sent, want as u64, "{at}: not the single-copy broadcast");
                        } else if small == DIRECT && world > 2 && !kind.hosts() {
                            // The tree: a fingerprint to every rank, and the root its
                            // buffer to every rank.
                            let want = world - 1 + if rank == root { world - 1 } else { 0 };
                            assert_eq!(sent, want as u64, "{at}: not the tree broadcast");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn all_gather_with_blocks_of_different_sizes() {
    let sizes: [fn(usize) -> usize; 6] =
        [|_| 0, |r| r, |r| 64 * r + 1, |r| (37 * r + 3) % 101, |r| if r % 2 == 0 { 0 } else { 130 }, |r| 64 + 7 * r];
    for (net, kind) in NETS {
        let single_copy = kind.single_copy();
        for world in 1..=5 {
            let out = on_ranks_via(kind, world, RING, |rk| {
                let r = rk.rank();
                sizes
                    .map(|len| {
                        let mut input = Buf::bytes_of(&pattern(r, 0, len(r)));
                        let mut outputs: Vec<Buf> = (0..world).map(|p| Buf::filled(len(p), 0xEE)).collect();
                        let part = Collective::AllGather {
                            input: input.raw(),
                            outputs: raws(&mut outputs),
                            dtype: rustc10d::dtype::BYTES,
                        };
                        let before = rk.t.sent();
                        ok(rk.run(part), "all_gather");
                        (input, outputs, rk.t.sent() - before)
                    })
                    .to_vec()
            });
            for (rank, got) in out.into_iter().enumerate() {
                for ((input, outputs, sent), len) in got.into_iter().zip(sizes) {
                    let single = single_copy.is_some_and(|from| (0..world).all(|p| len(p) >= from)) && world > 1;
                    // A fingerprint (but in the arena) and its block to every peer; nothing through the arena.
                    let fingerprints = if kind.arena() { 0 } else { world as u64 - 1 };
                    if single {
                        let want = fingerprints + world as u64 - 1;
                        assert_eq!(sent, want, "{net}, world {world}, rank {rank}: not the single-copy all-gather");
                    } else if kind.arena() {
                        assert_eq!(sent, 0, "{net}, world {world}, rank {rank}: not the arena's all-gather");
                    }
                    assert_eq!(
                        input.bytes(),
                        pattern(rank, 0, len(rank)),
                        "{net}, world {world}: rank {rank}'s input changed"
                    );
                    for (p, b) in outputs.iter().enumerate() {
                        assert_eq!(b.bytes(), pattern(p, 0, len(p)), "{net}, world {world}, rank {rank}, block {p}");
                    }
                }
            }
        }
    }
}

#[test]
fn gather_and_scatter_with_every_root() {
    for (net, kind) in NETS {
        for world in 1..=5 {
            for root in 0..world {
                let out = on_ranks_via(kind, world, RING, |rk| {
                    let r = rk.rank();
                    let at_root = |n: usize| if r == root { n } else { 0 };
                    [0, 1, 65, 300, 700]
                        .map(|len| {
                            let mut input = Buf::bytes_of(&pattern(r, len, len));
                            let mut gathered: Vec<Buf> = (0..at_root(world)).map(|_| Buf::filled(len, 0xEE)).collect();
                            let part = Collective::Gather {
                                input: input.raw(),
                                outputs: raws(&mut gathered),
                                root,
                                dtype: rustc10d::dtype::BYTES,
                            };
                            let before = rk.t.sent();
                            ok(rk.run(part), "gather");
                            let mut blocks: Vec<Buf> =
                                (0..at_root(world)).map(|p| Buf::bytes_of(&pattern(p, 7, len))).collect();
                            let mut output = Buf::filled(len, 0xEE);
                            let part = Collective::Scatter {
                                inputs: raws(&mut blocks),
                                output: output.raw(),
                                root,
                                dtype: rustc10d::dtype::BYTES,
                            };
                            ok(rk.run(part), "scatter");
                            (len, gathered, output, rk.t.sent() - before)
                        })
                        .to_vec()
                });
                for (rank, got) in out.into_iter().enumerate() {
                    for (len, gathered, output, sent) in got {
                        let at = format!("{net}, world {world}, root {root}, rank {rank}, {len} bytes");
                        assert_eq!(gathered.len(), if rank == root { world } else { 0 });
                        for (p, b) in gathered.iter().enumerate() {
                            assert_eq!(b.bytes(), pattern(p, len, len), "{at}: gathered block {p}");
                        }
                        assert_eq!(output.bytes(), pattern(rank, 7, len), "{at}: scattered block");
                        if kind.arena() && kind.single_copy().is_none_or(|from| len < from) {
                            assert_eq!(sent, 0, "{at}: not the arena's gather and scatter");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_matches_arithmetic_and_keeps_the_inputs() {
    // Rank r's contribution to block c, element i.
    let contribution = |r: usize, c: usize, i: usize, salt: usize| value(r, i + 1000 * c, salt);
    for (net, kind) in NETS {
        let single_copy = kind.single_copy();
        for world in 1..=5 {
            let out = on_ranks_via(kind, world, RING, |rk| {
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
                        let before = rk.t.sent();
                        ok(rk.run(part), "reduce_scatter");
                        let sent = rk.t.sent() - before;
                        assert_eq!(inputs, kept, "{net}, world {world}, rank {r}, {n} x {red:?}: inputs changed");
                        let single = world > 1 && single_copy.is_some_and(|from| n * red.dtype.size() >= from);
                        if single {
                            // A fingerprint (but in the arena) and a block to every peer.
                            let want = if kind.arena() { 1 } else { 2 } * (world as u64 - 1);
                            assert_eq!(
                                sent, want,
                                "{net}, world {world}, {n} x {red:?}: not the single-copy reduce-scatter"
                            );
                        } else if kind.arena() {
                            assert_eq!(sent, 0, "{net}, world {world}, {n} x {red:?}: not the arena's reduce-scatter");
                        }
                        got.push((n, salt, red, output));
                    }
                }
                got
            });
            for (rank, got) in out.into_iter().enumerate() {
                for (n, salt, red, output) in got {
                    let want: Vec<f64> =
                        (0..n).map(|i| red.combine((0..world).map(|k| contribution(k, rank, i, salt)))).collect();
                    assert_eq!(output, Buf::of(red.dtype, &want), "{net}, world {world}, rank {rank}, {n} x {red:?}");
                }
            }
        }
    }
}

#[test]
fn all_to_all_with_uneven_blocks() {
    for (net, kind) in NETS.into_iter().filter(|(_, k)| !k.hosts()) {
        for world in 1..=5 {
            // 0: every block 300 bytes (single copy, where there is);
            // else bytes from rank p to rank q: a few blocks empty (2 to 1
            // and 3), none to itself, most of a size of their own.
            for scale in [0, 1, 13, 70] {
                let len = |p: usize, q: usize| if scale == 0 { 300 } else { ((p * 7 + q * 3 + 1) % 6) * scale };
                let out = on_ranks_via(kind, world, RING, |rk| {
                    let r = rk.rank();
                    let mut inputs: Vec<Buf> = (0..world).map(|q| Buf::bytes_of(&pattern(r, q, len(r, q)))).collect();
                    let mut outputs: Vec<Buf> = (0..world).map(|p| Buf::filled(len(p, r), 0xEE)).collect();
                    let part = Collective::AllToAll {
                        inputs: raws(&mut inputs),
                        outputs: raws(&mut outputs),
                        dtype: rustc10d::dtype::BYTES,
                    };
                    let before = rk.t.sent();
                    ok(rk.run(part), "all_to_all");
                    (outputs, rk.t.sent() - before)
                });
                for (q, (outputs, sent)) in out.into_iter().enumerate() {
                    let at = format!("{net}, world {world}, x{scale}");
                    for (p, b) in outputs.iter().enumerate() {
                        assert_eq!(b.bytes(), pattern(p, q, len(p, q)), "{at}: rank {q}'s block from {p}");
                    }
                    if kind.arena() {
                        // Pairs exchange directly only where every block goes as its
                        // address, after telling each other their block sizes.
                        let direct = world > 1 && scale == 0 && kind.single_copy().is_some_and(|from| 300 >= from);
                        let want = if direct { 2 * (world as u64 - 1) } else { 0 };
                        assert_eq!(sent, want, "{at}: rank {q} sent {sent} messages");
                    }
                }
            }
        }
    }
}

#[test]
fn barrier_waits_for_the_last_rank_on_both_paths() {
    for world in 1..=5 {
        for (path, small, arena) in [("ring", RING, false), ("direct", DIRECT, false), ("arena", RING, true)] {
            let arrived = Mutex::new(None::<Instant>);
            let net = if arena { FakeNet::with_arena(world, 4096, None) } else { FakeNet::new(world) };
            let out = on_net(&net, small, |rk| {
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

/// A send may read its memory long after it was posted (behind a busy
/// connection, or where the peer reads it from our memory): everything an
/// algorithm sends must live until the op's transfers end, the call check's
/// fingerprints too. Rank 0's link to rank 1 is held for the whole op and
/// released once rank 0 waits for its last sends; every result must match.
#[test]
fn sends_held_behind_a_busy_link_still_carry_what_was_sent() {
    let world = 3;
    let sum = Red { dtype: DType::F32, op: ReduceOp::Sum, premul: None };
    for (net, kind) in NETS {
        for (path, small) in PATHS {
            let out = on_ranks_via(kind, world, small, |rk| {
                let r = rk.rank();
                let mut red_buf = Buf::of(DType::F32, &values(r, 100, 0));
                let mut bcast = if r == 0 { Buf::bytes_of(&pattern(0, 1, 300)) } else { Buf::filled(300, 0xEE) };
                let mut input = Buf::bytes_of(&pattern(r, 2, 200));
                let mut outputs: Vec<Buf> = (0..world).map(|_| Buf::filled(200, 0xEE)).collect();
                let parts = [
                    Collective::AllReduce { buf: red_buf.raw(), red: sum.reduction() },
                    Collective::Broadcast { buf: bcast.raw(), root: 0, dtype: rustc10d::dtype::BYTES },
                    Collective::AllGather {
                        input: input.raw(),
                        outputs: raws(&mut outputs),
                        dtype: rustc10d::dtype::BYTES,
                    },
                ];
                for part in parts {
                    let kind = part.kind().name();
                    if r == 0 {
                        rk.t.hold(1);
                        let t = rk.t;
                        std::thread::scope(|s| {
                            s.spawn(|| {
                                std::thread::sleep(Duration::from_millis(50));
                                t.release(1);
                            });
                            ok(rk.run(part), kind);
                        });
                    } else {
                        ok(rk.run(part), kind);
                    }
                }
                (red_buf, bcast, outputs)
            });
            for (rank, (red_buf, bcast, outputs)) in out.into_iter().enumerate() {
                let at = format!("{net}, {path}, rank {rank}");
                let sums: Vec<f64> = (0..100).map(|i| sum.combine((0..world).map(|r| value(r, i, 0)))).collect();
                assert_eq!(red_buf, Buf::of(DType::F32, &sums), "{at}: all_reduce");
                assert_eq!(bcast.bytes(), pattern(0, 1, 300), "{at}: broadcast");
                for (p, b) in outputs.iter().enumerate() {
                    assert_eq!(b.bytes(), pattern(p, 2, 200), "{at}: all_gather block {p}");
                }
            }
        }
    }
}

/// A sparse all-reduce on rank `rk` of `rows` (an index and an 8-byte value
/// each) in a tensor of `size` rows; `honest` false skips the local check of
/// the call, as a lying peer would. Returns the gathered rows.
fn sparse_on(rk: &mut Rank, size: u64, rows: &[i64], honest: bool) -> Result<SparseGathered> {
    let mut indices = Buf::of(DType::I64, &rows.iter().map(|&i| i as f64).collect::<Vec<_>>());
    let mut values = Buf::of(DType::F64, &rows.iter().map(|&i| (i * 10 + rk.rank() as i64) as f64).collect::<Vec<_>>());
    let shape = SparseShape { sparse_sizes: vec![size], dense_sizes: vec![], value_row: 8 };
    let out =
        Arc::new(rustc10d::locks::Mutex::<rustc10d::locks::level::SparseGathered, _>::new(SparseGathered::default()));
    let part = Collective::AllReduceSparse {
        indices: indices.raw(),
        values: values.raw(),
        shape,
        dtype: DType::F64,
        out: out.clone(),
    };
    if honest { rk.run(part) } else { rk.run_unchecked(part) }?;
    let gathered = std::mem::take(&mut *out.lock().unwrap());
    Ok(gathered)
}

#[test]
fn sparse_all_reduce_gathers_every_ranks_rows_in_rank_order() {
    for (net, kind) in NETS {
        for world in 1..=4 {
            // Rank r holds rows 0..=r, some of them the same on every rank.
            let out = on_ranks_via(kind, world, RING, |rk| {
                let rows: Vec<i64> = (0..=rk.rank() as i64).collect();
                sparse_on(rk, 8, &rows, true).unwrap()
            });
            for (rank, got) in out.into_iter().enumerate() {
                let at = format!("{net}, world {world}, rank {rank}");
                assert_eq!(got.rows, (1..=world as u64).collect::<Vec<_>>(), "{at}");
                let want: Vec<i64> = (0..world as i64).flat_map(|r| 0..=r).collect();
                let idx: Vec<i64> = got.indices.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
                assert_eq!(idx, want, "{at}");
                let vals: Vec<f64> = got.values.chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
                let want: Vec<f64> =
                    (0..world as i64).flat_map(|r| (0..=r).map(move |i| (i * 10 + r) as f64)).collect();
                assert_eq!(vals, want, "{at}");
            }
        }
    }
}

#[test]
fn a_peer_that_sends_too_many_sparse_rows_or_indices_out_of_range_is_named() {
    // A tensor of 4 rows holds at most 4 distinct indices; the liar (rank 1)
    // sends 5, or an index past the end, or a negative one.
    let lies: [(&str, &[i64]); 3] =
        [("a count of 5 rows", &[0, 1, 2, 3, 3]), ("index 9", &[0, 9]), ("index -1", &[-1])];
    for (net, kind) in NETS {
        for world in [2, 3] {
            for (what, rows) in lies {
                let t0 = Instant::now();
                let out = on_ranks_via(kind, world, RING, |rk| {
                    if rk.rank() == 1 {
                        sparse_on(rk, 4, rows, false)
                    } else {
                        sparse_on(rk, 4, &[rk.rank() as i64 % 4], true)
                    }
                });
                assert!(t0.elapsed() < PROMPT, "{net}, {what}: took {:?}", t0.elapsed());
                for (rank, r) in out.into_iter().enumerate() {
                    let e = r.expect_err(&format!("{net}, world {world}, {what}: rank {rank} accepted it"));
                    assert!(
                        e.message.contains("rank 1 ") && e.message.contains(what),
                        "{net}, world {world}, {what}: rank {rank}: {}",
                        e.message
                    );
                }
            }
        }
    }
}
