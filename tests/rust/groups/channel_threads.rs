//! Groups that share one set of connections (transport/channel.rs), over
//! real sockets and shared memory (tests/rust/support/threads): groups made from a group
//! run at once without mixing their messages, a group that fails breaks
//! itself and no other, and a closed group's late messages never reach a
//! group made after it under the same name.
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../support/threads/mod.rs"]
mod threads;

use rustc10d::status::Status;
use rustc10d::transport::{Key, Transfers};
use threads::*;

const TIMEOUT: Duration = Duration::from_secs(20);

/// Group `name` of `members` (ranks of `parent`) on every member of it, all
/// at once (members on one host agree on an arena): None on the ranks
/// outside it.
fn channel(parent: &[Option<Engine>], mode: TransportMode, name: &str, members: &[usize]) -> Vec<Option<Engine>> {
    let cfg = Config { transport: mode, ..Config::default() };
    let open = |r: usize, e: &Option<Engine>| {
        let e = e.as_ref().filter(|_| members.contains(&r))?;
        let t = e.open_channel(name, members, TIMEOUT).expect("a mesh shares its connections").unwrap();
        Some(Engine::new(t, &cfg, TIMEOUT).unwrap())
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = parent.iter().enumerate().map(|(r, e)| s.spawn(move || open(r, e))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Whether rank `rank` of a group runs its collectives in an arena.
fn has_arena(g: &[Option<Engine>], rank: usize) -> bool {
    g[rank].as_ref().unwrap().transport().upgrade().unwrap().arena().is_some()
}

/// A group's engines (by world rank), its members, and how each scales its values.
type Tested<'a> = (&'a [Option<Engine>], &'a [usize], f32);

fn sum_of(members: &[usize], rank_value: impl Fn(usize) -> f32) -> f32 {
    members.iter().map(|&r| rank_value(r)).sum()
}

fn groups_on_shared_connections_run_at_once_without_mixing_on(mode: TransportMode) {
    let world: Vec<Option<Engine>> = group_via(mode, 4, TIMEOUT).into_iter().map(Some).collect();
    let everyone = channel(&world, mode, "everyone", &[0, 1, 2, 3]);
    // Reversed: rank 0 of the group is rank 3 of the world.
    let backwards = channel(&world, mode, "backwards", &[3, 1]);
    // A group made from a group: ranks 0 and 2 of `everyone`.
    let evens = channel(&everyone, mode, "evens", &[0, 2]);
    let groups: [Tested; 4] = [
        (&world, &[0, 1, 2, 3], 1.0),
        (&everyone, &[0, 1, 2, 3], 10.0),
        (&backwards, &[3, 1], 100.0),
        (&evens, &[0, 2], 1000.0),
    ];
    let ranks: Vec<usize> = (0..4).collect();
    std::thread::scope(|s| {
        for &rank in &ranks {
            let groups = &groups;
            s.spawn(move || {
                for round in 0..20 {
                    // Every group's all_reduce #round at once, of other lengths,
                    // with the same sequence numbers: only the channel tells them apart.
                    let mut bufs: Vec<(usize, Vec<f32>)> = Vec::new();
                    let mut handles = Vec::new();
                    for (i, (engines, _, scale)) in groups.iter().enumerate() {
                        let Some(e) = &engines[rank] else { continue };
                        let mut v = vec![scale * (rank + 1) as f32 + round as f32; 1 + i * 37 + round];
                        handles.push(all_reduce(e, raw(&mut v), DType::F32, ReduceOp::Sum));
                        bufs.push((i, v));
                    }
                    handles.into_iter().for_each(wait_ok);
                    for (i, v) in bufs {
                        let (_, members, scale) = groups[i];
                        let want = sum_of(members, |r| scale * (r + 1) as f32 + round as f32);
                        assert!(
                            v.iter().all(|&x| x == want),
                            "rank {rank} group {i} round {round}: {} != {want}",
                            v[0]
                        );
                    }
                }
            });
        }
    });
    // Over shared memory, groups on one host run in arenas of their own (none over TCP).
    for rank in 0..4 {
        let arenas = [has_arena(&everyone, rank), rank % 2 == 1 && has_arena(&backwards, rank)];
        let want = mode == TransportMode::Shm;
        assert_eq!(arenas, [want, want && rank % 2 == 1], "{mode:?} rank {rank}");
    }
    let e = everyone[1].as_ref().unwrap();
    assert_eq!(
        e.transport().upgrade().unwrap().link_kind(0),
        world[1].as_ref().unwrap().transport().upgrade().unwrap().link_kind(0)
    );
}

#[test]
fn groups_on_shared_connections_run_at_once_without_mixing() {
    BOTH.into_iter().for_each(groups_on_shared_connections_run_at_once_without_mixing_on);
}

fn a_group_that_fails_breaks_itself_and_no_other_on(mode: TransportMode) {
    let world: Vec<Option<Engine>> = group_via(mode, 3, TIMEOUT).into_iter().map(Some).collect();
    let doomed = channel(&world, mode, "doomed", &[0, 1, 2]);
    let sibling = channel(&world, mode, "sibling", &[0, 1, 2]);
    // Warm every connection first: the sibling and the world then run on
    // connections that carried the abort (one connected later is told too: see below).
    for g in [&world, &doomed, &sibling] {
        let g: Vec<&Engine> = g.iter().map(|e| e.as_ref().unwrap()).collect();
        let out = std::thread::scope(|s| {
            let hs: Vec<_> = g
                .iter()
                .map(|e| {
                    s.spawn(move || {
                        let mut v = vec![1.0f32; 8];
                        all_reduce(e, raw(&mut v), DType::F32, ReduceOp::Sum).wait(None)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        assert!(out.iter().all(|w| *w == Waited::Done), "{out:?}");
    }
    // Rank 1 calls the doomed group's all_reduce with another length: every rank fails it.
    let t0 = Instant::now();
    let doomed_refs: Vec<&Engine> = doomed.iter().map(|e| e.as_ref().unwrap()).collect();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = doomed_refs
            .iter()
            .enumerate()
            .map(|(r, e)| {
                s.spawn(move || {
                    let mut v = vec![1.0f32; if r == 1 { 9 } else { 8 }];
                    all_reduce(e, raw(&mut v), DType::F32, ReduceOp::Sum).wait(None)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    for (r, w) in out.iter().enumerate() {
        assert!(matches!(w, Waited::Failed(_)), "rank {r}: the mismatched call must fail: {w:?}");
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "the failure must not wait for the timeout");
    // The sibling and the world go on, on the same connections.
    for g in [&sibling, &world] {
        let g: Vec<&Engine> = g.iter().map(|e| e.as_ref().unwrap()).collect();
        let sums = std::thread::scope(|s| {
            let hs: Vec<_> = g
                .iter()
                .enumerate()
                .map(|(r, e)| {
                    s.spawn(move || {
                        let mut v = vec![r as f32; 1000];
                        wait_ok(all_reduce(e, raw(&mut v), DType::F32, ReduceOp::Sum));
                        v[999]
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        assert_eq!(sums, vec![3.0; 3]);
    }
    // The doomed group stays broken.
    let mut v = vec![1.0f32; 8];
    match all_reduce(doomed_refs[0], raw(&mut v), DType::F32, ReduceOp::Sum).wait(None) {
        Waited::Failed(e) => assert!(e.message.contains("broken"), "{}", e.message),
        other => panic!("a broken group must refuse: {other:?}"),
    }
}

#[test]
fn a_group_that_fails_breaks_itself_and_no_other() {
    BOTH.into_iter().for_each(a_group_that_fails_breaks_itself_and_no_other_on);
}

fn send(e: &Engine, v: &mut [f32], dst: usize, tag: i64) -> OpHandle {
    // SAFETY: every caller waits for the handle before it lets go of `v`.
    unsafe { e.send(raw(v), dst, tag, None, None, noop()).unwrap() }
}

fn recv(e: &Engine, v: &mut [f32], src: Option<usize>, tag: i64, timeout: Duration) -> OpHandle {
    // SAFETY: every caller waits for the handle before it reads or lets go of `v`.
    unsafe { e.recv(raw(v), src, tag, Some(timeout), noop()).unwrap() }
}

/// Rank 1 leaves group "x" without receiving what rank 0 sent it there;
/// both make "x" again: the new group's receive gets the new message.
#[test]
fn a_closed_groups_late_messages_never_reach_a_new_group_of_its_name() {
    for mode in BOTH {
        let world: Vec<Option<Engine>> = group_via(mode, 2, TIMEOUT).into_iter().map(Some).collect();
        let old = channel(&world, mode, "x", &[0, 1]);
        let mut stale = vec![1.0f32; 4];
        wait_ok(send(old[0].as_ref().unwrap(), &mut stale, 1, 7));
        drop(old);
        let new = channel(&world, mode, "x", &[0, 1]);
        let mut got = vec![0.0f32; 4];
        let r = recv(new[1].as_ref().unwrap(), &mut got, Some(0), 7, TIMEOUT);
        std::thread::sleep(Duration::from_millis(50));
        let mut fresh = vec![2.0f32; 4];
        wait_ok(send(new[0].as_ref().unwrap(), &mut fresh, 1, 7));
        wait_ok(r);
        assert_eq!(got, vec![2.0; 4], "{mode:?}: the old group's message reached the new one");
    }
}

/// An any-source receive in a group names the sender by its rank in the group.
#[test]
fn an_any_source_receive_names_the_sender_by_its_rank_in_the_group() {
    let world: Vec<Option<Engine>> = group(3, TIMEOUT).into_iter().map(Some).collect();
    // Rank 0 of the group is world rank 2; rank 2 of the group is world rank 1.
    let g = channel(&world, TransportMode::Auto, "reordered", &[2, 0, 1]);
    let mut got = vec![0.0f32; 2];
    let r = recv(g[2].as_ref().unwrap(), &mut got, None, 3, TIMEOUT);
    let mut v = vec![5.0f32; 2];
    wait_ok(send(g[1].as_ref().unwrap(), &mut v, 0, 3));
    assert_eq!(r.wait(None), Waited::Done);
    assert_eq!((r.source_rank(), got), (2, vec![5.0; 2]), "group rank 2 is world rank 1");
}

/// A peer asked what it waits for in a group answers by the connections'
/// ranks (those the asker's connections know it by, and asks on in turn):
/// world rank 0 (group rank 1) waits for data from world rank 1 (group rank
/// 2); world rank 2, asking it, is told rank 1 and rank 1's address.
#[test]
fn a_peer_asked_what_it_waits_for_in_a_group_names_the_rank_it_waits_for() {
    let world: Vec<Option<Engine>> = group_via(TransportMode::Tcp, 3, TIMEOUT).into_iter().map(Some).collect();
    let transport = |g: &[Option<Engine>], rank: usize| g[rank].as_ref().unwrap().transport().upgrade().unwrap();
    let world_1 = transport(&world, 0).describe_peer(1);
    // Group rank r is world rank [2, 0, 1][r].
    let g = channel(&world, TransportMode::Tcp, "chain", &[2, 0, 1]);
    let (on_0, on_1, on_2) = (transport(&g, 0), transport(&g, 1), transport(&g, 2));
    let key = Key::collective(0, 0);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let what = "allreduce #0 on rank 1".to_string();
            let mut tr = Transfers::new(&*on_0, TIMEOUT, what, Duration::ZERO, Default::default());
            let id = tr.recv_owned(2, key, 8).unwrap();
            tr.wait(id).map(|()| tr.received(id).to_vec())
        });
        std::thread::sleep(Duration::from_millis(200));
        let told = on_2.ask(1).expect("world rank 0 answers");
        let want = format!("allreduce #0 on rank 1 was waiting for data from {world_1}");
        assert!(told.starts_with(&want), "told {told:?}, not {want:?}");
        let (status, seven) = (Status::new(), [7u8; 8]);
        // SAFETY: `seven` outlives the send, which is waited for below, before
        // the scope ends; it is not changed.
        unsafe { on_1.send(1, key, seven.as_ptr(), 8, status.clone(), Instant::now() + TIMEOUT, None) }.unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), [7u8; 8]);
        assert!(status.wait(Some(Instant::now() + TIMEOUT), Duration::ZERO).is_some());
    });
}

/// A rank that gives up on a group tells a member it has no connection to
/// yet once it has one: at W=4 over TCP, world ranks 0 and 2 are not
/// neighbours, so not connected, when rank 0 gives up on group "g"; rank 2's
/// receive from it fails once rank 2's send connects them, not at its timeout.
#[test]
fn a_member_that_connects_after_a_rank_gave_up_on_the_group_is_told() {
    let world: Vec<Option<Engine>> = group_via(TransportMode::Tcp, 4, TIMEOUT).into_iter().map(Some).collect();
    let g = channel(&world, TransportMode::Tcp, "g", &[0, 1, 2, 3]);
    let why = rustc10d::error::Error::aborted("rank 0 gave up on g");
    g[0].as_ref().unwrap().transport().upgrade().unwrap().abort_all(&why, 0);
    let t0 = Instant::now();
    let mut got = vec![0.0f32; 2];
    let r = recv(g[2].as_ref().unwrap(), &mut got, Some(0), 3, TIMEOUT);
    let mut v = vec![5.0f32; 2];
    wait_ok(send(g[2].as_ref().unwrap(), &mut v, 0, 3));
    match r.wait(None) {
        Waited::Failed(e) => assert!(e.message.contains("rank 0 gave up on g"), "{}", e.message),
        other => panic!("rank 2's receive from a rank that gave up must fail: {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "told at once, not at the timeout");
    assert_eq!(got, vec![0.0; 2], "a failed receive leaves its buffer as it was");
}
