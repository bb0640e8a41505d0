//! The listening side, on the reactor: this rank's TCP listener and its Unix
//! socket for ranks on the same host accept connections, and each accepted
//! one runs its handshake as a small state machine of its own: read the
//! dialler's hello; if it fits, answer with a challenge (a fresh nonce);
//! read the dialler's proof that it knows the group's token (auth.rs); only
//! then prove this rank's own; for shared memory, take the segment and the
//! peer's eventfd and answer with ours. A stranger gets at most a random
//! challenge; the Unix socket takes only processes of this user.
//!
//! Floods: each listener runs at most MAX_HANDSHAKES at once, each at most
//! HANDSHAKE_TIMEOUT. When a listener is full, a new connection takes the
//! place of the oldest handshake whose dialler has not proved itself yet
//! (after a last look at what it sent), rather than being turned away: a
//! member's hello and proof follow its connect at once, so silent or slow
//! strangers, however many, are what gets dropped, and a member dropped
//! meanwhile tries again (dial.rs). The two listeners count apart, so a
//! flood of one does not close the other.

use crate::error::{Error, Result};
use crate::locks::{level, Mutex};
use crate::transport::links::auth::{nonce, Nonce, Side, Transcript, PROOF_LEN};
use crate::transport::links::conn::{Conn, ShmConn};
use crate::transport::links::dial::{Timeouts, HANDSHAKE_TIMEOUT};
use crate::transport::links::fdpass::{check_eventfd, check_same_user, eventfd, recv_fds, send_fds};
use crate::transport::links::frame::{Challenge, Hello, Refusal, HELLO_LEN};
use crate::transport::links::mesh_core::Core;
use crate::transport::links::reactor::{Source, Token, READABLE};
use crate::transport::links::ring::Segment;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

/// Handshakes one listener runs at once (see the module comment).
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
}

/// A listener as the reactor sees it, with the handshakes it runs.
pub struct Listening {
    pub listener: Listener,
    core: Weak<Core>,
    handshakes: Arc<Handshakes>,
    /// It has said it is out of file descriptors.
    out_of_descriptors: AtomicBool,
}

/// One listener's handshakes in progress, oldest first.
#[derive(Default)]
struct Handshakes(Mutex<level::Handshakes, VecDeque<Arc<Handshake>>>);

impl Handshakes {
    fn remove(&self, h: &Handshake) {
        self.0.lock().unwrap().retain(|other| !std::ptr::eq(&**other, h));
    }

    /// The oldest handshake whose dialler has not proved itself, if any.
    fn oldest_unproved(&self) -> Option<Arc<Handshake>> {
        self.0.lock().unwrap().iter().find(|h| !h.proved()).cloned()
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

impl Listening {
    pub fn new(listener: Listener, core: &Arc<Core>) -> Listening {
        Listening {
            listener,
            core: Arc::downgrade(core),
            handshakes: Arc::default(),
            out_of_descriptors: AtomicBool::new(false),
        }
    }

    /// Out of file descriptors, this listener cannot take the connection
    /// waiting for it: say so once, with the limit and how to raise it,
    /// rather than for every connection it refuses (`refuse_one`) or, where
    /// it cannot even refuse, on every turn of the I/O thread.
    fn out_of_descriptors(&self, core: &Arc<Core>, e: &io::Error) {
        if !self.out_of_descriptors.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "rustc10d: rank {} could not accept a connection: {}",
                core.rank(),
                crate::transport::links::fd_limit::describe(e)
            );
        }
    }

