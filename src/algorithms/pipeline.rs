//! Phases of an op that overlap: the op's buffer goes in pieces, each piece
//! through every phase in order, each phase on a thread of its own taking the
//! pieces in order. While one piece crosses a slow link, the next is worked
//! on in memory, so the link does not wait for the host.

use super::{OpCtx, RawBuf, MAX_PHASES};
use crate::error::{Error, Result};
use std::sync::{mpsc, Mutex};

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

/// Piece k of `count` of `buf`, cut at multiples of `unit` bytes.
pub fn piece(buf: RawBuf, unit: usize, count: usize, k: usize) -> RawBuf {
    let n = buf.len / unit;
    let (lo, hi) = (k * n / count, (k + 1) * n / count);
    RawBuf::new(unsafe { buf.ptr.add(lo * unit) }, (hi - lo) * unit)
}

/// Run `phase(s, k)` for phases 0..phases and pieces 0..count: piece k's
/// phase s once its phase s - 1 is done. The first failure aborts the
/// group's transfers, so that the other phases fail at once rather than wait
/// for peers that will not come, and is what the op reports.
pub fn pipelined(
    ctx: &OpCtx,
    phases: usize,
    count: usize,
    phase: impl Fn(usize, usize) -> Result<()> + Sync,
) -> Result<()> {
    let first: Mutex<Option<Error>> = Mutex::new(None);
    let fail = |e: Error| {
        let mut first = first.lock().unwrap();
        if first.is_none() {
            ctx.transport.abort_all(&e);
            *first = Some(e);
        }
    };
    // Each phase hands the pieces it finished to the next; a phase that
    // fails drops its sender, which ends the phases after it.
    let run = |s: usize, from: Option<mpsc::Receiver<usize>>, to: Option<mpsc::Sender<usize>>| {
        let pieces: Box<dyn Iterator<Item = usize>> = match &from {
            Some(from) => Box::new(from.iter()),
            None => Box::new(0..count),
        };
        for k in pieces {
            if let Err(e) = phase(s, k) {
                return fail(e);
            }
            if let Some(to) = &to {
                let _ = to.send(k);
            }
        }
    };
    // Phase s takes its pieces from channel s - 1 and hands them on to channel s.
    let (to, from): (Vec<_>, Vec<_>) = (1..phases).map(|_| mpsc::channel::<usize>()).unzip();
    let from = std::iter::once(None).chain(from.into_iter().map(Some));
    let to = to.into_iter().map(Some).chain(std::iter::once(None));
    let mut stages = (0..phases).zip(from).zip(to);
    std::thread::scope(|scope| {
        let ((s, from), to) = stages.next().expect("one phase at least");
        for ((s, from), to) in stages {
            let run = &run;
            scope.spawn(move || run(s, from, to));
        }
        run(s, from, to);
    });
    first.into_inner().unwrap().map_or(Ok(()), Err)
}
