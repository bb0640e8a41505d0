//! Shared-memory connections between ranks on one host: two single-producer,
//! single-consumer byte rings in one sealed memfd, one ring each way. The
//! bytes are the same frames TCP carries, so the mesh reads and writes them
//! through `Read`/`Write` and nothing above the transport can tell them apart.
//!
//! The memfd has no name anywhere: the dialling rank passes it over a Unix
//! socket (SCM_RIGHTS) after the token handshake, so no other process can
//! attach to it and nothing is left behind when a process is killed. The Unix
//! socket stays open: the kernel closes it when a process dies, which is how
//! the survivor learns of it as fast as over TCP.
//!
//! Waiting sides spin briefly, then sleep on a futex in the shared page; the
//! other side wakes them only when they said they sleep, so an idle rank uses
//! no CPU and a busy one makes no syscalls.

use crate::error::{Error, Result};
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Control block of a ring: one page, producer and consumer fields on their
/// own cache lines.
const CTL_BYTES: usize = 4096;
const MAGIC: u64 = 0x5243_3130_5348_4d31; // "RC10SHM1"

/// A sleeper re-checks this often even without a wake-up (a belt to the
/// futex's braces; a sleeping rank wakes ten times a second at most).
const NAP: Duration = Duration::from_millis(100);

#[repr(C)]
struct Ctl {
    magic: AtomicU64,
    capacity: AtomicU64,
    closed: AtomicU32,
    _p0: [u8; 64 - 20],
    /// Bytes written so far (the producer's).
    head: AtomicU64,
    /// Bumped to wake a sleeping consumer.
    data_seq: AtomicU32,
    writer_sleeps: AtomicU32,
    _p1: [u8; 64 - 16],
    /// Bytes read so far (the consumer's).
    tail: AtomicU64,
    /// Bumped to wake a sleeping producer.
    space_seq: AtomicU32,
    reader_sleeps: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<Ctl>() <= CTL_BYTES);

/// A shared mapping of two rings; unmapped when the last user drops it.
pub struct Segment {
    base: *mut u8,
    len: usize,
    capacity: usize,
}
// The rings inside are only touched through atomics and the SPSC protocol.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Segment {
    fn bytes_for(capacity: usize) -> usize {
        2 * (CTL_BYTES + capacity)
    }

    /// A new anonymous, sealed segment with two empty rings of `capacity` bytes.
    pub fn create(capacity: usize) -> Result<(Segment, OwnedFd)> {
        assert!(capacity.is_power_of_two());
        let fd = unsafe { libc::memfd_create(c"rustc10d".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(os_error("memfd_create"));
        }
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = Self::bytes_for(capacity);
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_error("ftruncate"));
        }
        // A peer can neither shrink it under us (SIGBUS) nor change the seals.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(os_error("sealing the segment"));
        }
        let seg = Segment::map(fd.as_raw_fd(), len, capacity)?;
        for side in 0..2 {
            let ctl = seg.ctl(side);
            ctl.capacity.store(capacity as u64, Ordering::Relaxed);
            ctl.magic.store(MAGIC, Ordering::Release);
        }
        Ok((seg, fd))
    }

    /// Map a segment a peer created, after checking it is what it claims.
    pub fn open(fd: &OwnedFd) -> Result<Segment> {
        let raw = fd.as_raw_fd();
        let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::io("rustc10d: the shared-memory segment a peer sent is not sealed"));
        }
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(raw, &mut st) } != 0 {
            return Err(os_error("fstat"));
        }
        let len = st.st_size as usize;
        // Read the capacity from the first control block, then check it all.
        let probe = Segment::map(raw, CTL_BYTES, 0)?;
        let (magic, capacity) =
            (probe.ctl(0).magic.load(Ordering::Acquire), probe.ctl(0).capacity.load(Ordering::Relaxed) as usize);
        drop(probe);
        if magic != MAGIC || !capacity.is_power_of_two() || Self::bytes_for(capacity) != len {
            return Err(Error::io("rustc10d: malformed shared-memory segment from a peer"));
        }
        Segment::map(raw, len, capacity)
    }

    fn map(fd: RawFd, len: usize, capacity: usize) -> Result<Segment> {
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if base == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        Ok(Segment { base: base.cast(), len, capacity })
    }

    fn ring_base(&self, side: usize) -> *mut u8 {
        unsafe { self.base.add(side * (CTL_BYTES + self.capacity)) }
    }

    fn ctl(&self, side: usize) -> &Ctl {
        unsafe { &*(self.ring_base(side) as *const Ctl) }
    }

    fn data(&self, side: usize) -> *mut u8 {
        unsafe { self.ring_base(side).add(CTL_BYTES) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// One end of a connection: writes into ring `out`, reads from the other.
/// The dialling side writes ring 0, the accepting side ring 1.
pub struct ShmConn {
    seg: Arc<Segment>,
    out: usize,
    /// Kept open for its lifetime only: its closing tells the peer we are gone.
    sock: UnixStream,
    /// Bounds a write that waits for space (milliseconds, 0 = none).
    write_timeout_ms: AtomicU64,
    spin: Duration,
}

impl ShmConn {
    pub fn new(seg: Arc<Segment>, dialled: bool, sock: UnixStream, spin: Duration) -> ShmConn {
        ShmConn { seg, out: if dialled { 0 } else { 1 }, sock, write_timeout_ms: AtomicU64::new(0), spin }
    }

    fn outgoing(&self) -> Ring<'_> {
        Ring { seg: &self.seg, side: self.out }
    }

    fn incoming(&self) -> Ring<'_> {
        Ring { seg: &self.seg, side: 1 - self.out }
    }

    /// Close both directions: whoever waits on either ring returns now.
    pub fn shutdown(&self) {
        self.outgoing().close();
        self.incoming().close();
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) {
        self.write_timeout_ms.store(t.map_or(0, |t| t.as_millis().max(1) as u64), Ordering::Relaxed);
    }

    /// Block until the peer's end of the socket closes (it exited, or shut
    /// the connection down), then close the rings so that waiters wake.
    pub fn watch(&self) {
        let mut byte = [0u8; 1];
        loop {
            match (&self.sock).read(&mut byte) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // Nothing is sent after the handshake: a byte is a protocol error.
                _ => break,
            }
        }
        self.outgoing().close();
        self.incoming().close();
    }

    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.incoming().read(buf, self.spin)
    }

    pub fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let ms = self.write_timeout_ms.load(Ordering::Relaxed);
        let deadline = (ms > 0).then(|| Instant::now() + Duration::from_millis(ms));
        self.outgoing().write(bufs, self.spin, deadline)
    }
}