    /// Out of descriptors: take the connection waiting with the spare one
    /// and refuse it, saying why, so that its dialler fails now and names
    /// this rank's limit, instead of trying again until the group's timeout
    /// (30 minutes by default for a new group). False where there was no
    /// spare, or nothing to take.
    fn refuse_one(&self) -> bool {
        let Some((soft, hard)) = crate::transport::links::fd_limit::current() else { return false };
        let refusal = Refusal::OutOfDescriptors { soft, hard }.encode();
        let refused = crate::transport::links::fd_limit::with_spare(|| match &self.listener {
            Listener::Tcp(l) => l.accept().map(|(s, _)| refuse(s, &refusal)).is_ok(),
            Listener::Unix(l) => l.accept().map(|(s, _)| refuse(s, &refusal)).is_ok(),
        });
        refused.unwrap_or(false)
    }

    /// Accept everything waiting and start its handshake.
    fn accept_all(&self, core: &Arc<Core>) {
        loop {
            let accepted = match &self.listener {
                Listener::Tcp(l) => l.accept().map(|(s, a)| (Stream::Tcp(s), a.to_string())),
                Listener::Unix(l) => l.accept().map(|(s, _)| (Stream::Unix(s), "a local process".to_string())),
            };
            match accepted {
                Ok((stream, from)) => self.start(core, stream, from),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if crate::transport::links::fd_limit::hint(&e).is_some() => {
                    self.out_of_descriptors(core, &e);
                    if !self.refuse_one() {
                        return;
                    }
                }
                Err(e) => {
                    // The pending connection waits for the next event.
                    tracing::warn!("rustc10d: rank {}: accept failed: {e}", core.rank());
                    return;
                }
            }
        }
    }

    fn start(&self, core: &Arc<Core>, stream: Stream, from: String) {
        if let Stream::Unix(s) = &stream {
            if let Err(e) = check_same_user(s) {
                tracing::warn!("rustc10d: rank {} dropped a connection from {from}: {}", core.rank(), e.message);
                return;
            }
        }
        if !self.make_room(core) {
            tracing::warn!(
                "rustc10d: rank {} dropped a connection from {from}: {MAX_HANDSHAKES} members' handshakes run already",
                core.rank()
            );
            return;
        }
        let nonblocking = match &stream {
            Stream::Tcp(s) => s.set_nonblocking(true).and_then(|()| s.set_nodelay(true)),
            Stream::Unix(s) => s.set_nonblocking(true),
        };
        if let Err(e) = nonblocking {
            return tracing::warn!("rustc10d: rank {} dropped a connection from {from}: {e}", core.rank());
        }
        let h = Arc::new(Handshake {
            core: Arc::downgrade(core),
            handshakes: Arc::downgrade(&self.handshakes),
            from,
            state: Mutex::new(None),
        });
        {
            // Registered under the lock, so that nothing sees it half made.
            let mut state = h.state.lock().unwrap();
            match core.reactor.register(stream.fd(), READABLE, h.clone()) {
                Ok(token) => *state = Some(Shake { stream, token, phase: Phase::Hello(Partial::new()) }),
                Err(e) => {
                    return tracing::warn!(
                        "rustc10d: rank {} dropped a connection from {}: {}",
                        core.rank(),
                        h.from,
                        e.message
                    )
                }
            }
        }
        self.handshakes.0.lock().unwrap().push_back(h.clone());
        let late = Arc::downgrade(&h);
        core.reactor.after(
            HANDSHAKE_TIMEOUT,
            Box::new(move || {
                let Some(late) = late.upgrade() else { return };
                if let Some(core) = late.core.upgrade() {
                    late.fail(&core, Error::timeout("no proof in time"));
                }
            }),
        );
    }

    /// Whether a new handshake may start: there is a free place, or the
    /// oldest handshake whose dialler has not proved itself gives up its
    /// own (after it has read what it was sent, which may prove it).
    fn make_room(&self, core: &Arc<Core>) -> bool {
        for _ in 0..=MAX_HANDSHAKES {
            if self.handshakes.len() < MAX_HANDSHAKES {
                return true;
            }
            let Some(oldest) = self.handshakes.oldest_unproved() else { return false };
            oldest.advance(core);
            if !oldest.proved() {
                oldest.fail_quietly(core, "a newer connection took its place");
            }
        }
        self.handshakes.len() < MAX_HANDSHAKES
    }

