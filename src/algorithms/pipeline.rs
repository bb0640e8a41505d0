//! Phases of an op that overlap: the op's buffer goes in pieces, each piece
//! through every phase in order, each phase on a thread of its own taking the
//! pieces in order. While one piece crosses a slow link, the next is worked
//! on in memory, so the link does not wait for the host. Where the first and
//! last of three phases both take a host's arena, which serves one round at
//! a time, they share a thread instead (`pipelined_through`). A piece's
//! memory goes with it from phase to phase, so that each phase owns what it
//! works on.

use super::{take_front, OpCtx, MAX_PHASES};
use crate::error::{Error, Result};
use crate::locks::{level, Mutex};
use std::sync::mpsc;

/// Pieces are at least this large (or 16 segments, where segments are
/// smaller, as in tests): smaller ones would cost more in steps and thread
/// switches than the overlap gains.
const PIECE_BYTES: usize = 256 << 10;
/// And at most this many (16 measured better than 8 for the hierarchical
/// all-reduce at 2 hosts x 4 ranks, 1 Gbit/s, 4 MiB: 1.65x Gloo against 1.58x).
const MAX_PIECES: usize = 16;

/// How many pieces an op over `bytes` goes in, each taking `keys` phases'
/// keys of its own (see `OpCtx::phase`).
pub fn piece_count(ctx: &OpCtx, bytes: usize, keys: usize) -> usize {
    let most = MAX_PIECES.min((MAX_PHASES as usize - 1) / keys).max(1);
    (bytes / PIECE_BYTES.min(16 * ctx.segment_bytes)).clamp(1, most)
}

/// The byte lengths of `len` bytes cut into `count` pieces at multiples of
/// `unit` (sizes differ by one unit at most; the bytes of a part-unit
/// beyond the last whole one are in no piece).
fn piece_lens(len: usize, unit: usize, count: usize) -> impl Iterator<Item = usize> {
    let n = len / unit;
    (0..count).map(move |k| ((k + 1) * n / count - k * n / count) * unit)
}

/// `buf` cut into `count` pieces at multiples of `unit` bytes.
pub fn pieces_mut(mut buf: &mut [u8], unit: usize, count: usize) -> Vec<&mut [u8]> {
    piece_lens(buf.len(), unit, count).map(|len| take_front(&mut buf, len)).collect()
}

/// `buf` cut into `count` pieces at multiples of `unit` bytes, to read.
pub fn pieces(mut buf: &[u8], unit: usize, count: usize) -> Vec<&[u8]> {
    let lens = piece_lens(buf.len(), unit, count);
    let cut = |len| {
        let (front, rest) = buf.split_at(len);
        buf = rest;
        front
    };
    lens.map(cut).collect()
}

/// The first failure among an op's phases: it aborts the group's transfers,
/// so that the other phases fail at once rather than wait for peers that
/// will not come, and is what the op reports.
struct FirstFailure<'a> {
    transport: &'a dyn crate::transport::Transport,
    seq: u64,
    first: Mutex<level::PipelineError, Option<Error>>,
}

impl<'a> FirstFailure<'a> {
    fn new(ctx: &OpCtx<'a>) -> Self {
        FirstFailure { transport: ctx.transport, seq: ctx.seq, first: Mutex::new(None) }
    }

    fn fail(&self, e: Error) {
        let mut first = self.first.lock().unwrap();
        if first.is_none() {
            self.transport.abort_all(&e, self.seq);
            *first = Some(e);
        }
    }

    fn result(self) -> Result<()> {
        self.first.into_inner().unwrap().map_or(Ok(()), Err)
    }
}

/// Run `phase(s, k, piece)` for phases 0..phases and each piece k of
/// `pieces`: piece k's phase s once its phase s - 1 is done, the piece
/// handed from phase to phase. The first failure ends the op (`FirstFailure`).
pub fn pipelined<P: Send>(
    ctx: &OpCtx,
    phases: usize,
    pieces: Vec<P>,
    phase: impl Fn(usize, usize, &mut P) -> Result<()> + Sync,
) -> Result<()> {
    let failed = FirstFailure::new(ctx);
    let fail = |e: Error| failed.fail(e);
    // Each phase hands the pieces it finished to the next; a phase that
    // fails drops its sender, which ends the phases after it.
    type Pieces<'p, P> = Box<dyn Iterator<Item = (usize, P)> + 'p>;
    let run = |s: usize, pieces: Pieces<P>, to: Option<mpsc::Sender<(usize, P)>>| {
        for (k, mut piece) in pieces {
            if let Err(e) = phase(s, k, &mut piece) {
                return fail(e);
            }
            if let Some(to) = &to {
                let _ = to.send((k, piece));
            }
        }
    };
    // Phase s takes its pieces from channel s - 1 and hands them on to channel s.
    let (to, from): (Vec<_>, Vec<_>) = (1..phases).map(|_| mpsc::channel::<(usize, P)>()).unzip();
    let to = to.into_iter().map(Some).chain(std::iter::once(None));
    let mut stages = (0..phases).zip(to);
    std::thread::scope(|scope| {
        let (s, to) = stages.next().expect("one phase at least");
        for ((s, to), from) in stages.zip(from) {
            let run = &run;
            scope.spawn(move || run(s, Box::new(from.into_iter()), to));
        }
        run(s, Box::new(pieces.into_iter().enumerate()), to);
    });
    failed.result()
}

