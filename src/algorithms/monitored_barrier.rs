//! Monitored barrier, as torch defines it: rank 0 waits for every other rank
//! to arrive, each within the barrier's timeout, then releases them all.
//! Unlike a ring barrier it can say who did not arrive. Only rank 0 enforces
//! the barrier's timeout; the others wait for their release with the op's
//! (the group's) timeout, so that rank 0 reports first and names the missing
//! rank. When rank 0 gives up it tells every other rank why, so that they
//! fail at once instead of at their own timeout. Error texts are torch's own.

use super::OpCtx;
use crate::error::{Error, Result};
use crate::transport::Transfers;
use std::time::{Duration, Instant};

/// The release rank 0 sends: a status byte, then (on failure) why, cut short.
const RELEASE_LEN: usize = 256;
const RELEASED: u8 = 0;
const FAILED: u8 = 1;

/// `timeout`: how long rank 0 waits for the others to arrive.
pub fn monitored_barrier(ctx: &OpCtx, wait_all: bool, timeout: Duration) -> Result<()> {
    if ctx.transport.rank() == 0 {
        monitor(ctx, wait_all, timeout)
    } else {
        arrive(ctx)
    }
}

fn arrive(ctx: &OpCtx) -> Result<()> {
    let rank = ctx.transport.rank();
    let mut release = [0u8; RELEASE_LEN];
    let outcome = ctx.with_transfers(|tr| {
        tr.send(0, ctx.key(0), &[])?;
        let lent = tr.recv(0, ctx.key(1), &mut release)?;
        tr.give_back(lent)?;
        tr.wait_all()
    });
    let cause = match outcome {
        Ok(()) if release[0] == RELEASED => return Ok(()),
        Ok(()) => {
            let why = String::from_utf8_lossy(&release[1..]);
            format!("rank 0 reported: {}", why.trim_end_matches('\0'))
        }
        Err(e) => e.message,
    };
    Err(Error::timeout(format!(
        "rustc10d: Rank {rank} successfully reached monitoredBarrier, but received errors while waiting for \
         send/recv from rank 0. Please check rank 0 logs for faulty rank.\n Original exception: \n{cause}"
    )))
}

fn monitor(ctx: &OpCtx, wait_all: bool, timeout: Duration) -> Result<()> {
    let world = ctx.transport.size();
    let ms = timeout.as_millis();
    let deadline = Instant::now() + timeout;
    let what = ctx.what.to_string();
    let failure = Transfers::scope(ctx.transport, timeout, what, ctx.spin, ctx.cost.clone(), |arrivals| {
        let ids =
            (1..world).map(|p| arrivals.recv(p, ctx.key(0), &mut []).map(|l| l.id())).collect::<Result<Vec<_>>>()?;
        let mut arrived = Vec::new();
        let mut missing = Vec::new();
        for (peer, id) in (1..world).zip(ids) {
            // Without wait_all, the time left is checked before each wait, as
            // torch does: a zero timeout fails at once, naming who did arrive.
            if !wait_all && Instant::now() >= deadline {
                let processed = if arrived.is_empty() {
                    "No ranks successfully processed in monitoredBarrier.".to_string()
                } else {
                    format!("Successfully processed ranks: {}", join(&arrived))
                };
                return Ok(Some(format!("rustc10d: Rank 0 timed out in monitoredBarrier after {ms} ms.\n{processed}")));
            }
            match arrivals.wait(id) {
                Ok(()) => arrived.push(peer),
                Err(_) if wait_all => missing.push(peer),
                Err(e) => {
                    return Ok(Some(format!(
                        "rustc10d: [Rank 0]: Rank {peer} failed to pass monitoredBarrier in {ms} ms\n Original exception: \n{}",
                        e.message
                    )));
                }
            }
        }
        Ok::<_, Error>((!missing.is_empty()).then(|| {
            format!("rustc10d: [Rank 0]: Ranks {} failed to pass monitoredBarrier in {ms} ms", join(&missing))
        }))
    })?;
    let mut release = [RELEASED; RELEASE_LEN];
    if let Some(why) = &failure {
        release[0] = FAILED;
        let n = why.len().min(RELEASE_LEN - 1);
        release[1..=n].copy_from_slice(&why.as_bytes()[..n]);
    }
    let sent = ctx.with_transfers(|releases| {
        (1..world).try_for_each(|peer| releases.send(peer, ctx.key(1), &release).map(drop))?;
        match failure {
            // Telling the others is best effort: a missing rank may be gone.
            Some(_) => Ok(()),
            None => releases.wait_all(),
        }
    });
    match failure {
        Some(why) => Err(Error::timeout(why)),
        None => sent,
    }
}

fn join(ranks: &[usize]) -> String {
    ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}
