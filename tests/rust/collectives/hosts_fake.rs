//! Groups on several hosts, on the in-memory `FakeNet` whose ranks say which
//! host they run on: the hierarchical all-reduce, reduce-scatter and
//! all-gather, the rings in host order of broadcast and reduce, and for small
//! messages the two-step all-reduce and the trees, give the right values and
//! send across hosts only the bytes their doc comments promise, counted at
//! each rank (`FakeTransport::crossed`), for hosts of equal and unequal
//! sizes, ranks numbered host by host or alternating, each layout with and
//! without an arena for each host's ranks. With the arenas, the phases on
//! the host move nothing through the links between a host's ranks.
//! (algorithms_fake.rs checks values on such networks too, at every size.)
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../support/fake/mod.rs"]
mod fake;

use fake::*;

/// Layouts: rank r of W on host `host(r)`, for W = `hosts.len()`.
const LAYOUTS: [(&str, &[usize]); 8] = [
    ("2 hosts x 2", &[0, 0, 1, 1]),
    ("2 hosts x 2, alternating", &[0, 1, 0, 1]),
    ("2 hosts x 3", &[0, 0, 0, 1, 1, 1]),
    ("3 hosts x 2, interleaved", &[0, 1, 2, 0, 1, 2]),
    ("2 hosts x 4, alternating", &[0, 1, 0, 1, 0, 1, 0, 1]),
    ("4 hosts x 1", &[0, 1, 2, 3]),
    ("hosts of 3 and 2, alternating", &[0, 1, 0, 1, 0]),
    ("hosts of 1, 2 and 3", &[0, 1, 1, 2, 2, 2]),
];

/// Elements per rank's block: divisible by every rank count per host and host
/// count above, so that every chunk is the same size and the counts exact.
const BLOCK: usize = 720;
const ES: u64 = 4; // f32

/// How many fingerprints (32 bytes each) the call check sends from `rank`
/// before the ring algorithms and the trees: at W >= 4, to every other
/// rank, but those of its host where they share an arena; where every host
/// holds as many ranks and an arena, only to its counterparts on the others.
fn check_messages(hosts: &[usize], arenas: bool, rank: usize) -> u64 {
    let (count, per, uniform) = shape(hosts);
    let mates = per[hosts[rank]] as u64;
    match arenas {
        true if uniform => count as u64 - 1,
        true if mates > 1 => hosts.len() as u64 - mates,
        _ => hosts.len() as u64 - 1,
    }
}

/// What the call check sends across hosts from `rank`.
fn check_across(hosts: &[usize], arenas: bool, rank: usize) -> u64 {
    let off_host = hosts.len() as u64 - shape(hosts).1[hosts[rank]] as u64;
    check_messages(hosts, arenas, rank).min(off_host) * 32
}

/// What the call check sends across hosts from `host`'s ranks.
fn check_bytes(hosts: &[usize], arenas: bool, host: usize) -> u64 {
    (0..hosts.len()).filter(|&r| hosts[r] == host).map(|r| check_across(hosts, arenas, r)).sum()
}

/// Hosts, and ranks on each, of a layout; `uniform`: every host holds as many, at least two.
fn shape(hosts: &[usize]) -> (usize, Vec<usize>, bool) {
    let count = hosts.iter().max().unwrap() + 1;
    let per: Vec<usize> = (0..count).map(|h| hosts.iter().filter(|&&x| x == h).count()).collect();
    let uniform = per.iter().all(|&l| l == per[0]) && per[0] > 1;
    (count, per, uniform)
}

/// Every layout, without and with an arena for each host's ranks (slots of
/// 4 KiB: the tests' ops go in several rounds).
fn layouts() -> Vec<(String, &'static [usize], bool)> {
    let named = |arenas: bool| {
        LAYOUTS.map(|(name, hosts)| (if arenas { format!("{name}, arenas") } else { name.into() }, hosts, arenas))
    };
    named(false).into_iter().chain(named(true)).collect()
}

