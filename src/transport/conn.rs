//! A connection with a peer as the mesh sees it: a two-way byte stream of
//! frames, over TCP or through shared memory, that never blocks. When a side
//! must wait (nothing to read, no room to write) the reactor waits for it:
//! on the socket for TCP; for shared memory on an eventfd the peer writes to
//! once it has read or written, and on the Unix socket, which the kernel
//! closes when the peer process dies.

use super::fdpass::{drain, notify};
use super::ring::{Ring, Segment};
use std::io::{self, IoSlice};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

pub enum Conn {
    Tcp(TcpStream),
    Shm(ShmConn),
}

/// One end of a shared-memory connection: writes into ring `out`, reads the other.
pub struct ShmConn {
    seg: Segment,
    out: usize,
    /// Kept open for its lifetime only: its closing tells the peer we are gone.
    sock: UnixStream,
    /// The eventfd the peer writes to wake this side.
    mine: OwnedFd,
    /// The peer's.
    theirs: OwnedFd,
}

/// What a descriptor of a connection tells the reactor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watch {
    /// Data, room, or the end (a TCP socket; a shared-memory eventfd).
    Data,
    /// Only the end: the peer process is gone (a shared-memory connection's Unix socket).
    Liveness,
}

impl ShmConn {
    /// `dialled`: this side dialled (it writes ring 0).
    pub fn new(seg: Segment, dialled: bool, sock: UnixStream, mine: OwnedFd, theirs: OwnedFd) -> ShmConn {
        ShmConn { seg, out: if dialled { 0 } else { 1 }, sock, mine, theirs }
    }

    fn outgoing(&self) -> Ring<'_> {
        self.seg.ring(self.out)
    }

    fn incoming(&self) -> Ring<'_> {
        self.seg.ring(1 - self.out)
    }
}

impl Conn {
    pub fn is_shm(&self) -> bool {
        matches!(self, Conn::Shm(_))
    }

    /// The descriptors the reactor watches, and what each tells.
    pub fn watched(&self) -> Vec<(RawFd, Watch)> {
        match self {
            Conn::Tcp(s) => vec![(s.as_raw_fd(), Watch::Data)],
            Conn::Shm(s) => vec![(s.mine.as_raw_fd(), Watch::Data), (s.sock.as_raw_fd(), Watch::Liveness)],
        }
    }

    /// Read what is there: WouldBlock when nothing is, Ok(0) at the end.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => retry_interrupted(|| unsafe {
                libc::recv(s.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT)
            }),
            Conn::Shm(s) => {
                let n = s.incoming().read(buf)?;
                if n > 0 && s.incoming().writer_asleep() {
                    notify(&s.theirs);
                }
                Ok(n)
            }
        }
    }

    /// Write what fits: WouldBlock when nothing does.
    pub fn write(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => {
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = bufs.as_ptr() as *mut libc::iovec; // IoSlice is an iovec on unix
                msg.msg_iovlen = bufs.len() as _;
                retry_interrupted(|| unsafe {
                    libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
                })
            }
            Conn::Shm(s) => {
                let n = s.outgoing().write(bufs)?;
                if s.outgoing().reader_asleep() {
                    notify(&s.theirs);
                }
                Ok(n)
            }
        }
    }

    /// The reader is about to wait for the reactor: false if there is
    /// something to read after all (shared memory; TCP always waits).
    pub fn reader_waits(&self) -> bool {
        match self {
            Conn::Tcp(_) => true,
            Conn::Shm(s) => s.incoming().reader_waits(),
        }
    }

    /// A thread polls for what arrives: the peer need not wake the reactor.
    pub fn reader_polled(&self) {
        if let Conn::Shm(s) = self {
            s.incoming().reader_woke();
        }
    }

    /// The writer is about to wait for the reactor: false if there is room after all.
    pub fn writer_waits(&self) -> bool {
        match self {
            Conn::Tcp(_) => true,
            Conn::Shm(s) => s.outgoing().writer_waits(),
        }
    }

    /// The reactor woke this side: take back the announcements.
    pub fn woke(&self) {
        if let Conn::Shm(s) = self {
            drain(&s.mine);
            s.incoming().reader_woke();
            s.outgoing().writer_woke();
        }
    }

    /// The peer process is gone (its end of the Unix socket closed): what
    /// it wrote before still reads, then the end.
    pub fn peer_gone(&self) {
        if let Conn::Shm(s) = self {
            s.incoming().close();
            s.outgoing().close();
            notify(&s.mine);
        }
    }

    /// End the connection both ways: the peer, and our own reactor, see the end.
    pub fn shutdown(&self) {
        match self {
            Conn::Tcp(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            Conn::Shm(s) => {
                s.outgoing().close();
                s.incoming().close();
                notify(&s.theirs);
                notify(&s.mine);
                let _ = s.sock.shutdown(Shutdown::Both);
            }
        }
    }
}

/// A system call's byte count, retried when a signal interrupts it.
fn retry_interrupted(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fdpass::eventfd;
    use super::*;

    fn pair() -> (Conn, Conn) {
        let (seg, fd) = Segment::create(64 << 10).unwrap();
        let other = Segment::open(&fd).unwrap();
        let (s1, s2) = UnixStream::pair().unwrap();
        let (e1, e2) = (eventfd().unwrap(), eventfd().unwrap());
        let (e1b, e2b) = (e1.try_clone().unwrap(), e2.try_clone().unwrap());
        (Conn::Shm(ShmConn::new(seg, true, s1, e1, e2b)), Conn::Shm(ShmConn::new(other, false, s2, e2, e1b)))
    }

    fn pending(fd: RawFd) -> bool {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn a_waiting_reader_is_woken_by_the_next_write_only() {
        let (a, b) = pair();
        let b_wakes = b.watched()[0].0;
        a.write(&[IoSlice::new(b"first")]).unwrap();
        assert!(!pending(b_wakes), "b was not waiting: no wake-up");
        let mut buf = [0u8; 16];
        assert_eq!(b.read(&mut buf).unwrap(), 5);
        assert!(b.reader_waits());
        a.write(&[IoSlice::new(b"second")]).unwrap();
        assert!(pending(b_wakes), "b waits: woken");
        b.woke();
        assert!(!pending(b_wakes));
        assert_eq!(b.read(&mut buf).unwrap(), 6);
    }

    #[test]
    fn shutdown_ends_both_sides_and_wakes_them() {
        let (a, b) = pair();
        a.write(&[IoSlice::new(b"last words")]).unwrap();
        a.shutdown();
        assert!(pending(b.watched()[0].0), "the peer's reactor wakes");
        let mut buf = [0u8; 32];
        assert_eq!(b.read(&mut buf).unwrap(), 10, "what was written before still reads");
        assert_eq!(b.read(&mut buf).unwrap(), 0, "then the end");
        assert_eq!(b.write(&[IoSlice::new(b"x")]).unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }
}
