//! What ops cost in counts that do not depend on the machine
//! (`rustc10d.stats()`'s copied_bytes, wakeups and early_bytes), over real
//! shared memory between ranks as threads (tests/rust/support/threads): each algorithm's
//! count, as its doc comment gives it, with single-copy reads of a peer's
//! memory (so the single-copy collectives) and without (the rings). A message that arrives before its receive costs one
//! copy more, so each count is checked against the formula plus the rank's
//! early bytes.
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../support/threads/mod.rs"]
mod threads;

use rustc10d::stats::OpStats;
use threads::*;

const W: usize = 3;
/// Bytes per rank block: whole 64 KiB segments, each sent as its address.
const BLOCK: usize = 256 << 10;
/// The call check of each collective: a 32-byte fingerprint sent to and
/// received from every peer, each copied once at either end.
const CHECK: usize = 2 * 32 * (W - 1);
/// An all-to-all's block sizes (`alltoall::agree_on_block_sizes`): W sent
/// and W expected, 8 bytes each, to and from every peer.
const BLOCK_SIZES: usize = 2 * 16 * W * (W - 1);

/// A group on one host, with single-copy reads of a peer's memory or not,
/// with a shared arena or not.
fn group_costed(single_copy: bool, arena: bool) -> Vec<Engine> {
    let cfg = Config {
        transport: TransportMode::Shm,
        segment_bytes: 64 << 10,
        single_copy_bytes: if single_copy { 64 << 10 } else { 0 },
        arena_slot_bytes: if arena { Config::default().arena_slot_bytes } else { 0 },
        ..Config::default()
    };
    group_with(W, Duration::from_secs(20), cfg)
}

fn op_stats(e: &Engine, kind: OpKind) -> OpStats {
    e.stats().snapshot().get(&kind).copied().unwrap_or_default()
}

/// Run `f` on every rank; return what `kind` cost each rank (this call only).
fn cost_of(engines: &[Engine], kind: OpKind, f: impl Fn(usize, &Engine) + Sync) -> Vec<OpStats> {
    let before: Vec<OpStats> = engines.iter().map(|e| op_stats(e, kind)).collect();
    on_all(engines, f);
    engines
        .iter()
        .zip(before)
        .map(|(e, b)| {
            let a = op_stats(e, kind);
            OpStats {
                count: a.count - b.count,
                copied_bytes: a.copied_bytes - b.copied_bytes,
                wakeups: a.wakeups - b.wakeups,
                early_bytes: a.early_bytes - b.early_bytes,
                ..a
            }
        })
        .collect()
}

/// Each rank copied `check` bytes for the call check, `expected(rank)` for
/// the data, and once more each byte that arrived before its receive.
fn assert_copied(what: &str, check: usize, got: &[OpStats], expected: impl Fn(usize) -> usize) {
    for (rank, s) in got.iter().enumerate() {
        assert_eq!(s.failed, 0);
        let want = (check + expected(rank)) as u64 + s.early_bytes;
        assert_eq!(s.copied_bytes, want, "{what}: rank {rank} copied (early bytes: {})", s.early_bytes);
    }
}

/// What each collective cost every rank, one call each (`each_collective`).
struct Costs {
    broadcast: Vec<OpStats>,
    all_gather: Vec<OpStats>,
    all_reduce: Vec<OpStats>,
    reduce_scatter: Vec<OpStats>,
    reduce: Vec<OpStats>,
    all_to_all: Vec<OpStats>,
    gather: Vec<OpStats>,
    scatter: Vec<OpStats>,
    small_all_reduce: Vec<OpStats>,
}

/// The payload: n bytes to broadcast, all-reduce and reduce; blocks of BLOCK
/// to gather, scatter-reduce and exchange; SMALL bytes to all-reduce.
const N: usize = W * BLOCK;
const SMALL: usize = 4096;