const SLOT: usize = 4096;

/// Run `f` on every rank of a network laid out as `hosts` (with `arenas` on
/// the hosts); returns what each returned and the bytes each host sent
/// across its link meanwhile.
fn on_layout<T: Send>(
    hosts: &[usize],
    arenas: bool,
    small: usize,
    f: impl Fn(&mut Rank) -> T + Sync,
) -> (Vec<T>, Vec<u64>) {
    let net = match arenas {
        true => FakeNet::on_hosts_with_arenas(hosts.to_vec(), SLOT),
        false => FakeNet::on_hosts(hosts.to_vec()),
    };
    let out = on_net(&net, small, f);
    let mut crossed = vec![0u64; shape(hosts).0];
    for (t, &h) in net.iter().zip(hosts) {
        crossed[h] += t.crossed();
    }
    (out, crossed)
}

#[test]
fn all_reduce_crosses_each_link_2_h_minus_1_over_h_times_the_buffer() {
    for (name, hosts, arenas) in layouts() {
        let w = hosts.len();
        let (count, _, uniform) = shape(hosts);
        let n = BLOCK * w;
        for red in [REDS[0], REDS[2]] {
            let (out, crossed) = on_layout(hosts, arenas, RING, |rk| {
                let mut b = Buf::of(red.dtype, &values(rk.rank(), n, 3));
                ok(rk.run(Collective::AllReduce { buf: b.raw(), red: red.reduction() }), "all_reduce");
                b
            });
            let want =
                Buf::of(red.dtype, &(0..n).map(|i| red.combine((0..w).map(|r| value(r, i, 3)))).collect::<Vec<_>>());
            for (rank, b) in out.iter().enumerate() {
                assert_eq!(*b, want, "{name}, {red:?}, rank {rank}");
            }
            let bytes = n as u64 * red.dtype.size() as u64;
            for (h, &got) in crossed.iter().enumerate() {
                let payload = got - check_bytes(hosts, arenas, h);
                // Hierarchical: 2(H-1)/H of the buffer; a ring in host order
                // crosses each link once each way: 2(W-1)/W.
                let want = if uniform {
                    2 * (count as u64 - 1) * bytes / count as u64
                } else {
                    2 * (w as u64 - 1) * bytes / w as u64
                };
                assert_eq!(payload, want, "{name}, {red:?}: host {h} sent {payload} bytes across, not {want}");
            }
        }
    }
}

