//! Mismatched calls are caught before any data is used: every collective
//! first sends a fingerprint of how it was called (op, dtype, reduce op,
//! root, size) and compares those it receives. A rank that starts has seen
//! every rank's call match its own, so a mismatch anywhere fails every rank
//! before any buffer changes: at 2 ranks, from the one peer; from 3, from
//! every rank (with only its left neighbour's, a rank whose neighbour
//! matched went on: at 3 ranks a reduce's sender returned success, and an
//! all-gather wrote a matching peer's block before the abort from the third
//! reached it; around a larger ring, ranks 1 and 2 could fold each other's
//! data). The ranks of a host that
//! share an arena compare there, in one round, and by message only with
//! the other hosts' ranks; where every host holds as many ranks, each with
//! an arena, only with their counterparts there, before that round (H - 1
//! messages a rank instead of W - L). A rank with more than 16 ranks to
//! hear from by message hears from them in ⌈log2 n⌉ rounds of one message
//! instead of all at once. The smallest all-reduces check all peers'
//! fingerprints alongside their data exchange instead (`Agreement`); on
//! several hosts, those of their host's ranks, their counterparts on the
//! other hosts and their left neighbour, their sums made in scratch. In a
//! group with a shared arena every rank compares every other's there
//! instead (`in_arena`).

use super::hosts::Hosts;
use super::{in_arena, OpCtx};
use crate::error::{Error, ErrorKind, Result};
use crate::ops::RawBuf;
use crate::ops::{Collective, OpKind, Reduction};
use crate::transport::group::subgroup::Subgroup;
use crate::transport::{Key, TransferId, Transfers};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    pub op: OpKind,
    /// DType code, or NONE where the op has no data (barriers).
    pub dtype: u8,
    /// ReduceOp code (PREMUL_SUM as 8), or NONE.
    pub reduce: u8,
    pub root: u32,
    /// The byte count every rank must agree on (0 where sizes may differ).
    pub bytes: u64,
    /// The piece size of an op staged in pieces (0: whole). Pieces have
    /// keys of their own, so every rank must cut the same way.
    pub piece: u64,
    /// A sparse all-reduce's tensor shape (`SparseShape::digest`); 0 otherwise.
    pub shape: u64,
}

impl Fingerprint {
    pub const NONE: u8 = u8::MAX;
    pub(super) const LEN: usize = 32;

    /// How this rank was called.
    pub fn of(call: &Collective) -> Fingerprint {
        const NONE: u8 = Fingerprint::NONE;
        let reduce = |red: &Reduction| if red.premul.is_some() { 8 } else { red.op as u8 };
        let total = |bufs: &[RawBuf]| bufs.iter().map(|b| b.len as u64).sum::<u64>();
        let mut shape = 0;
        let (dtype, op, root, bytes) = match call {
            Collective::AllReduce { buf, red } => (red.dtype as u8, reduce(red), None, buf.len as u64),
            Collective::Reduce { buf, root, red } => (red.dtype as u8, reduce(red), Some(*root), buf.len as u64),
            // Ops that only move bytes still compare the dtype: the same bytes
            // read as another type are garbage, not an error.
            Collective::Broadcast { buf, root, dtype } => (*dtype, NONE, Some(*root), buf.len as u64),
            Collective::AllGather { outputs, dtype, .. } => (*dtype, NONE, None, total(outputs)),
            Collective::Gather { input, root, dtype, .. } => (*dtype, NONE, Some(*root), input.len as u64),
            Collective::Scatter { output, root, dtype, .. } => (*dtype, NONE, Some(*root), output.len as u64),
            Collective::ReduceScatter { output, red, .. } => (red.dtype as u8, reduce(red), None, output.len as u64),
            // Block sizes legitimately differ per rank: each pair's are
            // compared by the algorithm (`alltoall::agree_on_block_sizes`).
            Collective::AllToAll { dtype, .. } => (*dtype, NONE, None, 0),
            Collective::Barrier | Collective::MonitoredBarrier { .. } => (NONE, NONE, None, 0),
            // Rows differ per rank; the tensor's shape, and so the size of a row of values, may not.
            Collective::AllReduceSparse { dtype, shape: s, .. } => {
                shape = s.digest();
                (*dtype as u8, 0, None, s.value_row as u64)
            }
        };
        let root = root.map_or(u32::MAX, |r| r as u32);
        Fingerprint { op: call.kind(), dtype, reduce: op, root, bytes, piece: 0, shape }
    }