impl Read for &ShmConn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        ShmConn::read(self, buf)
    }
}

impl Write for &ShmConn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        ShmConn::write_vectored(self, &[IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        ShmConn::write_vectored(self, bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One direction of a segment. Exactly one thread writes and one reads at a
/// time (the mesh serialises writers with a lock and has one reader per
/// connection).
struct Ring<'a> {
    seg: &'a Segment,
    side: usize,
}

impl Ring<'_> {
    fn ctl(&self) -> &Ctl {
        self.seg.ctl(self.side)
    }

    fn close(&self) {
        let c = self.ctl();
        c.closed.store(1, Ordering::SeqCst);
        for word in [&c.data_seq, &c.space_seq] {
            word.fetch_add(1, Ordering::SeqCst);
            futex_wake(word);
        }
    }

    fn is_closed(&self) -> bool {
        self.ctl().closed.load(Ordering::Acquire) != 0
    }

    /// Bytes ready to read, checked against a peer that scribbles on the positions.
    fn filled(&self, tail: u64) -> io::Result<usize> {
        let n = self.ctl().head.load(Ordering::Acquire).wrapping_sub(tail);
        if n > self.seg.capacity as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "corrupt shared-memory ring"));
        }
        Ok(n as usize)
    }

    /// Copy out what is there (at least one byte): Ok(0) once closed and drained.
    fn read(&self, buf: &mut [u8], spin: Duration) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let c = self.ctl();
        let cap = self.seg.capacity;
        let tail = c.tail.load(Ordering::Relaxed);
        let mut waited: Option<Instant> = None;
        let filled = loop {
            let n = self.filled(tail)?;
            if n > 0 {
                break n;
            }
            if self.is_closed() {
                // Bytes written just before the close still count.
                match self.filled(tail)? {
                    0 => return Ok(0),
                    n => break n,
                }
            }
            if waited.get_or_insert_with(Instant::now).elapsed() < spin {
                std::thread::yield_now();
                continue;
            }
            sleep_unless(&c.data_seq, &c.reader_sleeps, || self.filled(tail).is_ok_and(|n| n > 0) || self.is_closed());
        };
        let n = filled.min(buf.len());
        let at = (tail as usize) & (cap - 1);
        let first = n.min(cap - at);
        unsafe {
            std::ptr::copy_nonoverlapping(self.seg.data(self.side).add(at), buf.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.seg.data(self.side), buf.as_mut_ptr().add(first), n - first);
        }
        c.tail.store(tail + n as u64, Ordering::SeqCst);
        wake_if_asleep(&c.space_seq, &c.writer_sleeps);
        Ok(n)
    }

    /// Copy in as much of `bufs` as fits (at least one byte, waiting for space).
    fn write(&self, bufs: &[IoSlice<'_>], spin: Duration, deadline: Option<Instant>) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Ok(0);
        }
        let c = self.ctl();
        let cap = self.seg.capacity;
        let head = c.head.load(Ordering::Relaxed);
        let free = |c: &Ctl| cap - (head.wrapping_sub(c.tail.load(Ordering::Acquire)) as usize).min(cap);
        let mut waited: Option<Instant> = None;
        let room = loop {
            if self.is_closed() {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            let room = free(c);
            if room > 0 {
                break room;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(io::ErrorKind::TimedOut.into());
            }
            if waited.get_or_insert_with(Instant::now).elapsed() < spin {
                std::thread::yield_now();
                continue;
            }
            sleep_unless(&c.space_seq, &c.writer_sleeps, || free(c) > 0 || self.is_closed());
        };
        let mut pos = head;
        let mut left = room.min(total);
        for b in bufs {
            let mut src: &[u8] = b;
            while left > 0 && !src.is_empty() {
                let at = (pos as usize) & (cap - 1);
                let n = src.len().min(left).min(cap - at);
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.seg.data(self.side).add(at), n) };
                src = &src[n..];
                pos += n as u64;
                left -= n;
            }
        }
        c.head.store(pos, Ordering::SeqCst);
        wake_if_asleep(&c.data_seq, &c.reader_sleeps);
        Ok((pos - head) as usize)
    }
}

