//! A connection with a peer as the mesh sees it: a two-way byte stream of
//! frames, over TCP or through shared memory, that never blocks. When a side
//! must wait (nothing to read, no room to write) the reactor waits for it:
//! on the socket for TCP; for shared memory on an eventfd the peer writes to
//! once it has read or written, and on the Unix socket, which the kernel
//! closes when the peer process dies.
//!
//! Between ranks of one host, a large message can also cross in one copy:
//! the sender writes only its address into the ring, the receiver reads the
//! bytes straight from the sender's memory (`process_vm_readv`), then says
//! so in the ring's control block and wakes the sender, which keeps the
//! bytes until then. The acknowledgement does not queue behind frames, so
//! a reader that waits for a receive to be posted never holds it back. Whether the
//! kernel allows it (ptrace rules, containers) is tried once per connection,
//! by reading the peer's mapping of the segment; otherwise the rings carry
//! everything.

use crate::locks::{level, Mutex};
use crate::transport::links::fdpass::{drain, notify, peer_cred};
use crate::transport::links::ring::{Ring, Segment, FIRST_WORD};
use crate::transport::links::seal::{Opener, SealKeys, Sealer};
use std::io::{self, IoSlice};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, Ordering};

pub enum Conn {
    Tcp(TcpConn),
    Shm(ShmConn),
}

/// A TCP connection, its frames sealed where the group asks (seal.rs).
pub struct TcpConn {
    stream: TcpStream,
    /// Boxed: the ciphers' key schedules are large, and most connections have none.
    sealed: Option<Box<Sealed>>,
}

/// A sealed connection's two directions: each used by one thread at a time
/// (the link's writer under its outbox lock, its reader under the reader's), so
/// these locks are leaves that are never contended.
struct Sealed {
    sealer: Mutex<level::Sealer, Sealer>,
    opener: Mutex<level::Opener, Opener>,
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
    /// The peer process, when this side can read its memory directly.
    peer_pid: Option<libc::pid_t>,
    /// Messages of at least this many bytes go as their address when the
    /// peer can read this side's memory (0: never).
    direct_from: usize,
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
    /// `dialled`: this side dialled (it writes ring 0). With `direct_from`
    /// above 0, messages of that size or more cross in one copy where the
    /// kernel allows it (each side has said where it maps the segment before
    /// the other makes its ShmConn).
    pub fn new(
        seg: Segment,
        dialled: bool,
        sock: UnixStream,
        mine: OwnedFd,
        theirs: OwnedFd,
        direct_from: usize,
    ) -> ShmConn {
        let mut conn =
            ShmConn { seg, out: if dialled { 0 } else { 1 }, sock, mine, theirs, peer_pid: None, direct_from };
        conn.outgoing().set_writer_base();
        if direct_from > 0 {
            conn.peer_pid = conn.probe_direct_reads();
            if conn.peer_pid.is_some() {
                conn.incoming().allow_direct_reads();
            }
        }
        conn
    }

    /// The peer's process, if this side can read its memory: the kernel
    /// names it (SO_PEERCRED), and a read of its mapping of the segment
    /// must find the segment's first word.
    fn probe_direct_reads(&self) -> Option<libc::pid_t> {
        let cred = peer_cred(&self.sock).ok()?;
        let base = self.incoming().writer_base();
        if cred.pid <= 0 || base == 0 {
            return None;
        }
        let mut word = [0u8; 8];
        match read_process(cred.pid, base, &mut word) {
            Ok(()) if u64::from_ne_bytes(word) == FIRST_WORD => Some(cred.pid),
            _ => None,
        }
    }

    fn outgoing(&self) -> Ring<'_> {
        self.seg.ring(self.out)
    }

    fn incoming(&self) -> Ring<'_> {
        self.seg.ring(1 - self.out)
    }
}