    pub(super) fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0] = self.op.code();
        b[1] = self.dtype;
        b[2] = self.reduce;
        b[4..8].copy_from_slice(&self.root.to_le_bytes());
        b[8..16].copy_from_slice(&self.bytes.to_le_bytes());
        b[16..24].copy_from_slice(&self.piece.to_le_bytes());
        b[24..32].copy_from_slice(&self.shape.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8; Self::LEN]) -> Result<Fingerprint> {
        let op = OpKind::from_code(b[0]).ok_or_else(|| Error::io(format!("unknown op code {}", b[0])))?;
        Ok(Fingerprint {
            op,
            dtype: b[1],
            reduce: b[2],
            root: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            bytes: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            piece: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            shape: u64::from_le_bytes(b[24..32].try_into().unwrap()),
        })
    }

    /// "allreduce(4096 bytes, dtype torch.float32, op SUM)".
    pub fn describe(&self) -> String {
        let per = if self.op == OpKind::AllReduceSparse { " per row" } else { "" };
        let mut parts = vec![format!("{} bytes{per}", self.bytes)];
        if self.dtype != Self::NONE {
            parts.push(format!("dtype {}", crate::dtype::type_name(self.dtype)));
        }
        if self.reduce != Self::NONE {
            let name = crate::dtype::ReduceOp::from_code(self.reduce).map(|o| o.name()).unwrap_or("PREMUL_SUM");
            parts.push(format!("op {name}"));
        }
        if self.root != u32::MAX {
            parts.push(format!("root {}", self.root));
        }
        if self.piece != 0 {
            parts.push(format!("staged in pieces of {} bytes", self.piece));
        }
        if self.shape != 0 {
            parts.push(format!("sizes digest {:016x}", self.shape));
        }
        format!("{}({})", self.op.name(), parts.join(", "))
    }
}

/// Up to this many peers to hear from, a rank tells each its call at once
/// and hears from each (one hop, as the direct all-reduce does); beyond, it
/// takes rounds of one message each (`agree_in_rounds`), so that a large
/// group does not pay a message per rank on every op.
const AT_ONCE_MAX: usize = 16;

/// Check the call against every rank's before the op starts (see the top
/// of this file): in the group's shared arena, where it has one; else with
/// every rank. Fail if one differs.
pub fn agree(ctx: &OpCtx, mine: &Fingerprint) -> Result<()> {
    if let Some(arena) = ctx.transport.arena() {
        return in_arena::agree(ctx, &arena, mine);
    }
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    if world <= 2 {
        return agree_with(ctx, Agreement::new(mine, false), || Ok(()));
    }
    let everyone = || (0..world).collect::<Vec<_>>();
    let Some((arena, mates)) = ctx.transport.shared_arena().map(|(a, m)| (a, m.to_vec())) else {
        return agree_among(ctx, mine, &everyone());
    };
    let on_host = Subgroup::new(ctx.transport, mates.clone());
    let in_host_arena = || in_arena::agree(&ctx.phase(&on_host, 1), &arena, mine);
    let hosts = Hosts::of(ctx.transport);
    match hosts.per_host().filter(|_| ctx.transport.arena_on_every_host()) {
        // Hosts of L ranks, each with its arena: a rank checks its
        // counterparts' calls, then arrives in its host's arena, whose
        // round compares its host's calls. A rank that passes that round
        // has seen every rank of its host arrive, each having checked its
        // counterparts: every call matches its own, with H - 1 messages.
        Some(_) => {
            agree_among(ctx, mine, &hosts.counterparts(hosts.locate(rank).1))?;
            in_host_arena()
        }
        // Otherwise by message with every rank off this rank's host, and
        // in the arena with those on it (in a large group, with everyone
        // in rounds). Each rank tells exactly those that hear from it: the
        // ranks off its host, where the host has an arena, or every rank.
        None if world - 1 <= AT_ONCE_MAX => {
            let others: Vec<usize> = (0..world).filter(|p| *p != rank && !mates.contains(p)).collect();
            let agreement = Agreement::with(mine, Peers::Listed { from: others.clone(), to: others });
            agree_with(ctx, agreement, in_host_arena)
        }
        None => agree_among(ctx, mine, &everyone()),
    }
}