#[test]
fn reduce_scatter_and_all_gather_cross_each_link_h_minus_1_over_h_of_the_data() {
    let red = REDS[2]; // AVG: divided once, by W
    for (name, hosts, arenas) in layouts() {
        let w = hosts.len();
        let (count, per, uniform) = shape(hosts);
        let contribution = |r: usize, c: usize, i: usize| value(r, i + 1000 * c, 5);
        let (out, crossed) = on_layout(hosts, arenas, RING, |rk| {
            let r = rk.rank();
            let mut inputs: Vec<Buf> = (0..w)
                .map(|c| Buf::of(red.dtype, &(0..BLOCK).map(|i| contribution(r, c, i)).collect::<Vec<_>>()))
                .collect();
            let kept = inputs.clone();
            let mut output = Buf::of(red.dtype, &vec![-7.0; BLOCK]);
            let part =
                Collective::ReduceScatter { inputs: raws(&mut inputs), output: output.raw(), red: red.reduction() };
            ok(rk.run(part), "reduce_scatter");
            assert_eq!(inputs, kept, "{name}: rank {r}'s inputs changed");
            output
        });
        for (rank, output) in out.iter().enumerate() {
            let want: Vec<f64> = (0..BLOCK).map(|i| red.combine((0..w).map(|k| contribution(k, rank, i)))).collect();
            assert_eq!(*output, Buf::of(red.dtype, &want), "{name}: reduce_scatter, rank {rank}");
        }
        let b = BLOCK as u64 * 8;
        for (h, &got) in crossed.iter().enumerate() {
            let payload = got - check_bytes(hosts, arenas, h);
            // Hierarchical: each of the host's L ranks sends H-1 blocks; a ring: W-1.
            let want = if uniform { per[h] as u64 * (count as u64 - 1) * b } else { (w as u64 - 1) * b };
            assert_eq!(payload, want, "{name}: reduce_scatter: host {h} sent {payload} bytes across, not {want}");
        }

        let (out, crossed) = on_layout(hosts, arenas, RING, |rk| {
            let r = rk.rank();
            let mut input = Buf::bytes_of(&pattern(r, 1, BLOCK * ES as usize));
            let mut outputs: Vec<Buf> = (0..w).map(|_| Buf::filled(BLOCK * ES as usize, 0xEE)).collect();
            ok(
                rk.run(Collective::AllGather {
                    input: input.raw(),
                    outputs: raws(&mut outputs),
                    dtype: rustc10d::dtype::BYTES,
                }),
                "all_gather",
            );
            outputs
        });
        for (rank, outputs) in out.iter().enumerate() {
            for (p, o) in outputs.iter().enumerate() {
                assert_eq!(o.bytes(), pattern(p, 1, BLOCK * ES as usize), "{name}: all_gather, rank {rank}, block {p}");
            }
        }
        let b = BLOCK as u64 * ES;
        for (h, &got) in crossed.iter().enumerate() {
            let payload = got - check_bytes(hosts, arenas, h);
            let want = if uniform { per[h] as u64 * (count as u64 - 1) * b } else { (w as u64 - 1) * b };
            assert_eq!(payload, want, "{name}: all_gather: host {h} sent {payload} bytes across, not {want}");
        }
    }
}

#[test]
fn broadcast_and_reduce_cross_each_link_once_from_every_root() {
    let red = REDS[0];
    for (name, hosts, arenas) in layouts() {
        let w = hosts.len();
        let count = shape(hosts).0;
        let len = BLOCK * ES as usize;
        for root in 0..w {
            // The chain, and for small messages the tree: H-1 links carry the buffer once.
            for (path, small) in PATHS {
                let (out, crossed) = on_layout(hosts, arenas, small, |rk| {
                    let mut b =
                        if rk.rank() == root { Buf::bytes_of(&pattern(root, 2, len)) } else { Buf::filled(len, 0) };
                    let before = rk.t.sent();
                    ok(
                        rk.run(Collective::Broadcast { buf: b.raw(), root, dtype: rustc10d::dtype::BYTES }),
                        "broadcast",
                    );
                    (b, rk.t.sent() - before)
                });
                let at = format!("{name}, {path}: broadcast from {root}");
                assert!(out.iter().all(|(b, _)| b.bytes() == pattern(root, 2, len)), "{at}");
                let payload: u64 =
                    crossed.iter().enumerate().map(|(h, &got)| got - check_bytes(hosts, arenas, h)).sum();
                assert_eq!(payload, (count as u64 - 1) * len as u64, "{at}: crossed {payload}");
                if small == DIRECT {
                    // The fingerprints, and the message to the root's host mates (but
                    // through an arena) and the other hosts' first ranks.
                    let (root_host, per) = (hosts[root], shape(hosts).1);
                    let mates = if arenas { 0 } else { per[root_host] as u64 - 1 };
                    let want = check_messages(hosts, arenas, root) + mates + count as u64 - 1;
                    assert_eq!(out[root].1, want, "{at}: not the tree");
                }
            }

            // The chain, and for small messages the tree: H-1 links carry a partial sum once.
            for (path, small) in PATHS {
                let (out, crossed) = on_layout(hosts, arenas, small, |rk| {
                    let mut b = Buf::of(red.dtype, &values(rk.rank(), BLOCK, 1));
                    let before = rk.t.sent();
                    ok(rk.run(Collective::Reduce { buf: b.raw(), root, red: red.reduction() }), "reduce");
                    (b, rk.t.sent() - before)
                });
                let at = format!("{name}, {path}: reduce to {root}");
                let want: Vec<f64> = (0..BLOCK).map(|i| red.combine((0..w).map(|r| value(r, i, 1)))).collect();
                assert_eq!(out[root].0, Buf::of(red.dtype, &want), "{at}");
                let payload: u64 =
                    crossed.iter().enumerate().map(|(h, &got)| got - check_bytes(hosts, arenas, h)).sum();
                assert_eq!(payload, (count as u64 - 1) * BLOCK as u64 * 8, "{at}: crossed {payload}");
                if small == DIRECT {
                    // The fingerprints, and (but the root) one message up the tree; in a
                    // host's arena, only the rank that sums the host's part sends one.
                    let per = shape(hosts).1;
                    let head =
                        |h: usize| if hosts[root] == h { root } else { (0..w).find(|&r| hosts[r] == h).unwrap() };
                    for (rank, (_, sent)) in out.iter().enumerate() {
                        let h = hosts[rank];
                        let up = rank != root && (!arenas || per[h] == 1 || rank == head(h));
                        let want = check_messages(hosts, arenas, rank) + up as u64;
                        assert_eq!(*sent, want, "{at}: rank {rank} sent {sent}: not the tree");
                    }
                }
            }
        }
    }
}