    /// Drop every handshake in progress (the group shuts down).
    pub fn drop_handshakes(&self, core: &Arc<Core>) {
        let all: Vec<_> = self.handshakes.0.lock().unwrap().drain(..).collect();
        for h in all {
            h.fail_quietly(core, "the process group shut down");
        }
    }
}

impl Source for Listening {
    fn ready(&self, _: u32) {
        if let Some(core) = self.core.upgrade() {
            self.accept_all(&core);
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
        // A fresh socket takes a handshake's message whole; a short write is the peer's problem.
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

/// Bytes of a fixed-size message read so far.
struct Partial<const N: usize> {
    buf: [u8; N],
    got: usize,
}

impl<const N: usize> Partial<N> {
    fn new() -> Self {
        Partial { buf: [0; N], got: 0 }
    }

    /// Read what is there: the whole message once it is complete.
    fn read_from(&mut self, stream: &Stream) -> Result<Option<[u8; N]>> {
        while self.got < N {
            match stream.read(&mut self.buf[self.got..]) {
                Ok(0) => return Err(Error::io("closed during the handshake")),
                Ok(n) => self.got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io(e.to_string())),
            }
        }
        Ok(Some(self.buf))
    }
}

/// Where a handshake is.
enum Phase {
    /// Reading the dialler's hello.
    Hello(Partial<HELLO_LEN>),
    /// The challenge is sent; reading the dialler's proof.
    Proof { hello: Hello, nonce: Nonce, proof: Partial<PROOF_LEN> },
    /// Shared memory: the dialler `peer` proved itself; reading the segment's descriptors.
    Descriptors { peer: usize },
}

/// One accepted connection's handshake.
struct Handshake {
    core: Weak<Core>,
    handshakes: Weak<Handshakes>,
    from: String,
    state: Mutex<level::Shake, Option<Shake>>,
}

struct Shake {
    stream: Stream,
    /// Its registration with the reactor.
    token: Token,
    phase: Phase,
}

/// What one step did.
enum Stepped {
    /// Waiting for more from the dialler.
    Waiting,
    /// Moved on; there may be more to read at once.
    Moved,
    Done(usize, Conn),
}

impl Handshake {
    /// Whether the dialler has proved itself (such a handshake is never
    /// dropped to make room; it only has its descriptors left to send).
    fn proved(&self) -> bool {
        matches!(self.state.lock().unwrap().as_ref().map(|s| &s.phase), Some(Phase::Descriptors { .. }) | None)
    }

    /// Whether the dialler has sent nothing at all yet.
    fn said_nothing(&self) -> bool {
        matches!(self.state.lock().unwrap().as_ref().map(|s| &s.phase), Some(Phase::Hello(p)) if p.got == 0)
    }

    /// Take the connection off the reactor and out of its listener's table
    /// (only once: the handshake may already be over); whether it was still on.
    fn finish(&self, core: &Core) -> Option<Shake> {
        let shake = self.state.lock().unwrap().take()?;
        core.reactor.deregister(shake.token, shake.stream.fd());
        if let Some(table) = self.handshakes.upgrade() {
            table.remove(self);
        }
        Some(shake)
    }

    /// Drop the connection.
    fn fail(&self, core: &Arc<Core>, e: Error) {
        if self.finish(core).is_some() {
            tracing::warn!("rustc10d: rank {} dropped a connection from {}: {}", core.rank(), self.from, e.message);
        }
    }

    /// Drop the connection, as a matter of course (a flood makes many).
    fn fail_quietly(&self, core: &Arc<Core>, why: &str) {
        if self.finish(core).is_some() {
            tracing::debug!("rustc10d: rank {} dropped a connection from {}: {why}", core.rank(), self.from);
        }
    }

    /// Take every step there is input for.
    fn advance(&self, core: &Arc<Core>) {
        loop {
            match self.step(core) {
                Ok(Stepped::Waiting) => return,
                Ok(Stepped::Moved) => {}
                Ok(Stepped::Done(peer, conn)) => return self.adopt(core, peer, conn),
                // A port scan, or a peer's rendezvous asking the kernel who listens here (peer_reads.rs).
                Err(_) if self.said_nothing() => return self.fail_quietly(core, "closed before it said anything"),
                Err(e) => return self.fail(core, e),
            }
        }
    }

    fn step(&self, core: &Arc<Core>) -> Result<Stepped> {
        let mut state = self.state.lock().unwrap();
        let Some(shake) = state.as_mut() else { return Ok(Stepped::Waiting) };
        let io = |e: io::Error| Error::io(e.to_string());
        let me = core.identity();
        match &mut shake.phase {
            Phase::Hello(partial) => {
                let Some(bytes) = partial.read_from(&shake.stream)? else { return Ok(Stepped::Waiting) };
                let hello = Hello::decode(&bytes)?;
                hello.fits(me.rank, me.size)?;
                let nonce = nonce()?;
                shake.stream.write_all(&Challenge { nonce }.encode()).map_err(io)?;
                shake.phase = Phase::Proof { hello, nonce, proof: Partial::new() };
                Ok(Stepped::Moved)
            }
            Phase::Proof { hello, nonce, proof } => {
                let Some(theirs) = proof.read_from(&shake.stream)? else { return Ok(Stepped::Waiting) };
                let t = Transcript {
                    size: me.size,
                    dialler: hello.from,
                    listener: me.rank,
                    dialler_nonce: hello.nonce,
                    listener_nonce: *nonce,
                };
                me.check(Side::Dialler, &t, &theirs)?;
                shake.stream.write_all(&me.prove(Side::Listener, &t)).map_err(io)?;
                let peer = hello.from as usize;
                if let Stream::Unix(_) = shake.stream {
                    shake.phase = Phase::Descriptors { peer };
                    return Ok(Stepped::Moved);
                }
                drop(state);
                let Some(Shake { stream: Stream::Tcp(s), .. }) = self.finish(core) else { unreachable!() };
                Ok(Stepped::Done(peer, Conn::tcp(s, me.seal_keys(Side::Listener, &t))))
            }
            Phase::Descriptors { peer } => {
                let peer = *peer;
                // The segment and the peer's eventfd (and the group's arena,
                // from the rank that hands it out), then ours back.
                let fds = match recv_fds(&fd_of(&shake.stream), 2..=3) {
                    Ok(fds) => fds,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Stepped::Waiting),
                    Err(e) => return Err(Error::io(format!("no segment: {e}"))),
                };
                let mut fds = fds.into_iter();
                let (memfd, theirs) = (fds.next().expect("two at least"), fds.next().expect("two at least"));
                check_eventfd(&theirs).map_err(|e| Error::io(e.to_string()))?;
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
                drop(state);
                let Some(Shake { stream: Stream::Unix(sock), .. }) = self.finish(core) else { unreachable!() };
                Ok(Stepped::Done(peer, Conn::Shm(ShmConn::new(seg, false, sock, mine, theirs, core.direct_from))))
            }
        }
    }

    fn adopt(&self, core: &Arc<Core>, peer: usize, conn: Conn) {
        core.adopt(peer, conn);
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
        if let Some(core) = self.core.upgrade() {
            self.advance(&core);
        }
    }
}

/// Answer a dialler with `refusal` and close: its hello is read first (for at
/// most 50 ms, on a connection that is blocking as accepted), since closing
/// with bytes unread resets the connection, which could lose the answer.
fn refuse<S: Timeouts>(stream: S, refusal: &[u8])
where
    for<'s> &'s S: Read + Write,
{
    let _ = stream.timeouts(Some(std::time::Duration::from_millis(50)));
    let mut io = &stream;
    let _ = io.read_exact(&mut [0u8; HELLO_LEN]);
    let _ = io.write_all(refusal);
}
