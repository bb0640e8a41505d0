//! A shared arena for a channel whose members all run on one host, so that
//! its collectives run there as a group with connections of its own does
//! (arena.rs) instead of over the rings. The channel's rank 0 makes it; each
//! member takes a copy of its descriptor straight from rank 0's process
//! (pidfd_getfd), which the kernel allows exactly where this rank may read
//! rank 0's memory (single copy); the descriptor's number is all that
//! crosses the wire, and what it names is checked (a sealed arena of this
//! group's shape) before it is mapped. Every rank then tells every other
//! whether it has the arena: it is used by all or by none, as the
//! algorithms need (Transport::shared_arena).

use crate::error::{Error, Result};
use crate::status::Cost;
use crate::transport::arena::Arena;
use crate::transport::frame::Key;
use crate::transport::{Transfers, Transport};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

/// The handshake's messages are collective steps of a sequence number no
/// engine reaches (one a microsecond would take 500,000 years).
const SEQ: u64 = u64::MAX;
const OFFER: u64 = 0;
const STATUS: u64 = 1;

/// The arena every member of `channel` maps, made by its rank 0 with slots of
/// `slot_bytes`; None where one could not be made or mapped by every member.
/// Every member must call it, at once. Two messages deep: rank 0 offers its
/// descriptor's number; then every rank tells every other whether it has
/// the arena, and each decides alike from what all said.
pub(in crate::transport) fn agree(
    channel: &dyn Transport,
    slot_bytes: usize,
    leader_pid: impl Fn() -> Option<libc::pid_t>,
    timeout: Duration,
) -> Result<Option<Arc<Arena>>> {
    let (me, n) = (channel.rank(), channel.size());
    let what = format!("making the shared arena of a group of {n} on rank {me}");
    let mut t = Transfers::new(channel, timeout, what, Duration::ZERO, Arc::new(Cost::default()));
    let key = |step| Key::collective(SEQ, step);
    let others: Vec<usize> = (0..n).filter(|&r| r != me).collect();
    let said: Vec<_> = others.iter().map(|&peer| t.recv_owned(peer, key(STATUS), 1)).collect::<Result<_>>()?;
    let mine = if me == 0 {
        let made = Arena::create(n, slot_bytes, 0)
            .inspect_err(|e| tracing::debug!("rustc10d: no arena for a group of {n}: {}", e.message))
            .ok();
        let fd = made.as_ref().and_then(|a| a.fd()).map_or(-1, |fd| fd.as_raw_fd() as i64);
        for &peer in &others {
            t.send_copy(peer, key(OFFER), &fd.to_le_bytes())?;
        }
        made
    } else {
        let offer = t.recv_owned(0, key(OFFER), 8)?;
        t.wait(offer)?;
        let fd = i64::from_le_bytes(t.received(offer).try_into().expect("8 bytes"));
        (fd >= 0)
            .then(|| take(leader_pid(), fd).and_then(|fd| Arena::open(&fd, me, n)))
            .transpose()
            .inspect_err(|e| tracing::debug!("rustc10d: rank {me} could not map its group's arena: {}", e.message))
            .ok()
            .flatten()
    };
    for &peer in &others {
        t.send_copy(peer, key(STATUS), &[mine.is_some() as u8])?;
    }
    let mut every = mine.is_some();
    for id in said {
        t.wait(id)?;
        every &= t.received(id) == [1];
    }
    t.wait_all()?;
    // Every member has its copy now: rank 0's descriptor is one a group need not keep.
    Ok(mine.filter(|_| every).map(|mut a| {
        a.close_fd();
        Arc::new(a)
    }))
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

#[cfg(test)]
mod tests {
    use super::agree;
    use crate::transport::fake::FakeNet;
    use crate::transport::Transport;
    use std::time::Duration;

    /// Ranks as threads of this process, each taking rank 0's descriptor
    /// from this process as `can_take[rank]` says: what each ends with.
    fn agree_on(can_take: &[bool]) -> Vec<bool> {
        let ranks = FakeNet::new(can_take.len());
        let me = std::process::id() as libc::pid_t;
        std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .zip(can_take)
                .map(|(t, &can)| {
                    let pid = move || can.then_some(me);
                    s.spawn(move || agree(&**t as &dyn Transport, 4096, pid, Duration::from_secs(10)).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().is_some()).collect()
        })
    }

    #[test]
    fn every_member_maps_the_arena_or_none_uses_it() {
        assert_eq!(agree_on(&[true; 4]), [true; 4]);
        for failing in 1..4 {
            let mut can = [true; 4];
            can[failing] = false;
            assert_eq!(agree_on(&can), [false; 4], "rank {failing} could not map it");
        }
    }
}