impl Conn {
    /// A TCP connection whose handshake is done, its frames sealed with `keys`, if given.
    pub fn tcp(stream: TcpStream, keys: Option<SealKeys>) -> Conn {
        let sealed = keys.map(|k| {
            Box::new(Sealed { sealer: Mutex::new(Sealer::new(&k.send)), opener: Mutex::new(Opener::new(&k.open)) })
        });
        Conn::Tcp(TcpConn { stream, sealed })
    }

    /// Whether a sealed record waits for the socket, its bytes not yet
    /// counted written (see `write`).
    pub fn holds_record(&self) -> bool {
        matches!(self, Conn::Tcp(TcpConn { sealed: Some(s), .. }) if s.sealer.lock().unwrap().holds_record())
    }

    pub fn is_shm(&self) -> bool {
        matches!(self, Conn::Shm(_))
    }

    /// Whether a message of `len` bytes goes as its address (see the top).
    pub fn sends_directly(&self, len: usize) -> bool {
        match self {
            Conn::Shm(s) => s.direct_from > 0 && len >= s.direct_from && s.outgoing().direct_reads(),
            Conn::Tcp(_) => false,
        }
    }

    /// Bytes written into a TCP socket that the peer has not acknowledged yet
    /// (0 for shared memory, or if the kernel will not say).
    pub fn unsent(&self) -> u64 {
        match self {
            Conn::Tcp(TcpConn { stream: s, sealed }) => {
                // A sealed record's bytes the socket has not taken yet are not sent either.
                let held = sealed.as_ref().map_or(0, |x| x.sealer.lock().unwrap().pending().len() as u64);
                let mut n: libc::c_int = 0;
                // SAFETY: ioctl(TIOCOUTQ) writes one c_int into `n`, a live local; the socket is open (borrowed).
                let rc = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
                held + if rc == 0 { n.max(0) as u64 } else { 0 }
            }
            Conn::Shm(_) => 0,
        }
    }

    /// Whether the peer may send messages as their address here: this side
    /// reads its memory, and said so (`ShmConn::new`); never over TCP.
    pub fn takes_addresses(&self) -> bool {
        matches!(self, Conn::Shm(ShmConn { peer_pid: Some(_), .. }))
    }

    /// Read `buf.len()` bytes at `addr` in the peer's memory (a message it
    /// sent as its address).
    pub fn read_peer(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        match self {
            Conn::Shm(ShmConn { peer_pid: Some(pid), .. }) => read_process(*pid, addr, buf),
            _ => Err(io::Error::new(io::ErrorKind::InvalidData, "the peer sent an address this side cannot read")),
        }
    }

    /// The messages the peer sent as their address are read, up to number `id`.
    pub fn ack_read(&self, id: u64) {
        if let Conn::Shm(s) = self {
            s.incoming().ack(id);
            notify(&s.theirs);
        }
    }

    /// The number of the last message this side sent as its address that the peer has read.
    pub fn acked(&self) -> u64 {
        match self {
            Conn::Shm(s) => s.outgoing().acked(),
            Conn::Tcp(_) => 0,
        }
    }

    /// After reading a peer's memory: whether the peer had given up by then
    /// (then the bytes read may have been freed and reused meanwhile). The
    /// peer closes the rings before it lets go of a send's memory.
    pub fn peer_let_go(&self) -> bool {
        fence(Ordering::SeqCst);
        match self {
            Conn::Shm(s) => s.incoming().is_closed(),
            Conn::Tcp(_) => false,
        }
    }

    /// The descriptors the reactor watches, and what each tells.
    pub fn watched(&self) -> Vec<(RawFd, Watch)> {
        match self {
            Conn::Tcp(t) => vec![(t.stream.as_raw_fd(), Watch::Data)],
            Conn::Shm(s) => vec![(s.mine.as_raw_fd(), Watch::Data), (s.sock.as_raw_fd(), Watch::Liveness)],
        }
    }

