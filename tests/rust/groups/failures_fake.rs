//! Failures on the in-memory `FakeNet` (tests/rust/support/fake): mismatched calls and a
//! cut link fail every rank promptly, and the fake itself behaves as a
//! connection does, when whole and when cut.
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../support/fake/mod.rs"]
mod fake;

use fake::*;

/// Byte counts that differ, or ops that differ, between one rank and the
/// others: every rank fails promptly naming the mismatch (the ranks that do
/// not see it themselves learn it from the abort), and no buffer changes.
#[test]
fn mismatched_calls_fail_on_every_rank_and_touch_no_buffer() {
    for world in 2..=5 {
        for (path, small) in PATHS {
            for odd in 0..world {
                for case in ["byte count", "op"] {
                    let t0 = Instant::now();
                    let out = on_ranks(world, small, |rk| mismatched_call(rk, odd, case));
                    assert_mismatch_everywhere(
                        out,
                        t0,
                        &format!("world {world}, {path}, rank {odd} differs in {case}"),
                    );
                }
            }
        }
    }
}

/// On a ring of 4 or more ranks, ranks far from a late rank that differs
/// agree with both their neighbours: checking only the left one, ranks 1
/// and 2 used to start and fold each other's chunks before the abort from
/// the ranks next to the odd one reached them. Every rank now hears every
/// rank's call before the op moves data, so no buffer changes anywhere:
/// at once, and in rounds in groups of more than 17 ranks. A matching call
/// first, to see the check pass as well.
#[test]
fn a_late_mismatch_far_from_a_rank_leaves_its_buffer_alone() {
    for world in [4, 5, 6, 17, 18, 24] {
        for odd in [world - 1, world / 2] {
            let t0 = Instant::now();
            let out = on_ranks(world, RING, |rk| {
                let mut b = Buf::of(DType::I64, &values(rk.rank(), 8, 0));
                ok(
                    rk.run(Collective::AllReduce { buf: b.raw(), red: Reduction::new(DType::I64, ReduceOp::Sum) }),
                    "a matching call",
                );
                let want: Vec<f64> = (0..8).map(|i| (0..world).map(|r| value(r, i, 0)).sum()).collect();
                assert_eq!(b, Buf::of(DType::I64, &want), "world {world}: rank {}", rk.rank());
                if rk.rank() == odd {
                    std::thread::sleep(Duration::from_millis(100));
                }
                mismatched_call(rk, odd, "byte count")
            });
            assert_mismatch_everywhere(out, t0, &format!("world {world}, rank {odd} late and different"));
        }
    }
}

/// Two ranks that match each other cannot reach each other (one of them
/// saw the mismatch and left before the other, slower, dialled it: CI at
/// stop 35, "rank 1 could not connect to rank 3" in a sparse all-reduce
/// where rank 2 differed). Both still name the mismatch, which another
/// peer's call shows them, and not only the peer they could not reach.
#[test]
fn a_peer_out_of_reach_does_not_hide_a_mismatch() {
    for world in 3..=5 {
        for (path, small) in PATHS {
            for odd in 0..world {
                let matching: Vec<usize> = (0..world).filter(|&r| r != odd).collect();
                let (a, b) = (matching[0], matching[matching.len() - 1]);
                let net = FakeNet::new(world);
                net[a].break_peer(b, &Error::io("connect: Connection refused (os error 111)".to_string()));
                let t0 = Instant::now();
                let out = on_net(&net, small, |rk| mismatched_call(rk, odd, "byte count"));
                let at = format!("world {world}, {path}, rank {odd} differs, ranks {a} and {b} cut apart");
                assert_mismatch_everywhere(out, t0, &at);
            }
        }
    }
}

