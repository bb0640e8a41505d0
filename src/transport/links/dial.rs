//! Opening a connection to a peer, on the thread that first sends to it:
//! TCP, or the peer's Unix socket for shared memory (only to a listener of
//! this process's user); the challenge and response that prove each side a
//! member of the group (auth.rs); for shared memory, a fresh sealed segment
//! and both ranks' wake-up eventfds, passed only after the peer has proved
//! itself, so that they only ever reach a member of the group.
//!
//! An attempt that nobody answers, or that the listener closes before it
//! has proved itself, is tried again with back-off until the deadline: the
//! peer may not listen yet, or strangers may be flooding its listener, which
//! then drops the oldest handshakes it has not yet seen proved. An answer
//! that is wrong ends the dialling at once: retrying would not make it right.

use crate::error::{Error, Result};
use crate::transport::links::auth::{nonce, Identity, Side, Transcript, PROOF_LEN};
use crate::transport::links::conn::{Conn, ShmConn};
use crate::transport::links::fd_limit;
use crate::transport::links::fdpass::{check_eventfd, check_same_user, eventfd, recv_fds, send_fds};
use crate::transport::links::frame::{Challenge, Hello, CHALLENGE_LEN, PROTOCOL_VERSION};
use crate::transport::links::ring::Segment;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Upper bound on one handshake, so a silent peer cannot pin the dialler.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The first wait between attempts; it doubles up to `MAX_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_millis(20);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// Who dials: this rank, whom, how to name the peer in errors, and by when.
pub struct Dialler<'a> {
    pub me: &'a Identity,
    pub peer: usize,
    pub name: String,
    pub deadline: Instant,
}

/// Why one attempt to connect failed.
enum Attempt {
    /// Nobody answered in time, or the other side closed before it proved
    /// itself: another attempt may get through.
    Retry(String),
    /// The other side answered wrong, or is not of this user: it is not the
    /// rank this one means to reach.
    Fail(String),
}

fn retry(what: &'static str) -> impl Fn(io::Error) -> Attempt {
    move |e| match e.kind() {
        // A socket timeout reads as EAGAIN, which says nothing to a user.
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Attempt::Retry(format!("{what} in time")),
        // Out of descriptors: another attempt would only flood the log.
        _ if fd_limit::hint(&e).is_some() => Attempt::Fail(format!("{what}: {}", fd_limit::describe(&e))),
        _ => Attempt::Retry(format!("{what}: {e}")),
    }
}

fn fail(e: impl std::fmt::Display) -> Attempt {
    Attempt::Fail(e.to_string())
}

impl Dialler<'_> {
    fn rank(&self) -> u32 {
        self.me.rank
    }

    /// The time one blocking step of an attempt may take.
    fn step_limit(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(10), HANDSHAKE_TIMEOUT)
    }

    /// A TCP connection to `addr`, handshake done, non-blocking.
    pub fn tcp(&self, addr: SocketAddr, stopping: impl Fn() -> bool) -> Result<Conn> {
        let what = self.name.clone();
        self.with_retries(&what, stopping, || {
            let stream = TcpStream::connect_timeout(&addr, self.step_limit()).map_err(|e| match e.kind() {
                // A rank listens before it publishes its address, and a full
                // backlog drops a connection rather than refuse it: nothing
                // listens there any more, and another attempt would not
                // change that (the peer has left the group, or exited).
                io::ErrorKind::ConnectionRefused => {
                    Attempt::Fail(format!("connect: {e}: the rank no longer listens (it has left the group or exited)"))
                }
                _ => retry("connect")(e),
            })?;
            stream.set_nodelay(true).map_err(fail)?;
            let t = self.handshake(&stream)?;
            stream.set_nonblocking(true).map_err(fail)?;
            Ok(Conn::tcp(stream, self.me.seal_keys(Side::Dialler, &t)))
        })
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
        stopping: impl Fn() -> bool,
    ) -> Result<(Conn, Option<OwnedFd>)> {
        let what = format!("{} through shared memory", self.name);
        let sock = self.with_retries(&what, stopping, || {
            let sock = unix_connect(name, self.step_limit()).map_err(|e| match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::TimedOut => {
                    Attempt::Retry(format!("connect: {e}"))
                }
                // The socket is gone with its process, or never was.
                _ => Attempt::Fail(format!("connect: {}", fd_limit::describe(&e))),
            })?;
            check_same_user(&sock).map_err(|e| fail(e.message))?;
            self.handshake(&sock)?;
            Ok(sock)
        })?;
        let fail =
            |why: String| Error::io(format!("rustc10d: rank {} could not connect to {what}: {why}", self.rank()));
        let (seg, memfd) = Segment::create(ring_bytes).map_err(|e| fail(e.message))?;
        let mine = eventfd().map_err(|e| fail(e.message))?;
        let mut fds = vec![memfd.as_raw_fd(), mine.as_raw_fd()];
        fds.extend(arena.map(|a| a.as_raw_fd()));
        sock.set_write_timeout(Some(self.step_limit())).map_err(|e| fail(e.to_string()))?;
        send_fds(&sock, &fds).map_err(|e| fail(e.to_string()))?;
        // The peer answers with its eventfd (and the arena) once it has mapped the segment.
        sock.set_read_timeout(Some(self.step_limit())).map_err(|e| fail(e.to_string()))?;
        let answer = recv_fds(&sock, 1..=2).map_err(|e| fail(format!("no answer after sending the segment: {e}")))?;
        let mut answer = answer.into_iter();
        let theirs = answer.next().expect("one at least");
        check_eventfd(&theirs).map_err(|e| fail(e.to_string()))?;
        sock.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
        Ok((Conn::Shm(ShmConn::new(seg, true, sock, mine, theirs, direct_from)), answer.next()))
    }

    /// Run `attempt` until it succeeds, fails for good, or the deadline (or
    /// `stopping`) leaves no time for another; `what` names the peer in errors.
    fn with_retries<T>(
        &self,
        what: &str,
        stopping: impl Fn() -> bool,
        mut attempt: impl FnMut() -> Result<T, Attempt>,
    ) -> Result<T> {
        let mut backoff = FIRST_BACKOFF;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let why = match attempt() {
                Ok(t) => return Ok(t),
                Err(Attempt::Fail(why)) => {
                    return Err(Error::io(format!(
                        "rustc10d: rank {} could not connect to {what}: handshake failed: {why}",
                        self.rank()
                    )))
                }
                Err(Attempt::Retry(why)) => why,
            };
            if stopping() || Instant::now() + backoff >= self.deadline {
                return Err(Error::timeout(format!(
                    "rustc10d: rank {} could not connect to {what} after {attempts} attempts: {why}",
                    self.rank()
                )));
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// The dialling side speaks first, with its nonce; the listener answers
    /// a hello that fits with its own; then each proves it knows the key,
    /// the dialler first, so that a stranger never gets a proof.
    fn handshake<S>(&self, stream: &S) -> Result<Transcript, Attempt>
    where
        S: Timeouts,
        for<'s> &'s S: Read + Write,
    {
        stream.timeouts(Some(self.step_limit())).map_err(fail)?;
        let mut io = stream;
        let mine = nonce().map_err(|e| fail(e.message))?;
        let hello = Hello {
            version: PROTOCOL_VERSION,
            from: self.rank(),
            to: self.peer as u32,
            size: self.me.size,
            nonce: mine,
        };
        io.write_all(&hello.encode()).map_err(retry("sending the hello"))?;
        let mut challenge = [0u8; CHALLENGE_LEN];
        io.read_exact(&mut challenge).map_err(retry("no challenge"))?;
        let challenge = Challenge::decode(&challenge).map_err(fail)?;
        let t = Transcript {
            size: self.me.size,
            dialler: self.rank(),
            listener: self.peer as u32,
            dialler_nonce: mine,
            listener_nonce: challenge.nonce,
        };
        io.write_all(&self.me.prove(Side::Dialler, &t)).map_err(retry("sending the proof"))?;
        let mut theirs = [0u8; PROOF_LEN];
        io.read_exact(&mut theirs).map_err(retry("the listener did not prove itself"))?;
        self.me.check(Side::Listener, &t, &theirs).map_err(fail)?;
        stream.timeouts(None).map_err(fail)?;
        Ok(t)
    }
}

/// A blocking connection to the abstract Unix socket `name`. Where the
/// listener's backlog is full, connect(2) waits up to the socket's send
/// timeout (then EAGAIN), so it is set to `limit` first, which the standard
/// library's connect gives no chance to do.
pub(in crate::transport) fn unix_connect(name: &str, limit: Duration) -> io::Result<UnixStream> {
    // SAFETY: socket(2) with constant arguments; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let sock = unsafe { UnixStream::from_raw_fd(fd) };
    sock.set_write_timeout(Some(limit))?;
    // SAFETY: sockaddr_un is plain old data, valid when zeroed.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // An abstract name: a NUL, then the name's bytes (no terminator).
    if name.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "socket name too long"));
    }
    for (slot, b) in addr.sun_path[1..].iter_mut().zip(name.bytes()) {
        *slot = b as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
    // SAFETY: `addr` is a live sockaddr_un whose first `len` bytes are the address.
    let rc =
        unsafe { libc::connect(sock.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len as libc::socklen_t) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::links::auth::{GroupKey, Proof, SHARE_LEN};
    use crate::transport::links::frame::HELLO_LEN;
    use std::net::TcpListener;
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::process::CommandExt;
    use std::sync::mpsc;

    /// The group's key in these tests.
    fn key() -> GroupKey {
        GroupKey::derive(b"", &[*b"group share 0123"; 3])
    }

    fn dialler(me: &Identity, peer: usize, within: Duration) -> Dialler<'_> {
        Dialler { me, peer, name: format!("rank {peer}"), deadline: Instant::now() + within }
    }

    /// A listener's side of one handshake, as the fake listeners play it:
    /// what the dialler sent (its hello and proof), after answering with a
    /// challenge and the proof made with `key`.
    fn listen_once(s: &mut (impl Read + Write), rank: u32, key: GroupKey) -> Vec<u8> {
        let mut hello = [0u8; HELLO_LEN];
        s.read_exact(&mut hello).unwrap();
        let hello = Hello::decode(&hello).unwrap();
        let challenge = Challenge { nonce: nonce().unwrap() };
        s.write_all(&challenge.encode()).unwrap();
        let mut proof: Proof = [0; PROOF_LEN];
        s.read_exact(&mut proof).unwrap();
        let t = Transcript {
            size: hello.size,
            dialler: hello.from,
            listener: rank,
            dialler_nonce: hello.nonce,
            listener_nonce: challenge.nonce,
        };
        let me = Identity::new(rank, hello.size, key);
        s.write_all(&me.prove(Side::Listener, &t)).unwrap();
        [&hello.encode()[..], &proof[..]].concat()
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    /// Everything a dialler sends a listener, over TCP and over a Unix
    /// socket: a hello and a proof, never the key.
    #[test]
    fn the_key_never_crosses_the_wire() {
        let me = Identity::new(1, 3, key());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = std::thread::spawn(move || listen_once(&mut listener.accept().unwrap().0, 2, key()));
        dialler(&me, 2, Duration::from_secs(10)).tcp(addr, || false).unwrap();
        let sent = fake.join().unwrap();
        assert_eq!(sent.len(), HELLO_LEN + PROOF_LEN);
        assert!(!contains(&sent, key().bytes()), "the key went over TCP");

        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let fake = std::thread::spawn(move || listen_once(&mut theirs, 0, key()));
        assert!(dialler(&me, 0, Duration::from_secs(10)).handshake(&ours).is_ok());
        let sent = fake.join().unwrap();
        assert!(!contains(&sent, key().bytes()), "the key went over the Unix socket");
    }

    /// A listener that cannot prove it knows the key is not a member: the
    /// dialler gives up at once (one attempt), without its data going there.
    #[test]
    fn a_listener_with_another_key_is_refused_at_once() {
        let me = Identity::new(0, 2, key());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted, count) = mpsc::channel();
        let fake = std::thread::spawn(move || {
            let mut s = listener.accept().unwrap().0;
            accepted.send(()).unwrap();
            listen_once(&mut s, 1, GroupKey::derive(b"", &[[0x5A; SHARE_LEN]; 2]));
            listener.set_nonblocking(true).unwrap();
            std::thread::sleep(Duration::from_millis(300));
            while listener.accept().is_ok() {
                accepted.send(()).unwrap();
            }
        });
        let t0 = Instant::now();
        let Err(err) = dialler(&me, 1, Duration::from_secs(10)).tcp(addr, || false) else { panic!("connected") };
        assert!(err.message.contains("could not prove"), "{}", err.message);
        assert!(t0.elapsed() < Duration::from_secs(5), "no retrying until the deadline");
        fake.join().unwrap();
        assert_eq!(count.try_iter().count(), 1, "one attempt");
    }

    /// A listener full of strangers drops the oldest handshakes it has not
    /// seen proved, which may be a member's: the member dials again.
    #[test]
    fn a_dialler_whose_handshake_was_dropped_tries_again() {
        let me = Identity::new(0, 2, key());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = std::thread::spawn(move || {
            for _ in 0..2 {
                let mut s = listener.accept().unwrap().0;
                let mut hello = [0u8; HELLO_LEN];
                s.read_exact(&mut hello).unwrap();
                // Dropped before the challenge, as a full listener drops one.
            }
            listen_once(&mut listener.accept().unwrap().0, 1, key());
        });
        dialler(&me, 1, Duration::from_secs(10)).tcp(addr, || false).unwrap();
        fake.join().unwrap();
    }

    /// A Unix socket listened on by a process of another user gets nothing
    /// from the dialler, not even its hello. Needs root, to run that process
    /// as another user.
    #[test]
    fn a_listener_of_another_user_gets_nothing() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: running a listener as another user needs root");
            return;
        }
        let tag: String = nonce().unwrap()[..8].iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("rustc10d-test-{tag}");
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "transport::links::dial::tests::foreign_listener_role",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(FOREIGN_LISTENER, &name)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .uid(65534)
            .gid(65534)
            .spawn();
        let mut child = match child {
            Ok(child) => child,
            // A test binary under a directory only root may enter (a private temporary clone, say).
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                return eprintln!("skipped: uid 65534 cannot run this test binary: {e}");
            }
            Err(e) => panic!("run the listener as uid 65534: {e}"),
        };
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        assert_eq!(said(&mut out, "listening"), "listening", "the listener role started");
        let me = Identity::new(0, 2, key());
        let dialled = dialler(&me, 1, Duration::from_secs(10)).shm(&name, 64 << 10, 0, None, || false);
        let Err(err) = dialled else { panic!("connected") };
        assert!(err.message.contains("uid 65534"), "{}", err.message);
        assert_eq!(said(&mut out, "received"), "received 0 bytes", "the dialler sent nothing");
        assert!(child.wait().unwrap().success());
    }

    /// What the role's process printed from `prefix` to the end of that
    /// line (the test harness prints its own words around it).
    fn said(out: &mut impl std::io::BufRead, prefix: &str) -> String {
        let mut line = String::new();
        while out.read_line(&mut line).unwrap() > 0 {
            if let Some(at) = line.find(prefix) {
                return line[at..].trim().to_string();
            }
            line.clear();
        }
        String::new()
    }

    const FOREIGN_LISTENER: &str = "RUSTC10D_TEST_FOREIGN_LISTENER";

    /// Not a test by itself: the listener of `a_listener_of_another_user_gets_nothing`,
    /// run in a process of another user (does nothing without its variable).
    #[test]
    fn foreign_listener_role() {
        let Ok(name) = std::env::var(FOREIGN_LISTENER) else { return };
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        listener.set_nonblocking(true).unwrap();
        println!("listening");
        // Bounded: the test that started this process may have failed.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut s = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => panic!("no dialler: {e}"),
            }
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        println!("received {} bytes", got.len());
    }
}
