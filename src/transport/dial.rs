//! Opening a connection to a peer, on the thread that first sends to it:
//! TCP with back-off until the peer listens, or the peer's Unix socket for
//! shared memory; the token handshake; for shared memory, a fresh sealed
//! segment and both ranks' wake-up eventfds, passed only after the handshake
//! so that they only ever reach a member of the group.

use super::conn::{Conn, ShmConn};
use super::fdpass::{eventfd, recv_fds, send_fds};
use super::frame::{Hello, HELLO_LEN};
use super::ring::Segment;
use crate::error::{Error, Result};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Upper bound on one handshake, so a silent peer cannot pin the dialler.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Who dials: this rank's hello, and how to name the peer in errors.
pub struct Dialler<'a> {
    pub me: &'a Hello,
    pub peer: usize,
    pub name: String,
    pub deadline: Instant,
}

impl Dialler<'_> {
    fn rank(&self) -> u32 {
        self.me.rank
    }

    /// A TCP connection to `addr`, retried with back-off until the deadline
    /// (the peer may not listen yet), handshake done, non-blocking.
    pub fn tcp(&self, addr: SocketAddr, stopping: impl Fn() -> bool) -> Result<Conn> {
        let mut backoff = Duration::from_millis(20);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let left = self.deadline.saturating_duration_since(Instant::now());
            let err = match TcpStream::connect_timeout(&addr, left.clamp(Duration::from_millis(1), HANDSHAKE_TIMEOUT)) {
                Ok(stream) => {
                    let shaken = stream.set_nodelay(true).map_err(io_err).and_then(|()| self.handshake(&stream));
                    return match shaken.and_then(|()| stream.set_nonblocking(true).map_err(io_err)) {
                        Ok(()) => Ok(Conn::Tcp(stream)),
                        // A wrong peer at that address will not become right by retrying.
                        Err(e) => Err(Error::io(format!(
                            "rustc10d: rank {} could not connect to {}: handshake failed: {}",
                            self.rank(),
                            self.name,
                            e.message
                        ))),
                    };
                }
                Err(e) => e,
            };
            if stopping() || Instant::now() + backoff >= self.deadline {
                return Err(Error::timeout(format!(
                    "rustc10d: rank {} could not connect to {} after {attempts} attempts: {err}",
                    self.rank(),
                    self.name
                )));
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// A shared-memory connection through the peer's Unix socket `name`,
    /// with rings of `ring_bytes`, messages of `direct_from` bytes or more
    /// in one copy (see conn.rs). The group's arena goes along, if this
    /// rank hands it out (`arena`), or comes back with the answer, if the peer does.
    pub fn shm(
        &self,
        name: &str,
        ring_bytes: usize,
        direct_from: usize,
        arena: Option<&OwnedFd>,
    ) -> Result<(Conn, Option<OwnedFd>)> {
        let fail = |what: String| {
            Error::io(format!(
                "rustc10d: rank {} could not connect to {} through shared memory: {what}",
                self.rank(),
                self.name
            ))
        };
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| fail(e.to_string()))?;
        let sock = UnixStream::connect_addr(&addr).map_err(|e| fail(e.to_string()))?;
        self.handshake(&sock).map_err(|e| fail(format!("handshake failed: {}", e.message)))?;
        let (seg, memfd) = Segment::create(ring_bytes).map_err(|e| fail(e.message))?;
        let mine = eventfd().map_err(|e| fail(e.message))?;
        let mut fds = vec![memfd.as_raw_fd(), mine.as_raw_fd()];
        fds.extend(arena.map(|a| a.as_raw_fd()));
        send_fds(&sock, &fds).map_err(|e| fail(e.to_string()))?;
        // The peer answers with its eventfd (and the arena) once it has mapped the segment.
        let answer = recv_fds(&sock, 1..=2).map_err(|e| fail(format!("no answer after sending the segment: {e}")))?;
        let mut answer = answer.into_iter();
        let theirs = answer.next().expect("one at least");
        sock.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
        Ok((Conn::Shm(ShmConn::new(seg, true, sock, mine, theirs, direct_from)), answer.next()))
    }

    /// The dialling side speaks first; the listener answers only a hello
    /// that carries the group's token, so a stranger learns nothing.
    fn handshake<S>(&self, stream: &S) -> Result<()>
    where
        S: Timeouts,
        for<'s> &'s S: Read + Write,
    {
        let limit =
            self.deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(10), HANDSHAKE_TIMEOUT);
        stream.timeouts(Some(limit)).map_err(io_err)?;
        let mut io = stream;
        io.write_all(&self.me.encode()).map_err(io_err)?;
        let mut buf = [0u8; HELLO_LEN];
        io.read_exact(&mut buf).map_err(io_err)?;
        Hello::decode(&buf)?.verify(self.me, Some(self.peer as u32))?;
        stream.timeouts(None).map_err(io_err)
    }
}

fn io_err(e: io::Error) -> Error {
    Error::io(e.to_string())
}

/// Socket timeouts for the handshake (None: blocking).
pub trait Timeouts {
    fn timeouts(&self, t: Option<Duration>) -> io::Result<()>;
}

impl Timeouts for TcpStream {
    fn timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(t)?;
        self.set_write_timeout(t)
    }
}

impl Timeouts for UnixStream {
    fn timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(t)?;
        self.set_write_timeout(t)
    }
}