#[test]
fn small_all_reduce_and_barrier_send_one_message_to_each_other_host_per_rank() {
    const N: usize = 64; // elements: the direct exchange's sizes
    for (name, hosts, arenas) in layouts() {
        let w = hosts.len();
        let (count, per, uniform) = shape(hosts);
        // Bytes host h sends across for a small all-reduce of `bytes`: on hosts of as many
        // ranks, each rank sends its host's sum and its fingerprint to one rank of each
        // other host, and its fingerprint to its right neighbour if that is on another
        // host and not one of those; otherwise each rank sends both to every rank elsewhere.
        let place = |r: usize| (0..r).filter(|&q| hosts[q] == hosts[r]).count();
        let across = |h: usize, bytes: u64| -> u64 {
            let mine = per[h] as u64;
            if !uniform {
                return mine * (w as u64 - mine) * (bytes + 32);
            }
            let neighbours = (0..w)
                .filter(|&r| hosts[r] == h && hosts[(r + 1) % w] != h && place((r + 1) % w) != place(r))
                .count() as u64;
            mine * (count as u64 - 1) * (bytes + 32) + neighbours * 32
        };
        for red in [REDS[0], REDS[2]] {
            let (out, crossed) = on_layout(hosts, arenas, DIRECT, |rk| {
                let mut b = Buf::of(red.dtype, &values(rk.rank(), N, 4));
                ok(rk.run(Collective::AllReduce { buf: b.raw(), red: red.reduction() }), "all_reduce");
                b
            });
            let want = (0..N).map(|i| red.combine((0..w).map(|r| value(r, i, 4)))).collect::<Vec<_>>();
            for (rank, b) in out.iter().enumerate() {
                assert_eq!(*b, Buf::of(red.dtype, &want), "{name}, {red:?}, rank {rank}");
            }
            let bytes = N as u64 * red.dtype.size() as u64;
            for (h, &got) in crossed.iter().enumerate() {
                let want = across(h, bytes);
                assert_eq!(got, want, "{name}, {red:?}: host {h} sent {got} bytes across, not {want}");
            }
        }
        let (_, crossed) = on_layout(hosts, arenas, DIRECT, |rk| ok(rk.run(Collective::Barrier), "barrier"));
        for (h, &got) in crossed.iter().enumerate() {
            assert_eq!(got, across(h, 1), "{name}: barrier: host {h} sent {got} bytes across");
        }
    }
}

