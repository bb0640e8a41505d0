//! The listening side, on the reactor: this rank's TCP listener and its Unix
//! socket for ranks on the same host accept connections, and each accepted
//! one runs its handshake as a small state machine of its own (read the
//! peer's hello, check the group's token, answer; for shared memory, take
//! the segment and the peer's eventfd and answer with ours). A stranger gets
//! no answer; a silent one is dropped after HANDSHAKE_TIMEOUT; at most
//! MAX_HANDSHAKES run at once, so a flood of connections cannot exhaust
//! anything.

use super::conn::{Conn, ShmConn};
use super::dial::HANDSHAKE_TIMEOUT;
use super::fdpass::{eventfd, recv_fds, send_fds};
use super::frame::{Hello, HELLO_LEN};
use super::mesh_core::Core;
use super::reactor::{Source, Token, READABLE};
use super::ring::Segment;
use crate::error::{Error, Result};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

/// Handshakes in progress at once; connections beyond are closed at once.
pub const MAX_HANDSHAKES: usize = 64;

pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    pub fn fd(&self) -> RawFd {
        match self {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l) => l.as_raw_fd(),
        }
    }

    /// Accept everything waiting and start its handshake.
    fn accept_all(&self, core: &Arc<Core>) {
        loop {
            let accepted = match self {
                Listener::Tcp(l) => l.accept().map(|(s, a)| (Stream::Tcp(s), a.to_string())),
                Listener::Unix(l) => l.accept().map(|(s, _)| (Stream::Unix(s), "a local process".to_string())),
            };
            match accepted {
                Ok((stream, from)) => Handshake::start(core, stream, from),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors, say: the pending connection waits for the next event.
                    tracing::warn!("rustc10d: rank {}: accept failed: {e}", core.rank());
                    return;
                }
            }
        }
    }
}

/// A listener as the reactor sees it.
pub struct Listening(pub Listener, pub Weak<Core>);

impl Source for Listening {
    fn ready(&self, _: u32) {
        if let Some(core) = self.1.upgrade() {
            self.0.accept_all(&core);
        }
    }
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }

    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }

    fn write_all(&self, buf: &[u8]) -> io::Result<()> {
        // A fresh socket takes a hello whole; a short write is the peer's problem.
        let n = match self {
            Stream::Tcp(s) => (&*s).write(buf)?,
            Stream::Unix(s) => (&*s).write(buf)?,
        };
        if n == buf.len() {
            Ok(())
        } else {
            Err(io::ErrorKind::WriteZero.into())
        }
    }
}

/// One accepted connection's handshake.
struct Handshake {
    core: Weak<Core>,
    from: String,
    state: Mutex<Option<Shake>>,
}

struct Shake {
    stream: Stream,
    token: Token,
    hello: [u8; HELLO_LEN],
    got: usize,
    /// Shared memory: the peer's rank, once its hello passed.
    peer: Option<usize>,
}

impl Handshake {
    fn start(core: &Arc<Core>, stream: Stream, from: String) {
        if core.handshakes.fetch_add(1, Ordering::SeqCst) >= MAX_HANDSHAKES {
            core.handshakes.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(
                "rustc10d: rank {} dropped a connection from {from}: too many handshakes at once",
                core.rank()
            );
            return;
        }
        let nonblocking = match &stream {
            Stream::Tcp(s) => s.set_nonblocking(true).and_then(|()| s.set_nodelay(true)),
            Stream::Unix(s) => s.set_nonblocking(true),
        };
        let h = Arc::new(Handshake { core: Arc::downgrade(core), from, state: Mutex::new(None) });
        let registered = nonblocking
            .map_err(|e| Error::io(e.to_string()))
            .and_then(|()| core.reactor.register(stream.fd(), READABLE, h.clone()));
        let token = match registered {
            Ok(t) => t,
            Err(e) => return h.fail(core, e),
        };
        *h.state.lock().unwrap() = Some(Shake { stream, token, hello: [0; HELLO_LEN], got: 0, peer: None });
        let late = h.clone();
        core.reactor.after(
            HANDSHAKE_TIMEOUT,
            Box::new(move || {
                if let Some(core) = late.core.upgrade() {
                    late.fail(&core, Error::timeout("no hello in time"));
                }
            }),
        );
    }