    /// Read what is there: WouldBlock when nothing is, Ok(0) at the end.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(TcpConn { stream, sealed: None }) => recv(stream, buf, 0),
            Conn::Tcp(TcpConn { stream, sealed: Some(sealed) }) => {
                let mut opener = sealed.opener.lock().unwrap();
                loop {
                    let n = opener.take(buf)?;
                    if n > 0 || buf.is_empty() {
                        return Ok(n);
                    }
                    match recv(stream, opener.room(), 0)? {
                        0 if opener.mid_record() => {
                            return Err(io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                "the connection ended within a sealed record",
                            ))
                        }
                        0 => return Ok(0),
                        got => opener.received(got),
                    }
                }
            }
            Conn::Shm(s) => {
                let n = s.incoming().read(buf)?;
                if n > 0 && s.incoming().writer_asleep() {
                    notify(&s.theirs);
                }
                Ok(n)
            }
        }
    }

    /// Write what fits: WouldBlock when nothing does. Sealed, the bytes
    /// count as written once their record is in the socket whole; until
    /// then the writer is told WouldBlock and offers the same bytes again.
    pub fn write(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Conn::Tcp(TcpConn { stream, sealed: None }) => send(stream, bufs),
            Conn::Tcp(TcpConn { stream, sealed: Some(sealed) }) => {
                let mut sealer = sealed.sealer.lock().unwrap();
                if !sealer.holds_record() && sealer.seal(bufs)? == 0 {
                    return Ok(0);
                }
                while !sealer.pending().is_empty() {
                    match send(stream, &[IoSlice::new(sealer.pending())])? {
                        0 => return Err(io::ErrorKind::WriteZero.into()),
                        n => sealer.sent(n),
                    }
                }
                Ok(sealer.delivered().expect("all of it was sent"))
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

    /// Whether the peer has closed a TCP connection that this side does not
    /// read now (held back by a cap): nothing is left to read before its end,
    /// or the connection failed. Shared memory says so through its Unix socket.
    pub fn peer_closed(&self) -> bool {
        let Conn::Tcp(TcpConn { stream, sealed }) = self else { return false };
        if sealed.as_ref().is_some_and(|s| s.opener.lock().unwrap().mid_record()) {
            return false;
        }
        match recv(stream, &mut [0u8; 1], libc::MSG_PEEK) {
            Ok(n) => n == 0,
            Err(e) => e.kind() != io::ErrorKind::WouldBlock,
        }
    }

    /// The reader is about to wait for the reactor: false if there is
    /// something to read after all (shared memory; TCP always waits).
    pub fn reader_waits(&self) -> bool {
        match self {
            Conn::Tcp(TcpConn { sealed: Some(sealed), .. }) => !sealed.opener.lock().unwrap().holds_more(),
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
            Conn::Tcp(t) => {
                let _ = t.stream.shutdown(Shutdown::Both);
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

/// Copy `buf.len()` bytes at `addr` in process `pid` into `buf`.
pub fn read_process(pid: libc::pid_t, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let local = libc::iovec { iov_base: buf[done..].as_mut_ptr().cast(), iov_len: buf.len() - done };
        let remote = libc::iovec { iov_base: (addr as usize + done) as *mut libc::c_void, iov_len: buf.len() - done };
        // SAFETY: `local` describes buf[done..], borrowed mutably for the call, into
        // which the kernel writes at most iov_len bytes; `remote` is an address
        // in the peer process, which the kernel checks and reads there (a bad
        // one is an error, never a write of ours).
        let n = retry_interrupted(|| unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) })?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer's memory ended early"));
        }
        done += n;
    }
    Ok(())
}

/// Read what a socket has, without blocking (`flags` besides: MSG_PEEK leaves it there).
fn recv(stream: &TcpStream, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: recv writes at most buf.len() bytes into `buf`, which is borrowed
    // mutably for the call; the socket is open (borrowed).
    retry_interrupted(|| unsafe {
        libc::recv(stream.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT | flags)
    })
}

/// Write what a socket takes of `bufs`, without blocking.
fn send(stream: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: msghdr is plain C data: all zeroes is a valid value (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec; // IoSlice is an iovec on unix
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: `msg` lives across the call and points at `bufs`, a live slice of
    // IoSlice, which std guarantees is ABI-compatible with iovec on Unix;
    // sendmsg only reads them (and the bytes they point at, borrowed).
    retry_interrupted(|| unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) })
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
pub mod tests {
    use super::*;
    use crate::transport::links::fdpass::eventfd;

    /// Two ends of a sealed TCP connection, non-blocking.
    fn sealed_pair() -> (Conn, Conn) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let b = listener.accept().unwrap().0;
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        let keys = |send: u8, open: u8| Some(SealKeys { send: [send; 32], open: [open; 32] });
        (Conn::tcp(a, keys(1, 2)), Conn::tcp(b, keys(2, 1)))
    }

    /// Bytes written to a sealed connection count only once their record is
    /// in the socket whole: until then `write` says WouldBlock and the
    /// connection holds the record (a writer is mid-frame), and the same bytes
    /// offered again complete it. The reader gets every byte, in order.
    #[test]
    fn a_sealed_record_counts_as_written_only_once_sent_whole() {
        let (a, b) = sealed_pair();
        let data: Vec<u8> = (0..16u32 << 20).map(|i| (i % 251) as u8).collect();
        let (mut written, mut held) = (0, false);
        while written < data.len() {
            match a.write(&[IoSlice::new(&data[written..])]) {
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    held |= a.holds_record();
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(held && written < data.len(), "the socket filled up within a record: {written} written");
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        while got.len() < data.len() {
            match b.read(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
            if written < data.len() {
                match a.write(&[IoSlice::new(&data[written..])]) {
                    Ok(n) => written += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => assert!(a.holds_record()),
                    Err(e) => panic!("{e}"),
                }
            }
        }
        assert!(got == data && !a.holds_record());
    }

    fn pair() -> (Conn, Conn) {
        pair_direct_from(0)
    }

    /// As the dialler and the acceptor make them (here both in this process).
    pub fn pair_direct_from(direct_from: usize) -> (Conn, Conn) {
        let (seg, fd) = Segment::create(64 << 10).unwrap();
        let other = Segment::open(&fd).unwrap();
        other.ring(1).set_writer_base();
        let (s1, s2) = UnixStream::pair().unwrap();
        let (e1, e2) = (eventfd().unwrap(), eventfd().unwrap());
        let (e1b, e2b) = (e1.try_clone().unwrap(), e2.try_clone().unwrap());
        let b = Conn::Shm(ShmConn::new(other, false, s2, e2, e1b, direct_from));
        let a = Conn::Shm(ShmConn::new(seg, true, s1, e1, e2b, direct_from));
        (a, b)
    }

    #[test]
    fn large_messages_go_as_their_address_once_the_peer_has_read_ours() {
        let (a, b) = pair_direct_from(4096);
        assert!(a.sends_directly(4096) && b.sends_directly(1 << 20), "each side read the other's mapping");
        assert!(!a.sends_directly(4095), "below the threshold: the rings");
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut got = vec![0u8; data.len()];
        b.read_peer(data.as_ptr() as u64, &mut got).unwrap();
        assert!(got == data);
        assert_eq!(a.acked(), 0);
        b.ack_read(3);
        assert_eq!(a.acked(), 3, "the sender sees it may let go");
        assert!(pending(a.watched()[0].0), "and is woken for it");
        assert!(!b.peer_let_go());
        a.shutdown();
        assert!(b.peer_let_go(), "a sender that gave up may have reused what was read");
        let (off, _) = pair_direct_from(0);
        assert!(!off.sends_directly(1 << 20), "0: never");
        assert!(off.read_peer(data.as_ptr() as u64, &mut got).is_err(), "nor read an address");
    }

    fn pending(fd: RawFd) -> bool {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: poll reads and writes one pollfd, `p`, a live local.
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