/// One rank calls a small all-reduce of another size than the others (the
/// same path, or, larger than the threshold, the hierarchical ring), or a
/// reduce: every rank fails promptly naming the mismatch, no buffer changes.
#[test]
fn small_all_reduce_mismatch_on_any_rank_fails_every_rank_and_touches_no_buffer() {
    const SMALL: usize = 96; // bytes: 8 and 9 i64 take the direct path, 16 the ring
    for (name, hosts, arenas) in layouts() {
        for odd in 0..hosts.len() {
            for case in ["byte count", "larger than small", "op"] {
                let t0 = Instant::now();
                let (out, _) = on_layout(hosts, arenas, SMALL, |rk| mismatched_call(rk, odd, case));
                assert_mismatch_everywhere(out, t0, &format!("{name}: rank {odd} differs in {case}"));
            }
        }
    }
}

/// A late rank, the last, calls an all-reduce of another byte count: every
/// rank fails naming the mismatch and no buffer changes, also on the ranks
/// whose neighbours called as they did, for an op in one piece (its phases
/// on the host in the arena, where there is one) and one in pieces (rings).
/// Also on 18 hosts of 2, where a rank hears from its 17 counterparts (or,
/// without the arenas, its 35 peers) in rounds; a matching call first.
#[test]
fn a_late_mismatch_fails_every_rank_and_touches_no_buffer() {
    let many: Vec<usize> = (0..36).map(|r| r / 2).collect();
    let layouts = layouts().into_iter().map(|(name, hosts, arenas)| (name, hosts.to_vec(), arenas, false));
    let many = [false, true].map(|arenas| (format!("18 hosts x 2, arenas {arenas}"), many.clone(), arenas, true));
    for (name, hosts, arenas, matching_first) in layouts.chain(many) {
        let odd = hosts.len() - 1;
        for n in [8, 1 << 10] {
            let t0 = Instant::now();
            let (out, _) = on_layout(&hosts, arenas, RING, |rk| {
                let r = rk.rank();
                let red = Reduction::new(DType::I64, ReduceOp::Sum);
                if matching_first {
                    let mut b = Buf::of(DType::I64, &values(r, n, 0));
                    ok(rk.run(Collective::AllReduce { buf: b.raw(), red }), "a matching call");
                    let want: Vec<f64> = (0..n).map(|i| (0..hosts.len()).map(|q| value(q, i, 0)).sum()).collect();
                    assert_eq!(b, Buf::of(DType::I64, &want), "{name}: rank {r}");
                }
                if r == odd {
                    std::thread::sleep(Duration::from_millis(100));
                }
                let mut b = Buf::of(DType::I64, &values(r, n + usize::from(r == odd), 0));
                let kept = b.clone();
                (rk.run(Collective::AllReduce { buf: b.raw(), red }), b == kept)
            });
            assert_mismatch_everywhere(out, t0, &format!("{name}: {n} elements, rank {odd} late and different"));
        }
    }
}

/// A host cut off in silence (its ranks never join the op), on 3 hosts of 2
/// ranks: every rank of the hosts still joined times out and names a rank
/// of the lost host, also the ranks that were waiting for a joined rank
/// which itself waited for the lost host (they ask it, and say what it said).
#[test]
fn a_lost_host_is_named_by_every_rank_that_times_out() {
    let hosts = [0, 0, 1, 1, 2, 2];
    for (what, n, arenas) in [("small", 2, false), ("large", 4096, false), ("small", 2, true), ("large", 4096, true)] {
        for small in [RING, DIRECT] {
            let (out, _) = on_layout(&hosts, arenas, small, |rk| {
                rk.timeout = Duration::from_millis(500);
                if hosts[rk.rank()] == 2 {
                    std::thread::sleep(Duration::from_millis(1500));
                    return None;
                }
                let mut b = Buf::of(DType::F32, &values(rk.rank(), n, 0));
                Some(rk.run(Collective::AllReduce { buf: b.raw(), red: Reduction::new(DType::F32, ReduceOp::Sum) }))
            });
            for (rank, r) in out.into_iter().enumerate().filter(|(r, _)| hosts[*r] != 2) {
                let at = format!("{what} all_reduce, small_allreduce_bytes {small}, arenas {arenas}, rank {rank}");
                let e = r.unwrap().expect_err(&at);
                assert!(
                    e.message.contains("rank 4 (fake)") || e.message.contains("rank 5 (fake)"),
                    "{at}: {}",
                    e.message
                );
            }
        }
    }
}