/// Check the call with every rank of `members` (this rank among them, the
/// same list on each of them): at once, or in rounds where they are many.
fn agree_among(ctx: &OpCtx, mine: &Fingerprint, members: &[usize]) -> Result<()> {
    let n = members.len();
    let me = members.iter().position(|&r| r == ctx.transport.rank()).expect("a member");
    if n - 1 > AT_ONCE_MAX {
        return agree_in_rounds(ctx, mine, members, me);
    }
    // Counting down from the left neighbour, as the ring's check hears from it first.
    let from = (1..n).map(|k| members[(me + n - k) % n]).collect();
    let to = (1..n).map(|k| members[(me + k) % n]).collect();
    agree_with(ctx, Agreement::with(mine, Peers::Listed { from, to }), || Ok(()))
}

/// The check among many `members` (this rank is `members[me]`), as a
/// dissemination barrier goes: in round k, member m tells member m + 2^k
/// and hears from member m - 2^k, and goes on only if that call matches
/// its own. A member tells only once everything it heard matched, so after
/// round k it has heard, directly or through others, from the 2^(k+1) - 1
/// members before it: after ⌈log2 n⌉ rounds, from all. A member that finds
/// a difference fails and tells nobody more, so the members waiting for
/// it fail when the group breaks.
fn agree_in_rounds(ctx: &OpCtx, mine: &Fingerprint, members: &[usize], me: usize) -> Result<()> {
    let n = members.len();
    let out = mine.encode();
    let (mut step, mut round) = (1, 0);
    while step < n {
        let (to, from) = (members[(me + step) % n], members[(me + n - step) % n]);
        // Keys apart from the one-message check's (u64::MAX) and the algorithms'.
        let key = Key::collective(ctx.seq, u64::MAX - 1 - round);
        let tr = &mut ctx.transfers();
        let id = tr.recv_owned(from, key, Fingerprint::LEN)?;
        tr.send_copy(to, key, &out)?;
        tr.wait(id)?;
        let theirs = Fingerprint::decode(tr.received(id).try_into().expect("a fingerprint's length"))
            .map_err(|e| unreadable(ctx, from, mine, e))?;
        if theirs != *mine {
            return Err(mismatch(ctx, from, mine.describe(), theirs.describe()));
        }
        tr.wait_all()?;
        (step, round) = (step * 2, round + 1);
    }
    Ok(())
}

/// Post `agreement`, do `meanwhile`, then check it.
fn agree_with(ctx: &OpCtx, mut agreement: Agreement, meanwhile: impl FnOnce() -> Result<()>) -> Result<()> {
    let tr = &mut ctx.transfers();
    agreement.post(ctx, tr);
    meanwhile()?;
    agreement.check(ctx, tr)?;
    tr.wait_all()
}

/// `agree` with every rank, on the op's `tr`: for algorithms whose data
/// comes from every rank, before any of it moves.
pub fn agree_with_all(ctx: &OpCtx, tr: &mut Transfers, mine: &Fingerprint) -> Result<()> {
    if let Some(arena) = ctx.transport.arena() {
        return in_arena::agree(ctx, &arena, mine);
    }
    let mut agreement = Agreement::new(mine, true);
    agreement.post(ctx, tr);
    agreement.check(ctx, tr)
}

/// `agree` in two halves, for an algorithm that overlaps the exchange with
/// its own first messages: `post` queues it, `check` waits for the
/// fingerprints and compares. No received data may be used, and nothing of
/// the caller's written, before `check` passes. The Agreement must outlive
/// the Transfers it was posted on.
///
/// With `with_all`, every rank sends its fingerprint to every other rank and
/// checks them all: an algorithm whose data arrives from every peer before
/// its check must not trust a peer that only its own neighbour could vouch
/// for. The left neighbour's is checked first: it is sent in both modes, so
/// a mismatch with a rank that checks only its neighbours is still caught.
///
/// The fingerprints travel in memory the Transfers owns, so an Agreement
/// may end before the sends it posted do (a peer may read ours late).
///
/// A peer this rank cannot reach does not end the check at once: a rank
/// that found the mismatch may already have left the group, before a slow
/// rank that never linked to it dialled it ("connection refused"), and the
/// mismatch is what every rank must name. So every fingerprint is posted
/// whatever fails, and `check` looks at those that come within `GRACE` of
/// the first failure before it reports that failure.
pub struct Agreement {
    mine: Fingerprint,
    peers: Peers,
    /// (peer, the receive of its fingerprint), the left neighbour first.
    theirs: Vec<(usize, TransferId)>,
    /// Why a fingerprint could not be posted, the first such failure.
    unposted: Option<Error>,
}