/// Sleep on `seq` (until woken, or NAP) unless `ready()`, announcing it in
/// `sleeps` first. With `wake_if_asleep` this is a Dekker handshake: the waker
/// publishes its progress then reads `sleeps`, the sleeper sets `sleeps` then
/// re-checks progress, so one of them always sees the other.
fn sleep_unless(seq: &AtomicU32, sleeps: &AtomicU32, ready: impl Fn() -> bool) {
    let expected = seq.load(Ordering::SeqCst);
    sleeps.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    if !ready() {
        futex_wait(seq, expected, NAP);
    }
    sleeps.store(0, Ordering::Relaxed);
}

/// After publishing progress: wake the other side if it sleeps.
fn wake_if_asleep(seq: &AtomicU32, sleeps: &AtomicU32) {
    fence(Ordering::SeqCst);
    if sleeps.load(Ordering::SeqCst) != 0 {
        seq.fetch_add(1, Ordering::SeqCst);
        futex_wake(seq);
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // Shared (not PRIVATE): the word lives in memory mapped by two processes.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec) };
}

fn futex_wake(word: &AtomicU32) {
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

fn os_error(what: &str) -> Error {
    Error::io(format!("rustc10d: {what} failed: {}", io::Error::last_os_error()))
}

/// A one-byte message with room for one fd in its control data, for `f`.
fn with_fd_msg<R>(byte: u8, f: impl FnOnce(&mut libc::msghdr) -> R) -> R {
    let mut byte = [byte];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    f(&mut msg)
}

fn cmsg_len_one_fd() -> usize {
    unsafe { libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize }
}

/// Send `fd` with one byte of payload over `sock`.
pub fn send_fd(sock: &UnixStream, fd: RawFd) -> io::Result<()> {
    with_fd_msg(1, |msg| {
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = cmsg_len_one_fd() as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut RawFd, fd);
        }
        loop {
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

/// Receive one fd sent by `send_fd` (honours the socket's read timeout).
pub fn recv_fd(sock: &UnixStream) -> io::Result<OwnedFd> {
    with_fd_msg(0, |msg| {
        let n = loop {
            let n = unsafe { libc::recvmsg(sock.as_raw_fd(), msg, libc::MSG_CMSG_CLOEXEC) };
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            break n;
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let cmsg = unsafe { libc::CMSG_FIRSTHDR(msg) };
        let ok = n == 1
            && !cmsg.is_null()
            && unsafe { (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS }
            && unsafe { (*cmsg).cmsg_len } as usize == cmsg_len_one_fd();
        if !ok {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "expected one file descriptor"));
        }
        let fd = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const RawFd) };
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    })
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

    fn pair(capacity: usize) -> (ShmConn, ShmConn) {
        let (seg, fd) = Segment::create(capacity).unwrap();
        let other = Segment::open(&fd).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let spin = Duration::from_micros(20);
        (ShmConn::new(Arc::new(seg), true, a, spin), ShmConn::new(Arc::new(other), false, b, spin))
    }

    #[test]
    fn bytes_arrive_in_order_across_wraps() {
        let (a, b) = pair(64 << 10);
        let data: Vec<u8> = (0..1_000_003u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let sent = data.clone();
        let writer = std::thread::spawn(move || {
            let w = &a;
            // Odd chunk sizes, header + payload in one call, like frames.
            for chunk in sent.chunks(40_961) {
                let (h, p) = chunk.split_at(chunk.len().min(32));
                let mut bufs = [IoSlice::new(h), IoSlice::new(p)];
                let mut bufs = &mut bufs[..];
                while !bufs.is_empty() {
                    let n = w.write_vectored(bufs).unwrap();
                    IoSlice::advance_slices(&mut bufs, n);
                }
            }
            a
        });
        let mut got = vec![0u8; data.len()];
        (&b).read_exact(&mut got).unwrap();
        assert!(got == data);
        let a = writer.join().unwrap();
        a.shutdown();
        assert_eq!(b.read(&mut [0u8; 4]).unwrap(), 0, "EOF after close and drain");
        assert!((&b).write(&[1]).is_err(), "no writes after close");
    }

    #[test]
    fn close_wakes_a_sleeping_reader_and_writer() {
        let (a, b) = pair(64 << 10);
        let b = Arc::new(b);
        let reader = {
            let b = b.clone();
            std::thread::spawn(move || b.read(&mut [0u8; 8]).unwrap())
        };
        std::thread::sleep(Duration::from_millis(30));
        a.shutdown();
        assert_eq!(reader.join().unwrap(), 0);

        let (a, _b) = pair(64 << 10);
        let a = Arc::new(a);
        let writer = {
            let a = a.clone();
            std::thread::spawn(move || (&*a).write_all(&vec![0u8; 1 << 20]))
        };
        std::thread::sleep(Duration::from_millis(30));
        a.shutdown();
        assert!(writer.join().unwrap().is_err());
    }

    #[test]
    fn peer_exit_is_seen_through_the_socket() {
        let (a, b) = pair(64 << 10);
        let b = Arc::new(b);
        let watcher = {
            let b = b.clone();
            std::thread::spawn(move || b.watch())
        };
        (&a).write_all(b"last words").unwrap();
        drop(a); // closes its socket, as the kernel does for a killed process
        watcher.join().unwrap();
        let mut got = Vec::new();
        (&*b).read_to_end(&mut got).unwrap();
        assert_eq!(got, b"last words");
    }

    #[test]
    fn write_timeout_bounds_a_full_ring() {
        let (a, _b) = pair(64 << 10);
        a.set_write_timeout(Some(Duration::from_millis(50)));
        let t = Instant::now();
        let err = (&a).write_all(&vec![0u8; 1 << 20]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn segments_travel_over_a_unix_socket_and_are_checked() {
        let (s1, s2) = UnixStream::pair().unwrap();
        let (seg, fd) = Segment::create(64 << 10).unwrap();
        send_fd(&s1, fd.as_raw_fd()).unwrap();
        let got = recv_fd(&s2).unwrap();
        let peer = Segment::open(&got).unwrap();
        assert_eq!(peer.capacity, seg.capacity);

        // An unsealed memfd, or a plain byte, is refused.
        let raw = unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC) };
        let plain = unsafe { OwnedFd::from_raw_fd(raw) };
        assert!(Segment::open(&plain).is_err());
        (&s1).write_all(&[1]).unwrap();
        assert!(recv_fd(&s2).is_err());
    }

    #[test]
    fn host_key_is_stable() {
        assert_eq!(host_key(), host_key());
        assert!(host_key().is_some());
    }
}
