//! What ranks on one host pass each other besides bytes: file descriptors
//! over a Unix socket (SCM_RIGHTS), eventfds to wake each other, and the key
//! that says two ranks share a host.

use crate::error::{Error, Result};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Most descriptors one message carries.
const MAX_FDS: usize = 4;

/// A one-byte message with room for MAX_FDS descriptors in its control data, for `f`.
fn with_fd_msg<R>(byte: u8, f: impl FnOnce(&mut libc::msghdr) -> R) -> R {
    let mut byte = [byte];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    // SAFETY: CMSG_SPACE is arithmetic on its argument (a macro in C); it touches no memory.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain C data: all zeroes is a valid value (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    f(&mut msg)
}

fn cmsg_len(n: usize) -> usize {
    // SAFETY: CMSG_LEN is arithmetic on its argument; it touches no memory.
    unsafe { libc::CMSG_LEN((n * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Send `fds` (at most MAX_FDS) with one byte of payload over `sock`.
pub fn send_fds(sock: &impl AsRawFd, fds: &[RawFd]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS);
    with_fd_msg(1, |msg| {
        // SAFETY: `msg` comes from `with_fd_msg`: its control buffer is `space` =
        // CMSG_SPACE(MAX_FDS fds) bytes, 8-byte aligned (a Vec<u64>), so
        // CMSG_FIRSTHDR is non-null and the header and fds.len() <= MAX_FDS
        // descriptors after CMSG_DATA lie inside it (written unaligned, as
        // the data need not be); the new controllen is at most `space`.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = cmsg_len(fds.len()) as _;
            let data = libc::CMSG_DATA(cmsg) as *mut RawFd;
            for (i, fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(data.add(i), *fd);
            }
            msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) as _;
        }
        loop {
            // SAFETY: `msg` points at live locals of `with_fd_msg` (the one-byte iovec,
            // the control buffer) for the whole call; sendmsg only reads them.
            let n = unsafe { libc::sendmsg(sock.as_raw_fd(), msg, libc::MSG_NOSIGNAL) };
            if n == 1 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if n < 0 && e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(if n < 0 { e } else { io::ErrorKind::WriteZero.into() });
        }
    })
}

/// Receive as many descriptors as `count` allows (at most MAX_FDS), sent by
/// `send_fds` (WouldBlock on a non-blocking socket with nothing yet).
pub fn recv_fds(sock: &impl AsRawFd, count: std::ops::RangeInclusive<usize>) -> io::Result<Vec<OwnedFd>> {
    with_fd_msg(0, |msg| {
        let n = loop {
            // SAFETY: `msg` points at live locals of `with_fd_msg`: recvmsg writes at
            // most iov_len (1) bytes into the byte and msg_controllen bytes into
            // the control buffer, and updates `msg` itself.
            let n = unsafe { libc::recvmsg(sock.as_raw_fd(), msg, libc::MSG_CMSG_CLOEXEC) };
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            break n;
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `msg` is the live msghdr recvmsg just filled; CMSG_FIRSTHDR only
        // reads its control fields (null if there is no room for a header).
        let cmsg = unsafe { libc::CMSG_FIRSTHDR(msg) };
        if n != 1 || cmsg.is_null() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "expected file descriptors"));
        }
        // SAFETY: `cmsg` is non-null (checked) and points at a header inside the
        // control buffer, which the kernel filled.
        let (level, kind, len) = unsafe { ((*cmsg).cmsg_level, (*cmsg).cmsg_type, (*cmsg).cmsg_len as usize) };
        let got = (len.saturating_sub(cmsg_len(0))) / std::mem::size_of::<RawFd>();
        // SAFETY: CMSG_DATA is pointer arithmetic on the live header `cmsg`, inside
        // the control buffer.
        let data = unsafe { libc::CMSG_DATA(cmsg) as *const RawFd };
        // Own whatever arrived, so that a wrong count closes them all.
        let fds: Vec<OwnedFd> = (0..got.min(MAX_FDS))
            // SAFETY: i < min(got, MAX_FDS): the kernel wrote `got` descriptors after
            // CMSG_DATA, and the buffer has room for MAX_FDS, so the read is in
            // bounds (unaligned, as the data need not be aligned). For an
            // SCM_RIGHTS message each is a new descriptor the kernel installed for
            // this process, owned by nothing else. (The level and type are checked
            // only after: another type would make these integers no descriptors.
            // Only SCM_RIGHTS arrives here: neither SO_PASSCRED nor SO_PASSSEC is set.)
            .map(|i| unsafe { OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))) })
            .collect();
        if level != libc::SOL_SOCKET || kind != libc::SCM_RIGHTS || !count.contains(&fds.len()) {
            let (lo, hi) = count.into_inner();
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("expected {lo} to {hi} file descriptors")));
        }
        Ok(fds)
    })
}