/// As `pipelined` for three phases, but phases 0 and 2 (on the host, in its
/// arena) run on one thread, in an order every rank keeps: phase 0 of piece
/// k, then phase 2 of piece k - 1 (once its phase 1 is done), and so on;
/// phase 1 (across hosts) has a thread of its own. So while piece k crosses
/// the link, piece k + 1 is reduced on the host and piece k - 1 gathered,
/// and the host's ranks take the arena's rounds in the same order.
pub fn pipelined_through<P: Send>(
    ctx: &OpCtx,
    pieces: Vec<P>,
    phase: impl Fn(usize, usize, &mut P) -> Result<()> + Sync,
) -> Result<()> {
    let failed = FirstFailure::new(ctx);
    let fail = |e: Error| failed.fail(e);
    let count = pieces.len();
    let (to_link, link_in) = mpsc::channel::<(usize, P)>();
    let (link_out, from_link) = mpsc::channel::<(usize, P)>();
    let phase = &phase;
    std::thread::scope(|scope| {
        let fail = &fail;
        scope.spawn(move || {
            for (k, mut piece) in link_in.iter() {
                if let Err(e) = phase(1, k, &mut piece) {
                    return fail(e);
                }
                let _ = link_out.send((k, piece));
            }
        });
        // Phase 2 of piece k, once the link has handed it back (or has
        // stopped: then it failed, and said so).
        let gather = |k: usize| match from_link.recv() {
            Ok((done, mut piece)) => {
                debug_assert_eq!(done, k, "the link takes the pieces in order");
                phase(2, k, &mut piece).map_err(fail).is_ok()
            }
            Err(_) => false,
        };
        for (k, mut piece) in pieces.into_iter().enumerate() {
            if let Err(e) = phase(0, k, &mut piece) {
                return fail(e);
            }
            let _ = to_link.send((k, piece));
            if k > 0 && !gather(k - 1) {
                return;
            }
        }
        drop(to_link);
        if count > 0 {
            gather(count - 1);
        }
    });
    failed.result()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::ScratchPool;
    use crate::error::ErrorKind;
    use crate::transport::fake::FakeNet;
    use std::time::Duration;

    /// Runs `pipelined_through` over `count` pieces on one rank of a fake
    /// net, phase (s, k) failing where `fails(s, k)`; what it returned, and
    /// the phases run on the host's thread (0 and 2), in order.
    fn through(count: usize, fails: impl Fn(usize, usize) -> bool + Sync) -> (Result<()>, Vec<(usize, usize)>) {
        let net = FakeNet::new(2);
        let (pool, cost) = (ScratchPool::default(), Default::default());
        let ctx = OpCtx {
            transport: &*net[0],
            seq: 0,
            timeout: Duration::from_secs(5),
            deadline: std::time::Instant::now() + Duration::from_secs(5),
            what: crate::algorithms::What::new("test", 0, 0),
            segment_bytes: 64,
            small_allreduce_bytes: 0,
            pool: &pool,
            spin: Duration::ZERO,
            piece: 0,
            phase: 0,
            cost: &cost,
        };
        let on_host = Mutex::<level::TestRecord, _>::new(Vec::new());
        let r = pipelined_through(&ctx, vec![(); count], |s, k, _| {
            if s != 1 {
                on_host.lock().unwrap().push((s, k));
            } else {
                // The link is slower than the host: the order must not depend on it.
                std::thread::sleep(Duration::from_millis(2));
            }
            match fails(s, k) {
                true => Err(Error::io(format!("phase {s} of piece {k} failed"))),
                false => Ok(()),
            }
        });
        (r, on_host.into_inner().unwrap())
    }

    #[test]
    fn the_hosts_phases_take_one_thread_in_an_order_every_rank_keeps() {
        for count in 1..=5 {
            let (r, order) = through(count, |_, _| false);
            r.unwrap();
            // 0 of piece 0; then 0 of k and 2 of k - 1; last, 2 of the last piece.
            let mut want = vec![(0, 0)];
            for k in 1..count {
                want.extend([(0, k), (2, k - 1)]);
            }
            want.push((2, count - 1));
            assert_eq!(order, want, "{count} pieces");
        }
    }

    #[test]
    fn a_failing_phase_ends_the_op_with_its_error_and_nothing_after_it() {
        for (s, k) in [(0, 0), (0, 2), (1, 0), (1, 3), (2, 0), (2, 3)] {
            let (r, order) = through(4, |fs, fk| (fs, fk) == (s, k));
            let e = r.expect_err("a phase failed");
            assert_eq!(e.kind, ErrorKind::Io, "phase {s} of piece {k}: {}", e.message);
            assert!(e.message.contains(&format!("phase {s} of piece {k} failed")), "{}", e.message);
            // Piece k's gathering runs only as the failing phase, and last;
            // no piece after the next is started.
            let gathered = order.iter().position(|&p| p == (2, k));
            assert_eq!(gathered, (s == 2).then(|| order.len() - 1), "phase {s} of piece {k}: {order:?}");
            assert!(order.iter().all(|&(_, j)| j <= k + 1), "phase {s} of piece {k}: {order:?}");
        }
    }
}