/// Run each collective once on every rank, its result checked; what each cost.
fn each_collective(engines: &[Engine]) -> Costs {
    let broadcast = cost_of(engines, OpKind::Broadcast, |rank, e| {
        let mut buf = vec![rank as u8; N];
        wait_ok(run(e, Collective::Broadcast { buf: raw(&mut buf), root: 0, dtype: rustc10d::dtype::BYTES }));
        assert!(buf.iter().all(|&b| b == 0));
    });
    let all_gather = cost_of(engines, OpKind::AllGather, |rank, e| {
        let mut input = vec![rank as u8 + 1; BLOCK];
        let mut out = vec![vec![0u8; BLOCK]; W];
        let outputs = out.iter_mut().map(|o| raw(o)).collect();
        wait_ok(run(e, Collective::AllGather { input: raw(&mut input), outputs, dtype: rustc10d::dtype::BYTES }));
        assert!(out.iter().enumerate().all(|(i, o)| o.iter().all(|&b| b == i as u8 + 1)));
    });
    let sum_of = |bytes: usize| {
        move |rank: usize, e: &Engine| {
            let mut buf = vec![rank as f32 + 1.0; bytes / 4];
            wait_ok(all_reduce(e, raw(&mut buf), DType::F32, ReduceOp::Sum));
            assert!(buf.iter().all(|&x| x == 6.0));
        }
    };
    let all_reduce = cost_of(engines, OpKind::AllReduce, sum_of(N));
    let reduce_scatter = cost_of(engines, OpKind::ReduceScatter, |rank, e| {
        let mut ins: Vec<Vec<f32>> = (0..W).map(|_| vec![rank as f32 + 1.0; BLOCK / 4]).collect();
        let mut out = vec![0f32; BLOCK / 4];
        let red = Reduction::new(DType::F32, ReduceOp::Sum);
        let inputs = ins.iter_mut().map(|i| raw(i)).collect();
        wait_ok(run(e, Collective::ReduceScatter { inputs, output: raw(&mut out), red }));
        assert!(out.iter().all(|&x| x == 6.0));
    });
    let reduce = cost_of(engines, OpKind::Reduce, |rank, e| {
        let mut buf = vec![rank as f32 + 1.0; N / 4];
        let red = Reduction::new(DType::F32, ReduceOp::Sum);
        wait_ok(run(e, Collective::Reduce { buf: raw(&mut buf), root: 0, red }));
        assert!(rank != 0 || buf.iter().all(|&x| x == 6.0));
    });
    let all_to_all = cost_of(engines, OpKind::AllToAll, |rank, e| {
        let mut ins: Vec<Vec<u8>> = (0..W).map(|p| vec![(rank * W + p) as u8; BLOCK]).collect();
        let mut outs = vec![vec![0u8; BLOCK]; W];
        let (inputs, outputs) = (ins.iter_mut().map(|i| raw(i)).collect(), outs.iter_mut().map(|o| raw(o)).collect());
        wait_ok(run(e, Collective::AllToAll { inputs, outputs, dtype: rustc10d::dtype::BYTES }));
        assert!(outs.iter().enumerate().all(|(p, o)| o.iter().all(|&b| b == (p * W + rank) as u8)));
    });
    let gather = cost_of(engines, OpKind::Gather, |rank, e| {
        let mut input = vec![rank as u8 + 1; BLOCK];
        let mut out = vec![vec![0u8; BLOCK]; if rank == 0 { W } else { 0 }];
        let outputs = out.iter_mut().map(|o| raw(o)).collect();
        wait_ok(run(e, Collective::Gather { input: raw(&mut input), outputs, root: 0, dtype: rustc10d::dtype::BYTES }));
        assert!(out.iter().enumerate().all(|(i, o)| o.iter().all(|&b| b == i as u8 + 1)));
    });
    let scatter = cost_of(engines, OpKind::Scatter, |rank, e| {
        let mut ins: Vec<Vec<u8>> = (0..if rank == 0 { W } else { 0 }).map(|p| vec![p as u8 + 1; BLOCK]).collect();
        let mut out = vec![0u8; BLOCK];
        let inputs = ins.iter_mut().map(|i| raw(i)).collect();
        wait_ok(run(e, Collective::Scatter { inputs, output: raw(&mut out), root: 0, dtype: rustc10d::dtype::BYTES }));
        assert!(out.iter().all(|&b| b == rank as u8 + 1));
    });
    let small_all_reduce = cost_of(engines, OpKind::AllReduce, sum_of(SMALL));
    Costs { broadcast, all_gather, all_reduce, reduce_scatter, reduce, all_to_all, gather, scatter, small_all_reduce }
}