/// Who is at the other end of a Unix socket, as the kernel saw it when the
/// peer connected (or, for the dialling side, when the listener listened).
pub fn peer_cred(sock: &impl AsRawFd) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals; `len` says how many bytes the kernel may write to `cred`.
    let got = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if got != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

/// Shared memory goes only to processes of this process's user: a process
/// of another user gets nothing over a Unix socket, whatever it knows.
pub fn check_same_user(sock: &impl AsRawFd) -> Result<()> {
    let cred = peer_cred(sock).map_err(|e| Error::io(format!("cannot tell who the peer is (SO_PEERCRED): {e}")))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let mine = unsafe { libc::geteuid() };
    if cred.uid != mine {
        return Err(Error::io(format!(
            "the process at the other end (pid {}) runs as uid {}, this one as uid {mine}",
            cred.pid, cred.uid
        )));
    }
    Ok(())
}

/// A non-blocking eventfd: one rank writes to it to wake the other.
pub fn eventfd() -> Result<OwnedFd> {
    // SAFETY: eventfd takes a count and flags and touches no memory of ours.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(crate::transport::links::shared_mem::os_error("eventfd"));
    }
    // SAFETY: a descriptor eventfd just returned (checked >= 0), owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Check that `fd`, passed by a peer as its eventfd, is one, and make
/// writes to it non-blocking whatever it is: `notify` writes to it from the
/// I/O thread, which a pipe or socket that fills up would otherwise stall.
/// Where /proc is not there to ask, only the latter holds.
pub fn check_eventfd(fd: &OwnedFd) -> io::Result<()> {
    if let Ok(what) = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) {
        if what.as_os_str() != "anon_inode:[eventfd]" {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the peer's wake-up descriptor is not an eventfd ({})", what.display()),
            ));
        }
    }
    // SAFETY: fcntl on an open descriptor (borrowed) with integer arguments; no memory is passed.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Wake whoever watches the eventfd `fd`.
pub fn notify(fd: &OwnedFd) {
    let one = 1u64;
    // SAFETY: writes the 8 bytes of a live local u64 (what an eventfd takes);
    // the descriptor is open (borrowed); a full counter (EAGAIN) is fine.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Reset an eventfd after a wake-up.
pub fn drain(fd: &OwnedFd) {
    let mut count = 0u64;
    // SAFETY: reads at most 8 bytes into a live local u64; the descriptor is
    // open (borrowed); an empty one (EAGAIN) is fine.
    unsafe { libc::read(fd.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
}

/// Which ranks share this host: the boot (so two containers of one machine
/// match only if they share memory through this kernel) and the network
/// namespace (so namespaced "hosts" in tests, and the abstract Unix socket
/// names we use, agree).
pub fn host_key() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let netns = std::fs::metadata("/proc/self/ns/net").ok().map(|m| std::os::unix::fs::MetadataExt::ino(&m))?;
    Some(format!("{}-{netns}", boot.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn only_an_eventfd_passes_for_one() {
        check_eventfd(&eventfd().unwrap()).unwrap();
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let err = check_eventfd(&OwnedFd::from(a)).unwrap_err();
        assert!(err.to_string().contains("not an eventfd (socket:["), "{err}");
    }

    #[test]
    fn descriptors_travel_over_a_unix_socket_and_a_wrong_count_is_refused() {
        let (s1, s2) = UnixStream::pair().unwrap();
        let (a, b) = (eventfd().unwrap(), eventfd().unwrap());
        send_fds(&s1, &[a.as_raw_fd(), b.as_raw_fd()]).unwrap();
        let got = recv_fds(&s2, 2..=2).unwrap();
        notify(&got[0]);
        let mut count = 0u64;
        // SAFETY: reads at most 8 bytes into a live local u64 from an open eventfd.
        assert_eq!(unsafe { libc::read(a.as_raw_fd(), (&mut count as *mut u64).cast(), 8) }, 8, "the same eventfd");
        send_fds(&s1, &[a.as_raw_fd()]).unwrap();
        assert!(recv_fds(&s2, 2..=3).is_err());
        send_fds(&s1, &[a.as_raw_fd(), b.as_raw_fd(), a.as_raw_fd()]).unwrap();
        assert_eq!(recv_fds(&s2, 2..=3).unwrap().len(), 3, "as many as the range allows");
        (&s1).write_all(&[1]).unwrap();
        assert!(recv_fds(&s2, 1..=1).is_err(), "a plain byte carries none");
    }

    #[test]
    fn the_kernel_names_the_peer_of_a_unix_socket() {
        let (s1, _s2) = UnixStream::pair().unwrap();
        let cred = peer_cred(&s1).unwrap();
        assert_eq!(cred.pid as u32, std::process::id());
        check_same_user(&s1).unwrap();
    }

    #[test]
    fn host_key_is_stable() {
        assert_eq!(host_key(), host_key());
        assert!(host_key().is_some());
    }
}
