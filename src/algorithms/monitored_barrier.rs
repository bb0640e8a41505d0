//! Monitored barrier: rank 0 waits for a message from every rank, then
//! releases them all. Unlike a ring barrier it can say who did not arrive.

use super::OpCtx;
use crate::error::{Error, Result};

pub fn monitored_barrier(ctx: &OpCtx, wait_all: bool) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    let (arrive, release) = (ctx.key(0), ctx.key(1));
    let tr = &mut ctx.transfers();
    if rank != 0 {
        unsafe { tr.send(0, arrive, &[])? };
        let id = unsafe { tr.recv(0, release, std::ptr::NonNull::<u8>::dangling().as_ptr(), 0)? };
        return tr.wait(id);
    }
    let ids = (1..world)
        .map(|p| unsafe { tr.recv(p, arrive, std::ptr::NonNull::<u8>::dangling().as_ptr(), 0) })
        .collect::<Result<Vec<_>>>()?;
    let mut missing = Vec::new();
    for (i, id) in ids.into_iter().enumerate() {
        if tr.wait(id).is_err() {
            missing.push(i + 1);
            if !wait_all {
                break;
            }
        }
    }
    if !missing.is_empty() {
        return Err(Error::timeout(format!(
            "rustc10d: monitored barrier: rank(s) {missing:?} failed to pass monitoredBarrier within {} ms",
            ctx.timeout.as_millis()
        )));
    }
    for p in 1..world {
        unsafe { tr.send(p, release, &[])? };
    }
    tr.wait_all()
}
