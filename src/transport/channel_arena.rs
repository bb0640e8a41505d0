//! A shared arena for a channel whose members all run on one host, so that
//! its collectives run there as a group with connections of its own does
//! (arena.rs) instead of over the rings. The channel's rank 0 makes it; each
//! member takes a copy of its descriptor straight from rank 0's process
//! (pidfd_getfd), which the kernel allows exactly where this rank may read
//! rank 0's memory (single copy); the descriptor's number is all that
//! crosses the wire, and what it names is checked (a sealed arena of this
//! group's shape) before it is mapped. Members then tell rank 0 whether they
//! could, and rank 0 tells them all whether every one did: the arena is used
//! by all or by none, as the algorithms need (Transport::shared_arena).

use super::arena::Arena;
use super::frame::Key;
use super::{Transfers, Transport};
use crate::error::{Error, Result};
use crate::status::Cost;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

/// The handshake's messages are collective steps of a sequence number no
/// engine reaches (one a microsecond would take 500,000 years).
const SEQ: u64 = u64::MAX;
const OFFER: u64 = 0;
const MAPPED: u64 = 1;
const AGREED: u64 = 2;

/// The arena every member of `channel` maps, made by its rank 0 with slots of
/// `slot_bytes`; None where one could not be made or mapped by every member.
/// Every member must call it, at once.
pub(super) fn agree(
    channel: &dyn Transport,
    slot_bytes: usize,
    leader_pid: impl Fn() -> Option<libc::pid_t>,
    timeout: Duration,
) -> Result<Option<Arc<Arena>>> {
    let (me, n) = (channel.rank(), channel.size());
    let what = format!("making the shared arena of a group of {n} on rank {me}");
    let mut t = Transfers::new(channel, timeout, what, Duration::ZERO, Arc::new(Cost::default()));
    let key = |step| Key::collective(SEQ, step);
    if me == 0 {
        let made = Arena::create(n, slot_bytes, 0)
            .inspect_err(|e| tracing::debug!("rustc10d: no arena for a group of {n}: {}", e.message))
            .ok();
        let fd = made.as_ref().and_then(|a| a.fd()).map_or(-1, |fd| fd.as_raw_fd() as i64);
        let mut replies = Vec::new();
        for peer in 1..n {
            t.send_copy(peer, key(OFFER), &fd.to_le_bytes())?;
            replies.push(t.recv_owned(peer, key(MAPPED), 1)?);
        }
        let mut every = made.is_some();
        for id in replies {
            t.wait(id)?;
            every &= t.received(id) == [1];
        }
        for peer in 1..n {
            t.send_copy(peer, key(AGREED), &[every as u8])?;
        }
        t.wait_all()?;
        // Every member took its copy: this rank's descriptor is one a group need not keep.
        Ok(made.filter(|_| every).map(|mut a| {
            a.close_fd();
            Arc::new(a)
        }))
    } else {
        let offer = t.recv_owned(0, key(OFFER), 8)?;
        let agreed = t.recv_owned(0, key(AGREED), 1)?;
        t.wait(offer)?;
        let fd = i64::from_le_bytes(t.received(offer).try_into().expect("8 bytes"));
        let mapped = (fd >= 0)
            .then(|| take(leader_pid(), fd).and_then(|fd| Arena::open(&fd, me, n)))
            .transpose()
            .inspect_err(|e| tracing::debug!("rustc10d: rank {me} could not map its group's arena: {}", e.message))
            .ok()
            .flatten();
        t.send_copy(0, key(MAPPED), &[mapped.is_some() as u8])?;
        t.wait(agreed)?;
        let every = t.received(agreed) == [1];
        t.wait_all()?;
        Ok(mapped.filter(|_| every).map(Arc::new))
    }
}

/// A copy of descriptor `fd` of process `pid` (the peer's word: whatever it
/// names is checked by `Arena::open`).
fn take(pid: Option<libc::pid_t>, fd: i64) -> Result<OwnedFd> {
    let pid = pid.ok_or_else(|| Error::unsupported("rank 0's memory is not readable from here"))?;
    let fd = i32::try_from(fd).map_err(|_| Error::io(format!("a descriptor number out of range: {fd}")))?;
    let sys = |what: &str, r: libc::c_long| -> Result<OwnedFd> {
        if r < 0 {
            return Err(Error::io(format!("{what}: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: the system call returned a new descriptor, which nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
    };
    // SAFETY: pidfd_open takes a pid and flags, and returns a new descriptor or -1.
    let pidfd = sys("pidfd_open", unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: pidfd_getfd takes a pidfd this process owns, a descriptor
    // number in that process, and flags; it returns a new descriptor or -1.
    sys("pidfd_getfd", unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) })
}