/// On hosts whose ranks share an arena, the hierarchical ops run their
/// phases on the host there, in one piece and, from 3 ranks a host, in
/// pieces (here, from 2 KiB: the tests' segments are 64 bytes; several of
/// the arena's rounds each), and so do the small broadcast's and reduce's
/// trees their hop on the host: each rank sends its host's ranks at most a
/// fingerprint (to its right neighbour, for the call check) per op, where
/// the rings on the host would send them a block at every step. The values
/// are right and what crosses between hosts is as without the arenas.
#[test]
fn hierarchical_ops_move_nothing_between_a_hosts_ranks_through_the_links() {
    for (name, hosts) in LAYOUTS.into_iter().filter(|(_, h)| shape(h).2) {
        let w = hosts.len();
        let per_host = shape(hosts).1[0];
        let red = REDS[2]; // AVG: divided once, by W
        let mut crossed_by = Vec::new();
        for arenas in [false, true] {
            let at = |op: &str| format!("{name}, arenas {arenas}: {op}");
            let net = match arenas {
                true => FakeNet::on_hosts_with_arenas(hosts.to_vec(), SLOT),
                false => FakeNet::on_hosts(hosts.to_vec()),
            };
            let mut crossed: Vec<u64> = vec![0; w];
            // Elements per block: 24 (192 W bytes of f64 in all, one piece) or 16 times as many.
            for (op, small, m) in [
                ("all_reduce", RING, 24),
                ("all_reduce", RING, 384),
                ("small all_reduce", DIRECT, 24),
                ("reduce_scatter", RING, 24),
                ("reduce_scatter", RING, 384),
                ("all_gather", RING, 24),
                ("all_gather", RING, 384),
                ("barrier", DIRECT, 24),
                ("small broadcast", DIRECT, 24),
                ("small reduce", DIRECT, 24),
            ] {
                let at = |op: &str| at(&format!("{op} of {m} x {w}"));
                let root = w - 1; // on another host than rank 0
                let before: Vec<(u64, u64)> = net.iter().map(|t| (t.on_host(), t.crossed())).collect();
                let n = m * w;
                let out = on_net(&net, small, |rk| {
                    let r = rk.rank();
                    let mut b = Buf::of(red.dtype, &values(r, n, 6));
                    let mut blocks: Vec<Buf> = (0..w).map(|c| Buf::of(red.dtype, &values(r, m, c))).collect();
                    let mut gathered: Vec<Buf> = (0..w).map(|_| Buf::filled(4 * m, 0xEE)).collect();
                    let mut input = Buf::bytes_of(&pattern(r, 3, 4 * m));
                    let mut output = Buf::of(red.dtype, &vec![-7.0; m]);
                    let part = match op {
                        "all_reduce" | "small all_reduce" => {
                            Collective::AllReduce { buf: b.raw(), red: red.reduction() }
                        }
                        "reduce_scatter" => Collective::ReduceScatter {
                            inputs: raws(&mut blocks),
                            output: output.raw(),
                            red: red.reduction(),
                        },
                        "all_gather" => Collective::AllGather {
                            input: input.raw(),
                            outputs: raws(&mut gathered),
                            dtype: rustc10d::dtype::BYTES,
                        },
                        "small broadcast" => {
                            Collective::Broadcast { buf: b.raw(), root, dtype: rustc10d::dtype::BYTES }
                        }
                        "small reduce" => Collective::Reduce { buf: b.raw(), root, red: red.reduction() },
                        _ => Collective::Barrier,
                    };
                    ok(rk.run(part), at(op));
                    (b, output, gathered)
                });
                for (r, (b, output, gathered)) in out.iter().enumerate() {
                    match op {
                        "all_reduce" | "small all_reduce" => {
                            let want: Vec<f64> = (0..n).map(|i| red.combine((0..w).map(|q| value(q, i, 6)))).collect();
                            assert_eq!(*b, Buf::of(red.dtype, &want), "{}, rank {r}", at(op));
                        }
                        "small broadcast" => {
                            assert_eq!(*b, Buf::of(red.dtype, &values(root, n, 6)), "{}, rank {r}", at(op))
                        }
                        "small reduce" => {
                            let want: Vec<f64> = match r == root {
                                true => (0..n).map(|i| red.combine((0..w).map(|q| value(q, i, 6)))).collect(),
                                false => values(r, n, 6),
                            };
                            assert_eq!(*b, Buf::of(red.dtype, &want), "{}, rank {r}", at(op));
                        }
                        "reduce_scatter" => {
                            let want: Vec<f64> = (0..m).map(|i| red.combine((0..w).map(|q| value(q, i, r)))).collect();
                            assert_eq!(*output, Buf::of(red.dtype, &want), "{}, rank {r}", at(op));
                        }
                        "all_gather" => {
                            for (p, g) in gathered.iter().enumerate() {
                                assert_eq!(g.bytes(), pattern(p, 3, 4 * m), "{}, rank {r}, block {p}", at(op));
                            }
                        }
                        _ => {}
                    }
                }
                for (r, t) in net.iter().enumerate() {
                    let (on_host, across) = (t.on_host() - before[r].0, t.crossed() - before[r].1);
                    // Less the call check's, which the arenas change.
                    let checked_before = !matches!(op, "small all_reduce" | "barrier");
                    crossed[r] += across - if checked_before { check_across(hosts, arenas, r) } else { 0 };
                    if arenas && (m == 24 || per_host >= 3) {
                        assert!(on_host <= 32, "{}: rank {r} sent {on_host} bytes to its host's ranks", at(op));
                    } else if !matches!(op, "barrier" | "small broadcast" | "small reduce") {
                        // (In the trees only some ranks send on their host.)
                        assert!(on_host > 32, "{}: rank {r} sent only {on_host} bytes on its host", at(op));
                    }
                }
            }
            crossed_by.push(crossed);
        }
        assert_eq!(crossed_by[0], crossed_by[1], "{name}: the arenas changed what crosses between hosts");
    }
}