/// How long a rank that failed to hear from (or tell) a peer still waits
/// for the other peers' fingerprints, for a mismatch that explains the
/// failure: long enough for a peer already in the op, short beside a timeout.
const GRACE: Duration = Duration::from_secs(1);

/// Whom an Agreement hears from and tells.
enum Peers {
    /// The ring neighbours, or (`true`) every rank.
    Ring { with_all: bool },
    /// These ranks (the left neighbour first), and these; each rank that
    /// hears from a rank must be among those that rank tells.
    Listed { from: Vec<usize>, to: Vec<usize> },
}

impl Agreement {
    pub fn new(mine: &Fingerprint, with_all: bool) -> Agreement {
        Agreement::with(mine, Peers::Ring { with_all })
    }

    /// Hear from the left neighbour and `others`; tell the right one and
    /// `others` (ranks that list each other; this rank may be among them).
    pub fn among(mine: &Fingerprint, ctx: &OpCtx, others: &[usize]) -> Agreement {
        let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
        let listed = |first: usize| -> Vec<usize> {
            let rest = others.iter().copied().filter(|&p| p != first);
            std::iter::once(first).chain(rest).filter(|&p| p != rank).collect()
        };
        let (from, to) = (listed((rank + world - 1) % world), listed((rank + 1) % world));
        Agreement::with(mine, Peers::Listed { from, to })
    }

    fn with(mine: &Fingerprint, peers: Peers) -> Agreement {
        Agreement { mine: *mine, peers, theirs: Vec::new(), unposted: None }
    }

    /// Post this rank's side: a peer that cannot be reached fails `check`.
    pub fn post(&mut self, ctx: &OpCtx, tr: &mut Transfers) {
        let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
        let key = Key::collective(ctx.seq, u64::MAX);
        let (from, to): (Vec<usize>, Vec<usize>) = match &self.peers {
            Peers::Ring { with_all } => {
                let count = if *with_all { world - 1 } else { world.min(2) - 1 };
                // Peers counting down from the left neighbour; we send to those counting up from the right.
                (
                    (1..=count).map(|k| (rank + world - k) % world).collect(),
                    (1..=count).map(|k| (rank + k) % world).collect(),
                )
            }
            Peers::Listed { from, to } => (from.clone(), to.clone()),
        };
        let mut unposted = None;
        let mut keep = |r: Result<()>| {
            if let Err(e) = r {
                unposted.get_or_insert(e);
            }
        };
        self.theirs.clear();
        for peer in from {
            keep(tr.recv_owned(peer, key, Fingerprint::LEN).map(|id| self.theirs.push((peer, id))));
        }
        let out = self.mine.encode();
        for peer in to {
            keep(tr.send_copy(peer, key, &out).map(drop));
        }
        self.unposted = unposted;
    }

    pub fn check(&self, ctx: &OpCtx, tr: &Transfers) -> Result<()> {
        self.check_after(ctx, tr, self.unposted.clone())
    }

    /// The error of a rank that failed (`e`) after `post`, before `check`:
    /// the mismatch that explains it, where a fingerprint shows one.
    pub fn explain(&self, ctx: &OpCtx, tr: &Transfers, e: Error) -> Error {
        let first = match &self.unposted {
            Some(u) if tells_more(u, &e) => u.clone(),
            _ => e,
        };
        self.check_after(ctx, tr, Some(first.clone())).err().unwrap_or(first)
    }

