//! An op's rounds in the group's shared arena (`transport::arena`), for the
//! algorithms that run there: each round's tag says how this rank was
//! called and where in the op the round is; once the round's first stage
//! has passed, every rank compares every other rank's tag with its own, so a
//! mismatched call fails on every rank before anything a peer wrote is
//! used. The arena's failures become errors that name the op, the rank and
//! the peer. `agree` is a round with nothing else in it: the call check of
//! the ops that move their data elsewhere.

use super::call_check::{mismatch, Fingerprint};
use super::{segment, OpCtx};
use crate::error::{Error, Result};
use crate::transport::group::arena::{Arena, Round, Shape, Stuck, TAG_BYTES};
use crate::transport::group::waits::in_turn;
use crate::transport::{Wait, WaitOn};
use std::time::{Duration, Instant};

/// How long a stage polls without yielding the core before it notes whom it
/// waits for and polls as `Round::wait` does: peers that run in step arrive
/// within a few microseconds of each other, and a look at the clock, the
/// noting, and a yield each cost about as much.
const BUSY: Duration = Duration::from_micros(50);

/// One round of an op in the arena.
pub struct InArena<'a> {
    ctx: &'a OpCtx<'a>,
    round: Round<'a>,
    mine: [u8; TAG_BYTES],
    deadline: Instant,
    checked: bool,
}

/// Round `index` of the op `ctx` runs (called as `fp` says), its slots
/// touched as `shape` says, ending by `deadline`.
pub fn round<'a>(
    ctx: &'a OpCtx<'a>,
    arena: &'a Arena,
    fp: &Fingerprint,
    index: u64,
    shape: Shape,
    deadline: Instant,
) -> Result<InArena<'a>> {
    let mine = tag(fp, ctx.seq, ctx.piece, index);
    let round = arena.round(&mine, shape).map_err(|stuck| failed(ctx, stuck))?;
    Ok(InArena { ctx, round, mine, deadline, checked: false })
}

/// Run `each(round, k)` for round k of an op that moves up to `bytes` per
/// slot, `per_round` of them each round (in rounds of `shape`): at least
/// one round, so that even an op with nothing to move checks its call.
pub fn in_rounds(
    ctx: &OpCtx,
    arena: &Arena,
    fp: &Fingerprint,
    (bytes, per_round): (usize, usize),
    shape: Shape,
    mut each: impl FnMut(&mut InArena, usize) -> Result<()>,
) -> Result<()> {
    let deadline = ctx.deadline;
    for k in 0..bytes.div_ceil(per_round).max(1) {
        each(&mut round(ctx, arena, fp, k as u64, shape, deadline)?, k)?;
    }
    Ok(())
}

/// Check the call with every rank of the group in one round.
pub fn agree(ctx: &OpCtx, arena: &Arena, mine: &Fingerprint) -> Result<()> {
    let deadline = ctx.deadline;
    round(ctx, arena, mine, 0, Shape::Gather, deadline)?.stage()
}