fn counts_match_each_algorithm(single_copy: bool) {
    let engines = group_costed(single_copy, false);
    // Bytes a sender copies per byte it sends: none when the receiver reads its memory.
    let send = usize::from(!single_copy);
    let tag = if single_copy { "single copy" } else { "rings" };
    let (n, chunk) = (N, N / W);
    let c = each_collective(&engines);

    // Through the rings the root sends, and each other rank receives and,
    // but the last, forwards; with single copy every rank reads the root's.
    assert_copied(&format!("broadcast, {tag}"), CHECK, &c.broadcast, |rank| match rank {
        0 => send * n,
        r if r == W - 1 => n,
        _ => n + send * n,
    });
    // Its own block copied, W-1 blocks received and W-1 sent.
    assert_copied(&format!("all_gather, {tag}"), CHECK, &c.all_gather, |_| {
        BLOCK + (W - 1) * BLOCK + send * (W - 1) * BLOCK
    });
    // W-1 folded receives (read and fold) and W-1 plain ones, of n/W each; 2(W-1) sends.
    assert_copied(&format!("all_reduce, {tag}"), CHECK, &c.all_reduce, |_| {
        (W - 1) * 2 * chunk + (W - 1) * chunk + send * 2 * (W - 1) * chunk
    });
    // Its own block copied; W-1 steps each receive and fold a block; W-1 sends.
    assert_copied(&format!("reduce_scatter, {tag}"), CHECK, &c.reduce_scatter, |_| {
        BLOCK + 2 * (W - 1) * BLOCK + send * (W - 1) * BLOCK
    });
    // Reduce to rank 0 goes along the chain 1, 2, 0: rank 1 sends, rank 2
    // receives, folds in its own and sends on, the root receives and folds.
    assert_copied(&format!("reduce, {tag}"), CHECK, &c.reduce, |rank| match rank {
        1 => send * n,
        2 => 2 * n + send * n,
        _ => 2 * n,
    });
    // All-to-all: its own block copied, W-1 received, W-1 sent.
    assert_copied(&format!("all_to_all, {tag}"), CHECK + BLOCK_SIZES, &c.all_to_all, |_| {
        BLOCK + (W - 1) * BLOCK + send * (W - 1) * BLOCK
    });
    // Gather to rank 0: the root copies its own block and W-1 received; the others send theirs.
    assert_copied(&format!("gather, {tag}"), CHECK, &c.gather, |rank| match rank {
        0 => W * BLOCK,
        _ => send * BLOCK,
    });
    // Scatter from rank 0: the root copies its own block and sends W-1; the others receive one.
    assert_copied(&format!("scatter, {tag}"), CHECK, &c.scatter, |rank| match rank {
        0 => BLOCK + send * (W - 1) * BLOCK,
        _ => BLOCK,
    });
    // A small all-reduce: one exchange of whole buffers, through the rings.
    assert_copied(&format!("small all_reduce, {tag}"), CHECK, &c.small_all_reduce, |_| 2 * SMALL + 3 * (W - 1) * SMALL);

    // Point to point, the receive posted first (so nothing arrives early):
    // the receiver copies once; the sender once more without single copy.
    let posted = std::sync::Barrier::new(2);
    let got = cost_of(&engines, OpKind::Send, |rank, e| {
        let mut buf = vec![7u8; n];
        if rank == 0 {
            posted.wait();
            // SAFETY: `buf` outlives the send, waited for at once, and is not changed.
            wait_ok(unsafe { e.send(raw(&mut buf), 1, 5, None, None, noop()).unwrap() });
        } else if rank == 1 {
            buf.fill(0);
            // SAFETY: `buf` outlives the receive, waited for below before it is read.
            let h = unsafe { e.recv(raw(&mut buf), Some(0), 5, None, noop()).unwrap() };
            posted.wait();
            wait_ok(h);
            assert!(buf.iter().all(|&b| b == 7));
        }
    });
    assert_eq!(got[0].copied_bytes, (send * n) as u64, "send, {tag}");
    let received = engines.iter().map(|e| op_stats(e, OpKind::Recv)).collect::<Vec<_>>();
    assert_eq!(received[1].copied_bytes, n as u64, "recv, {tag}");
    assert_eq!(received[1].early_bytes, 0);
}

#[test]
fn copied_bytes_match_each_algorithm_with_single_copy() {
    counts_match_each_algorithm(true);
}

#[test]
fn copied_bytes_match_each_algorithm_through_the_rings() {
    counts_match_each_algorithm(false);
}

/// The arena's algorithms (src/algorithms/arena_*.rs give the formulas):
/// the call check copies nothing, every rank copies its part into its slot
/// once and out once; folds read a slice of every slot.
#[test]
fn copied_bytes_match_each_algorithm_in_the_arena() {
    let engines = group_costed(false, true);
    let n = N;
    let c = each_collective(&engines);
    assert_copied("broadcast, arena", 0, &c.broadcast, |_| n);
    assert_copied("all_gather, arena", 0, &c.all_gather, |_| (W + 1) * BLOCK);
    // Into the slot, W-1 slices of n/W folded into its own, out.
    assert_copied("all_reduce, arena", 0, &c.all_reduce, |_| n + (W - 1) * n / W + n);
    // W blocks into the slot; W parts folded into the output.
    assert_copied("reduce_scatter, arena", 0, &c.reduce_scatter, |_| 2 * W * BLOCK);
    // As the all-reduce, but only the root copies out.
    assert_copied("reduce, arena", 0, &c.reduce, |rank| n + (W - 1) * n / W + if rank == 0 { n } else { 0 });
    // The blocks for the others into the slot and out; its own straight across.
    assert_copied("all_to_all, arena", 0, &c.all_to_all, |_| (2 * W - 1) * BLOCK);
    // Gather and scatter: W blocks through the root, one through each other rank.
    let through_root = |rank: usize| if rank == 0 { W * BLOCK } else { BLOCK };
    assert_copied("gather, arena", 0, &c.gather, through_root);
    assert_copied("scatter, arena", 0, &c.scatter, through_root);
    // A small all-reduce: one stage, every rank folds every slot.
    assert_copied("small all_reduce, arena", 0, &c.small_all_reduce, |_| 2 * SMALL + (W - 1) * SMALL);
}