    fn check_after(&self, ctx: &OpCtx, tr: &Transfers, mut failed: Option<Error>) -> Result<()> {
        let mut grace = failed.as_ref().map(|_| Instant::now() + GRACE);
        for &(peer, id) in &self.theirs {
            let waited = match grace {
                None => tr.wait(id),
                Some(until) => match tr.finished_by(id, until) {
                    Some(r) => r,
                    None => continue,
                },
            };
            if let Err(e) = waited {
                grace.get_or_insert_with(|| Instant::now() + GRACE);
                if failed.as_ref().is_none_or(|f| tells_more(&e, f)) {
                    failed = Some(e);
                }
                continue;
            }
            let theirs = Fingerprint::decode(tr.received(id).try_into().expect("a fingerprint's length"))
                .map_err(|e| unreadable(ctx, peer, &self.mine, e))?;
            if theirs != self.mine {
                return Err(mismatch(ctx, peer, self.mine.describe(), theirs.describe()));
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

/// Whether `e` says more of why the check failed than `than`: a peer's own
/// word (it gave up on the group, saying why: often the mismatch it saw)
/// says more than this rank's failure to reach a peer, or a timeout.
fn tells_more(e: &Error, than: &Error) -> bool {
    let weight = |k: ErrorKind| match k {
        ErrorKind::Mismatch => 2,
        ErrorKind::PeerLost => 1,
        _ => 0,
    };
    weight(e.kind) > weight(than.kind)
}

/// The error of a call on this rank that does not match `peer`'s.
pub(super) fn mismatch(ctx: &OpCtx, peer: usize, mine: String, theirs: String) -> Error {
    let rank = ctx.transport.rank();
    mismatch_across(ctx, peer, format!("rank {rank} called {mine}, rank {peer} called {theirs}"))
}

/// The error of calls that do not fit together across ranks, as `what`
/// (every rank that sees it says the same), naming `peer`, a rank involved.
pub(super) fn mismatch_across(ctx: &OpCtx, peer: usize, what: String) -> Error {
    Error::new(ErrorKind::Mismatch, format!("rustc10d: {} does not match the call on rank {peer}: {what}", ctx.what))
}

/// The error of a fingerprint from `peer` that does not decode (an op code
/// this rank does not know): a mismatch like any other, naming the peer, and
/// not a bare "unknown op code" that says nothing of where it came from.
fn unreadable(ctx: &OpCtx, peer: usize, mine: &Fingerprint, e: Error) -> Error {
    mismatch(ctx, peer, mine.describe(), format!("something this rank cannot read ({})", e.message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_description() {
        let f = Fingerprint { op: OpKind::Reduce, dtype: 0, reduce: 4, root: 2, bytes: 4096, piece: 1 << 20, shape: 0 };
        assert_eq!(Fingerprint::decode(&f.encode()).unwrap(), f);
        assert_eq!(
            f.describe(),
            "reduce(4096 bytes, dtype torch.float32, op MAX, root 2, staged in pieces of 1048576 bytes)"
        );
        let b = Fingerprint {
            op: OpKind::Barrier,
            dtype: Fingerprint::NONE,
            reduce: Fingerprint::NONE,
            root: u32::MAX,
            bytes: 0,
            piece: 0,
            shape: 0,
        };
        assert_eq!(b.describe(), "barrier(0 bytes)");
    }

    // A fingerprint is a peer's word: any 32 bytes decode or are refused
    // (an op code that does not exist), never panic, and describe
    // themselves whatever their dtype or reduce op; what decodes re-encodes
    // to the bytes it came from (but byte 3, which no field uses), and
    // every fingerprint round-trips.
    proptest::proptest! {
        #[test]
        fn fingerprints_take_any_bytes(b in proptest::prelude::any::<[u8; Fingerprint::LEN]>()) {
            match Fingerprint::decode(&b) {
                Ok(f) => {
                    proptest::prop_assert_eq!(f.op.code(), b[0]);
                    let mut unused_cleared = b;
                    unused_cleared[3] = 0;
                    proptest::prop_assert_eq!(f.encode(), unused_cleared);
                    proptest::prop_assert!(f.describe().starts_with(f.op.name()));
                }
                Err(e) => {
                    proptest::prop_assert!(OpKind::from_code(b[0]).is_none());
                    let says = format!("unknown op code {}", b[0]);
                    proptest::prop_assert!(e.message.contains(&says), "{}", e.message);
                }
            }
        }

        #[test]
        fn fingerprints_roundtrip(op in 0..OpKind::ALL.len(), dtype in proptest::prelude::any::<u8>(),
                                  reduce in proptest::prelude::any::<u8>(), root in proptest::prelude::any::<u32>(),
                                  words in proptest::prelude::any::<[u64; 3]>()) {
            let f = Fingerprint { op: OpKind::ALL[op], dtype, reduce, root, bytes: words[0], piece: words[1], shape: words[2] };
            proptest::prop_assert_eq!(Fingerprint::decode(&f.encode()).unwrap(), f);
        }
    }
}