impl InArena<'_> {
    /// This rank's own slot, to write before the first stage (`Round::own`).
    pub fn own(&mut self) -> &mut [u8] {
        self.round.own()
    }

    /// Every other rank's slot, to write at a scatter's root (`Round::others_mut`).
    pub fn others_mut(&mut self) -> Vec<Option<&mut [u8]>> {
        self.round.others_mut()
    }

    /// This rank's column of its slot and of the others' (`Round::columns`).
    pub fn columns(&mut self) -> (&mut [u8], Vec<&[u8]>) {
        self.round.columns()
    }

    /// The slot of `rank`, to read after the round's writes (`Round::slot`).
    pub fn slot(&self, rank: usize) -> &[u8] {
        self.round.slot(rank)
    }

    /// Arrive, wait for every rank; after the first stage, check every tag.
    /// A wait that outlasts a busy poll of `BUSY` is noted: while it goes
    /// on, a peer that asks what this rank waits for hears of a rank that
    /// had not arrived (`Transport::ask`).
    pub fn stage(&mut self) -> Result<()> {
        let ctx = self.ctx;
        if !self.round.arrive() {
            let passed = match self.round.wait_busy(ctx.spin.min(BUSY)) {
                Some(passed) => passed.map_err(|stuck| failed(ctx, stuck)),
                None => self.wait_noted(),
            };
            passed?;
        }
        if !self.checked {
            self.checked = true;
            for peer in ctx.peers() {
                let theirs = self.round.tag(peer);
                if theirs != self.mine {
                    return Err(mismatch(ctx, peer, describe(&self.mine), describe(&theirs)));
                }
            }
        }
        Ok(())
    }

    fn wait_noted(&mut self) -> Result<()> {
        let (ctx, t) = (self.ctx, self.ctx.transport);
        let noted = self.round.late().map(|peer| {
            t.begin_wait(Wait { what: ctx.what.to_string(), peer, on: WaitOn::Arena, since: Instant::now() })
        });
        let passed = self.round.wait(self.deadline, ctx.spin, ctx.cost).map_err(|stuck| failed(ctx, stuck));
        if let Some(id) = noted {
            t.end_wait(id, passed.as_ref().err().map(|e| e.message.clone()));
        }
        passed
    }
}

/// Round `k`'s part of `len` bytes when every round takes `per_round` of
/// them (empty once they are done): segment k, as a range.
pub fn part(len: usize, per_round: usize, k: usize) -> std::ops::Range<usize> {
    let (off, n) = segment(len, per_round, k);
    off..off + n
}

/// Round `k`'s part of `buf` (see `part`), to write.
pub fn part_mut(buf: &mut [u8], per_round: usize, k: usize) -> &mut [u8] {
    let at = part(buf.len(), per_round, k);
    &mut buf[at]
}

/// The tag of round `index` of collective `seq` (its piece `piece`), called as `fp` says.
fn tag(fp: &Fingerprint, seq: u64, piece: u64, index: u64) -> [u8; TAG_BYTES] {
    let mut t = [0u8; TAG_BYTES];
    t[..Fingerprint::LEN].copy_from_slice(&fp.encode());
    for (i, v) in [seq, piece, index].into_iter().enumerate() {
        let at = Fingerprint::LEN + 8 * i;
        t[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
    t
}

/// "allreduce(4096 bytes, dtype torch.float32, op SUM) as collective #3".
fn describe(t: &[u8; TAG_BYTES]) -> String {
    let word = |i: usize| u64::from_le_bytes(t[Fingerprint::LEN + 8 * i..][..8].try_into().unwrap());
    let call = Fingerprint::decode(t[..Fingerprint::LEN].try_into().unwrap())
        .map_or_else(|_| "something unknown".to_string(), |fp| fp.describe());
    let (piece, index) = (word(1), word(2));
    let mut at = format!(" as collective #{}", word(0));
    if piece > 0 {
        at += &format!(", piece {piece}");
    }
    if index > 0 {
        at += &format!(", round {index}");
    }
    call + &at
}

/// The error of a round that did not pass.
fn failed(ctx: &OpCtx, stuck: Stuck) -> Error {
    let t = ctx.transport;
    match stuck {
        Stuck::TimedOut { missing } => {
            let first = missing.first().copied().unwrap_or(t.rank());
            let more = match missing.len() {
                0 | 1 => String::new(),
                n => format!(" and {} more", n - 1),
            };
            let said = format!("{} was waiting in the shared arena for {}{more}", ctx.what, t.describe_peer(first));
            // The rank we waited for may be waiting, in turn, for the one really at fault.
            Error::timed_out(ctx.timeout, in_turn(said, t.ask(first)))
        }
        Stuck::Aborted { by, reason } if by == t.rank() => {
            Error::peer_lost(format!("rustc10d: {} failed: {reason}", ctx.what))
        }
        Stuck::Aborted { by, reason } => {
            // Whoever wrote the arena's abort says who it is; name only a rank there is.
            let who = if by < t.size() { t.describe_peer(by) } else { "a rank".to_string() };
            Error::peer_lost(format!("rustc10d: {} failed: {who} gave up on the group: {reason}", ctx.what))
        }
    }
}