/// In place, a rank's own block already holds its part: the arena's
/// all-gather and all-to-all copy none of it (the others' still go through
/// the slots).
#[test]
fn in_place_the_arena_copies_nothing_of_a_ranks_own_block() {
    let engines = group_costed(false, true);
    let all_gather = cost_of(&engines, OpKind::AllGather, |rank, e| {
        let mut out: Vec<Vec<u8>> = (0..W).map(|p| vec![if p == rank { rank as u8 + 1 } else { 0 }; BLOCK]).collect();
        let input = raw(&mut out[rank]);
        let outputs = out.iter_mut().map(|o| raw(o)).collect();
        wait_ok(run(e, Collective::AllGather { input, outputs, dtype: rustc10d::dtype::BYTES }));
        assert!(out.iter().enumerate().all(|(p, o)| o.iter().all(|&b| b == p as u8 + 1)));
    });
    assert_copied("all_gather in place, arena", 0, &all_gather, |_| W * BLOCK);
    let all_to_all = cost_of(&engines, OpKind::AllToAll, |rank, e| {
        let mut ins: Vec<Vec<u8>> = (0..W).map(|p| vec![(rank * W + p) as u8; BLOCK]).collect();
        let mut outs = vec![vec![0u8; BLOCK]; W];
        outs[rank] = ins[rank].clone();
        let inputs = (0..W).map(|p| if p == rank { raw(&mut outs[rank]) } else { raw(&mut ins[p]) }).collect();
        let outputs = outs.iter_mut().map(|o| raw(o)).collect();
        wait_ok(run(e, Collective::AllToAll { inputs, outputs, dtype: rustc10d::dtype::BYTES }));
        assert!(outs.iter().enumerate().all(|(p, o)| o.iter().all(|&b| b == (p * W + rank) as u8)));
    });
    assert_copied("all_to_all in place, arena", 0, &all_to_all, |_| 2 * (W - 1) * BLOCK);
}

/// A rank waiting in the arena sleeps once per stage at most, however many
/// ranks arrive after it: only the last arrival wakes it.
#[test]
fn in_the_arena_a_late_rank_costs_the_others_one_wakeup_per_stage() {
    let cfg = Config { transport: TransportMode::Shm, spin: Duration::ZERO, single_copy_bytes: 0, ..Config::default() };
    let engines = group_with(4, Duration::from_secs(10), cfg);
    let got = cost_of(&engines, OpKind::AllReduce, |rank, e| {
        // Ranks arrive one after another.
        std::thread::sleep(Duration::from_millis(30 * rank as u64));
        let mut buf = vec![1f32; 256 << 10];
        wait_ok(all_reduce(e, raw(&mut buf), DType::F32, ReduceOp::Sum));
        assert!(buf.iter().all(|&x| x == 4.0));
    });
    // One round of two stages (1 MiB in 1 MiB slots).
    for (rank, s) in got.iter().enumerate() {
        assert!(s.wakeups <= 2, "rank {rank} woke {} times", s.wakeups);
    }
    assert!(got[0].wakeups >= 1, "rank 0 waited 90 ms without sleeping: {:?}", got[0]);
}

#[test]
fn a_receive_that_waits_sleeps_and_says_so() {
    let cfg = Config { transport: TransportMode::Shm, spin: Duration::ZERO, ..Config::default() };
    let engines = group_with(2, Duration::from_secs(10), cfg);
    on_all(&engines, |rank, e| {
        let mut buf = vec![1u8; 64];
        if rank == 0 {
            std::thread::sleep(Duration::from_millis(100));
            // SAFETY: `buf` outlives the send, waited for at once, and is not changed.
            wait_ok(unsafe { e.send(raw(&mut buf), 1, 0, None, None, noop()).unwrap() });
        } else {
            // SAFETY: `buf` outlives the receive, waited for at once, before it is read.
            wait_ok(unsafe { e.recv(raw(&mut buf), Some(0), 0, None, noop()).unwrap() });
        }
    });
    let recv = op_stats(&engines[1], OpKind::Recv);
    assert!(recv.wakeups >= 1, "the receiver slept for 100 ms: {recv:?}");
    // A message read by a thread that does not poll: the receive was posted first.
    assert_eq!((recv.copied_bytes, recv.early_bytes), (64, 0));
}