/// The link between rank 0 and the last rank is cut while the others are in
/// a large ring all-reduce (the last rank joins only after the cut): every
/// rank's op fails within moments, not at its timeout. The two ends of the
/// cut name each other; the others learn of it from the aborts, whose
/// reasons name the lost rank.
#[test]
fn a_cut_link_during_an_op_fails_every_rank_promptly_naming_the_lost_peer() {
    // One host, and hosts whose all-reduce is hierarchical, in pieces whose phases overlap.
    let on_hosts = |w: usize, host: fn(usize) -> usize| FakeNet::on_hosts((0..w).map(host).collect());
    let nets = (2..=5).map(FakeNet::new).chain([on_hosts(4, |r| r / 2), on_hosts(6, |r| r % 2)]);
    // And an arena, whose all-reduce of 16 KiB takes many rounds of 256 bytes,
    // and hosts of 3 with one each, which the cut aborts (their ranks wait there).
    let nets = nets.chain((2..=5).map(|w| FakeNet::with_arena(w, 256, None)));
    let nets = nets.chain([FakeNet::on_hosts_with_arenas((0..6).map(|r| r / 3).collect(), 1024)]);
    for net in nets {
        let world = net.len();
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

/// In a group with a shared arena every rank checks every other's call
/// there before it uses anything a peer wrote: a mismatch fails every rank
/// promptly, at every world size (the ring's gap above does not arise), and
/// no buffer changes, also where the odd rank's call would take the
/// single-copy algorithm and the others' the arena's, or names another root.
#[test]
fn in_the_arena_mismatched_calls_fail_on_every_rank_and_touch_no_buffer() {
    for world in 2..=5 {
        for (slot, single_copy) in [(256, None), (4096, Some(64))] {
            for odd in 0..world {
                for case in ["byte count", "larger than small", "op", "gather root"] {
                    let t0 = Instant::now();
                    let net = FakeNet::with_arena(world, slot, single_copy);
                    let out = on_net(&net, DIRECT, |rk| {
                        // The odd rank comes late: the others are well into their op by then.
                        if rk.rank() == odd {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        mismatched_call(rk, odd, case)
                    });
                    let at = format!("arena of {slot}-byte slots, world {world}, rank {odd} differs in {case}");
                    assert_mismatch_everywhere(out, t0, &at);
                }
            }
        }
    }
}

/// An all-to-all whose pairs disagree on a block's size fails on every rank,
/// in the arena or not, before a byte moves, naming the pair.
#[test]
fn an_all_to_all_whose_sizes_disagree_fails_everywhere() {
    for (world, arena) in (2..=4).flat_map(|w| [(w, true), (w, false)]) {
        let net = if arena { FakeNet::with_arena(world, 4096, None) } else { FakeNet::new(world) };
        let t0 = Instant::now();
        let out = on_net(&net, RING, |rk| {
            let r = rk.rank();
            // Rank 1 expects one byte more from rank 0 than rank 0 sends it.
            let want = |p: usize| if r == 1 && p == 0 { 9 } else { 8 };
            let mut inputs: Vec<Buf> = (0..world).map(|q| Buf::bytes_of(&pattern(r, q, 8))).collect();
            let mut outputs: Vec<Buf> = (0..world).map(|p| Buf::filled(want(p), 0xEE)).collect();
            let kept = outputs.clone();
            let res = rk.run(Collective::AllToAll {
                inputs: raws(&mut inputs),
                outputs: raws(&mut outputs),
                dtype: rustc10d::dtype::BYTES,
            });
            (res, outputs == kept)
        });
        for (rank, (r, untouched)) in out.into_iter().enumerate() {
            let e = r.expect_err("a size mismatch");
            assert!(e.message.contains("rank 0 sends 8 bytes to rank 1, which expects 9"), "{}", e.message);
            assert_eq!(e.kind, ErrorKind::Mismatch, "{}", e.message);
            assert!(untouched, "world {world}, arena {arena}: rank {rank}'s outputs changed");
        }
        assert!(t0.elapsed() < PROMPT);
    }
}

/// A rank that never comes leaves the others in the arena until their
/// timeout, which names it.
#[test]
fn in_the_arena_a_rank_that_never_comes_is_named_at_the_timeout() {
    let net = FakeNet::with_arena(3, 4096, None);
    let out = on_net(&net, DIRECT, |rk| {
        rk.timeout = Duration::from_millis(300);
        if rk.rank() == 2 {
            return None;
        }
        let mut b = Buf::of(DType::F32, &values(rk.rank(), 64, 0));
        let t0 = Instant::now();
        let r = rk.run(Collective::AllReduce { buf: b.raw(), red: Reduction::new(DType::F32, ReduceOp::Sum) });
        Some((r, t0.elapsed()))
    });
    // The first to time out aborts the arena, and the other learns why from it.
    let mut timed_out = 0;
    for (rank, got) in out.into_iter().enumerate().take(2) {
        let (r, took) = got.expect("ranks 0 and 1 ran");
        let e = r.expect_err("no rank 2");
        timed_out += (e.kind == ErrorKind::Timeout) as usize;
        assert!(e.message.contains("was waiting in the shared arena for rank 2 (fake)"), "{}", e.message);
        assert!(took < PROMPT, "rank {rank} took {took:?}");
    }
    assert!(timed_out >= 1, "nobody timed out");
}

// The fake itself: what the tests above rely on.

fn posted(t: &FakeTransport, peer: usize, key: Key, buf: &mut [u8], fold: Option<Fold>) -> Arc<Status> {
    let status = Status::new();
    // SAFETY: test code: each caller's buffer is a local that outlives every
    // message for its key (a receive that gets none, or is withdrawn, is
    // never written), and is read only once `result` says it finished.
    unsafe { t.recv(peer, key, buf.as_mut_ptr(), buf.len(), fold, status.clone()).unwrap() };
    status
}

fn send(t: &FakeTransport, peer: usize, key: Key, data: &[u8]) -> Result<Arc<Status>> {
    let status = Status::new();
    let far = Instant::now() + TIMEOUT;
    // SAFETY: `data` is borrowed for the call, and the fake delivers (copies)
    // it before returning: nothing reads it afterwards.
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
    // SAFETY: `any` outlives the receive, which finishes (checked below) before `any` is read.
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
    // SAFETY: `data` (behind the Arc) outlives the send, which the fake runs
    // at once: `ready` fills it, then the fake copies it, before returning.
    unsafe { a.send(1, Key::p2p(11), ptr, 2, Status::new(), Instant::now(), Some(ready)).unwrap() };
    assert_eq!((result(&r).unwrap(), got), (2, [6, 7]));
    let s = Status::new();
    let fails: rustc10d::transport::Ready = Box::new(|| Err(Error::io("no bytes")));
    // SAFETY: as above; `ready` fails, so the bytes are never read.
    unsafe { a.send(1, Key::p2p(12), ptr, 2, s.clone(), Instant::now(), Some(fails)).unwrap() };
    assert_eq!(result(&s).unwrap_err().message, "no bytes");
    assert_eq!((a.describe_peer(2), a.link_kind(1), a.link_kind(0)), ("rank 2 (fake)".into(), Some("fake"), None));
}

#[test]
fn fake_break_peer_fails_both_sides_naming_the_peer() {
    let net = FakeNet::new(3);
    let k = Key::collective(0, 0);
    let (mut x, mut y, mut z, mut w) = ([0u8; 1], [0u8; 1], [0u8; 1], [0u8; 1]);
    let at0 = posted(&net[0], 1, k, &mut x, None);
    let at1 = posted(&net[1], 0, k, &mut y, None);
    let any_at2 = Status::new();
    // SAFETY: no message with key p2p(3) is ever sent, so the fake never
    // writes `w` (both receives fail or stay posted), and `w` is never read.
    unsafe { net[2].recv_any(Key::p2p(3), w.as_mut_ptr(), 1, any_at2.clone()).unwrap() };
    let any_at1 = Status::new();
    // SAFETY: as above: nothing is sent with key p2p(3).
    unsafe { net[1].recv_any(Key::p2p(3), w.as_mut_ptr(), 1, any_at1.clone()).unwrap() };
    send(&net[1], 0, Key::p2p(1), &[5]).unwrap();
    net[0].break_peer(1, &Error::peer_lost("cut"));
    // Pending receives on both sides fail, naming the other side; so do those from any source.
    assert_eq!(result(&at0).unwrap_err().message, "lost connection to rank 1 (fake): cut");
    assert_eq!(result(&at1).unwrap_err().message, "rank 0 (fake) closed its connection");
    assert_eq!(result(&any_at1).unwrap_err().message, "rank 0 (fake) closed its connection");
    assert!(any_at2.result().is_none(), "rank 2 lost no peer");
    // Later ones too, and sends both ways; what landed before still counts.
    assert!(result(&posted(&net[1], 0, k, &mut y, None)).unwrap_err().message.contains("rank 0 (fake)"));
    let refused = |from: usize, to: usize| send(&net[from], to, k, &[1]).err().map(|e| e.message);
    assert!(refused(0, 1).expect("refused").contains("rank 1 (fake)"));
    assert!(refused(1, 0).expect("refused").contains("rank 0 (fake)"));
    assert!(result(&posted(&net[0], 1, Key::p2p(1), &mut z, None)).is_ok() && z == [5]);
    // Other links are not cut; abort_all tells every peer why.
    assert!(send(&net[2], 0, k, &[1]).is_ok());
    let at2 = posted(&net[2], 1, k, &mut z, None);
    net[1].abort_all(&Error::io("rank 1's op failed"), 0);
    assert_eq!(result(&at2).unwrap_err().message, "rank 1 (fake) gave up on the group: rank 1's op failed");
    assert!(result(&any_at2).unwrap_err().message.contains("rank 1 (fake) gave up"));
    // Shutdown closes what is left, for good.
    let at0 = posted(&net[0], 2, Key::p2p(2), &mut x, None);
    net[2].shutdown();
    net[2].shutdown();
    assert_eq!(result(&at0).unwrap_err().message, "rank 2 (fake) closed its connection");
    assert!(send(&net[2], 0, k, &[1]).err().expect("refused").message.contains("shut down"));
}