/// A rank that waits in its host's arena says so when asked: on 2 hosts of
/// 2 ranks with arenas, a small all_reduce (the exchange on the host in the
/// arena, the fingerprints checked after it), rank 0 never comes; rank 1
/// waits for it in host 0's arena, longer than rank 3 waits for rank 1's sum
/// across (rank 3 alone has a short timeout). Rank 3 times out naming rank 1
/// and, in turn, what rank 1 waited for: rank 0, in the arena.
#[test]
fn a_rank_waiting_in_its_hosts_arena_tells_a_peer_that_asks() {
    let (out, _) = on_layout(&[0, 0, 1, 1], true, DIRECT, |rk| {
        rk.timeout = Duration::from_millis(if rk.rank() == 3 { 500 } else { 3000 });
        if rk.rank() == 0 {
            std::thread::sleep(Duration::from_millis(1000));
            return None;
        }
        let mut b = Buf::of(DType::F32, &values(rk.rank(), 8, 0));
        Some(rk.run(Collective::AllReduce { buf: b.raw(), red: Reduction::new(DType::F32, ReduceOp::Sum) }))
    });
    let e = out[3].clone().unwrap().expect_err("rank 3 times out");
    assert!(e.message.contains("was waiting for data from rank 1 (fake)"), "{}", e.message);
    let in_turn = "in turn, allreduce #0 on rank 1 was waiting in the shared arena for rank 0 (fake)";
    assert!(e.message.contains(in_turn), "{}", e.message);
}