    /// Drop the connection (only once: the handshake may already be over).
    fn fail(&self, core: &Arc<Core>, e: Error) {
        if let Some(shake) = self.state.lock().unwrap().take() {
            core.reactor.deregister(shake.token, shake.stream.fd());
            core.handshakes.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("rustc10d: rank {} dropped a connection from {}: {}", core.rank(), self.from, e.message);
        }
    }

    fn step(&self, core: &Arc<Core>) -> Result<Option<(usize, Conn)>> {
        let mut state = self.state.lock().unwrap();
        let Some(shake) = state.as_mut() else { return Ok(None) };
        let io = |e: io::Error| Error::io(e.to_string());
        if shake.got < HELLO_LEN {
            match shake.stream.read(&mut shake.hello[shake.got..]) {
                Ok(0) => return Err(Error::io("closed before its hello")),
                Ok(n) => shake.got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(io(e)),
            }
            if shake.got < HELLO_LEN {
                return Ok(None);
            }
            let theirs = Hello::decode(&shake.hello)?;
            theirs.verify(core.hello(), None)?;
            shake.stream.write_all(&core.hello().encode()).map_err(io)?;
            let peer = theirs.rank as usize;
            if let Stream::Tcp(_) = shake.stream {
                let shake = state.take().expect("some");
                core.reactor.deregister(shake.token, shake.stream.fd());
                let Stream::Tcp(s) = shake.stream else { unreachable!() };
                return Ok(Some((peer, Conn::Tcp(s))));
            }
            shake.peer = Some(peer);
            return Ok(None);
        }
        // Shared memory: the segment and the peer's eventfd (and the
        // group's arena, from the rank that hands it out), then ours back.
        let fds = match recv_fds(&fd_of(&shake.stream), 2..=3) {
            Ok(fds) => fds,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(Error::io(format!("no segment: {e}"))),
        };
        let mut fds = fds.into_iter();
        let (memfd, theirs) = (fds.next().expect("two at least"), fds.next().expect("two at least"));
        let peer = shake.peer.expect("hello passed");
        if let Some(arena) = fds.next() {
            core.take_arena(peer, arena)?;
        }
        let seg = Segment::open(&memfd)?;
        drop(memfd); // the mapping keeps the memory; nothing names it any more
                     // Before the answer: the dialler then finds where we map it (see conn.rs).
        seg.ring(1).set_writer_base();
        let mine = eventfd()?;
        let mut answer = vec![mine.as_raw_fd()];
        let lead = core.arena_to_hand_out();
        answer.extend(lead.as_ref().and_then(|a| a.fd()).map(|fd| fd.as_raw_fd()));
        send_fds(&fd_of(&shake.stream), &answer).map_err(io)?;
        let shake = state.take().expect("some");
        core.reactor.deregister(shake.token, shake.stream.fd());
        let Stream::Unix(sock) = shake.stream else { unreachable!() };
        Ok(Some((peer, Conn::Shm(ShmConn::new(seg, false, sock, mine, theirs, core.direct_from)))))
    }
}

/// A raw descriptor as something `fdpass` takes.
struct Fd(RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

fn fd_of(s: &Stream) -> Fd {
    Fd(s.fd())
}

impl Source for Handshake {
    fn ready(&self, _: u32) {
        let Some(core) = self.core.upgrade() else { return };
        // Up to two steps per event: the hello, then (shared memory) the
        // descriptors, which may already be there.
        for _ in 0..2 {
            match self.step(&core) {
                Ok(None) => {}
                Ok(Some((peer, conn))) => return self.adopt(&core, peer, conn),
                Err(e) => return self.fail(&core, e),
            }
        }
    }
}

impl Handshake {
    fn adopt(&self, core: &Arc<Core>, peer: usize, conn: Conn) {
        core.handshakes.fetch_sub(1, Ordering::SeqCst);
        core.adopt(peer, conn);
    }
}
