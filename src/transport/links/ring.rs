//! The shared memory of a connection between two ranks on one host: two
//! single-producer, single-consumer byte rings in one sealed memfd, one ring
//! each way. Reads and writes never block: an empty or full ring says
//! WouldBlock, and a side about to wait says so in the ring (`sleeps`) so
//! that the other side wakes it after its next write or read (`conn.rs` does
//! the waking, with an eventfd). Whoever publishes progress then reads the
//! flag, and whoever sets the flag then re-checks progress: one of them
//! always sees the other.
//!
//! Each ring's control block also says where its writer maps the segment,
//! whether its reader may read the writer's memory directly (see `conn.rs`:
//! large messages then cross in one copy instead of two), and which of the
//! messages sent so it has read.
//!
//! The peer process writes this memory while this one reads it. The
//! control blocks are atomics only, and what they hold (positions, the
//! capacity) is checked before it bounds a copy. The ring bytes are the
//! data path and are copied as plain bytes: `Ring::read` says why that is
//! sound.

// The segment is memory another process writes: every unsafe block says
// why its access is in bounds and race-free.
#![deny(clippy::undocumented_unsafe_blocks)]

use crate::error::{Error, Result};
use crate::transport::links::shared_mem::{sealed_len, sealed_memfd, Mapping};
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};

/// Control block of a ring: one page, producer and consumer fields on their
/// own cache lines.
const CTL_BYTES: usize = 4096;
const MAGIC: u64 = 0x5243_3130_5348_4d33; // "RC10SHM3"
/// A segment's first eight bytes, in every mapping of it.
pub const FIRST_WORD: u64 = MAGIC;

/// Bytes that keep fields on cache lines of their own. Never read or
/// written here; atomics all the same, so that a `&Ctl` claims nothing about
/// memory the peer may write.
type Pad<const N: usize> = [AtomicU8; N];

#[repr(C)]
struct Ctl {
    magic: AtomicU64,
    capacity: AtomicU64,
    closed: AtomicU32,
    _p0: Pad<{ 64 - 20 }>,
    /// Bytes written so far (the producer's).
    head: AtomicU64,
    /// The producer waits for space: wake it after a read.
    writer_sleeps: AtomicU32,
    _p1: Pad<{ 64 - 12 }>,
    /// Bytes read so far (the consumer's).
    tail: AtomicU64,
    /// The consumer waits for data: wake it after a write.
    reader_sleeps: AtomicU32,
    _p2: Pad<{ 64 - 12 }>,
    /// The writer's address of the segment's first byte, in its own process.
    writer_base: AtomicU64,
    /// The reader has read the writer's memory at `writer_base` directly:
    /// the writer may send large messages as their address.
    direct_reads: AtomicU32,
    _p3: Pad<{ 64 - 12 }>,
    /// The reader has read every message sent as its address up to this
    /// number (they are read in order): the writer may let go of them.
    acked: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Ctl>() <= CTL_BYTES);
// A control block starts the mapping (a page) or follows one and a ring of
// a power of two bytes >= CTL_BYTES (`create` and `open` insist): aligned.
const _: () = assert!(CTL_BYTES.is_multiple_of(std::mem::align_of::<Ctl>()));

/// A shared mapping of two rings; unmapped when the last user drops it.
pub struct Segment {
    map: Mapping,
    capacity: usize,
}

impl Segment {
    /// None if it does not fit in an address: a peer's capacity is checked
    /// with this, so it must not wrap around to a small size.
    fn bytes_for(capacity: usize) -> Option<usize> {
        CTL_BYTES.checked_add(capacity)?.checked_mul(2)
    }

    /// A new anonymous, sealed segment with two empty rings of `capacity` bytes.
    pub fn create(capacity: usize) -> Result<(Segment, OwnedFd)> {
        assert!(capacity.is_power_of_two() && capacity >= CTL_BYTES);
        let len = Self::bytes_for(capacity).ok_or_else(|| Error::invalid("rustc10d: shared-memory rings too large"))?;
        let fd = sealed_memfd(len)?;
        let seg = Segment { map: Mapping::of(fd.as_raw_fd(), len)?, capacity };
        for side in 0..2 {
            let ctl = seg.ctl(side);
            ctl.capacity.store(capacity as u64, Ordering::Relaxed);
            ctl.magic.store(MAGIC, Ordering::Release);
        }
        // The creator writes ring 0: say where before the peer maps it.
        seg.ring(0).set_writer_base();
        Ok((seg, fd))
    }

    /// Map a segment a peer created, after checking it is what it claims.
    pub fn open(fd: &OwnedFd) -> Result<Segment> {
        let len = sealed_len(fd, "shared-memory segment")?;
        let malformed = || Error::io("rustc10d: malformed shared-memory segment from a peer");
        if len < CTL_BYTES {
            return Err(malformed());
        }
        // Read the capacity from the first control block, then check it all.
        let probe = Segment { map: Mapping::of(fd.as_raw_fd(), CTL_BYTES)?, capacity: 0 };
        let (magic, capacity) =
            (probe.ctl(0).magic.load(Ordering::Acquire), probe.ctl(0).capacity.load(Ordering::Relaxed) as usize);
        drop(probe);
        // A smaller ring (none is made) would leave the second control block misaligned.
        let fits = capacity.is_power_of_two() && capacity >= CTL_BYTES && Self::bytes_for(capacity) == Some(len);
        if magic != MAGIC || !fits {
            return Err(malformed());
        }
        Ok(Segment { map: Mapping::of(fd.as_raw_fd(), len)?, capacity })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Ring `side` (0: written by the dialling rank, 1: by the accepting one).
    pub fn ring(&self, side: usize) -> Ring<'_> {
        assert!(side < 2, "a segment has two rings");
        Ring { seg: self, side }
    }

    /// The control block of ring `side` (< 2), then its `capacity` bytes.
    fn ring_base(&self, side: usize) -> *mut u8 {
        debug_assert!(side < 2);
        // SAFETY: the mapping is `bytes_for(capacity)` = 2 (CTL_BYTES +
        // capacity) bytes (made so, or checked in `open`; the probe there
        // maps CTL_BYTES and uses side 0 only), so ring 0 or 1 starts inside
        // it; `self.map` keeps it mapped while `self` is borrowed.
        unsafe { self.map.base.add(side * (CTL_BYTES + self.capacity)) }
    }

    fn ctl(&self, side: usize) -> &Ctl {
        // SAFETY: a ring starts with CTL_BYTES >= size_of::<Ctl>() bytes of
        // its control block, aligned (see the assertion on CTL_BYTES). Every
        // field of Ctl is an atomic, valid as zeroes (a new memfd), so the
        // reference may alias the peer's writes; it lives no longer than
        // the borrow of `self`, which keeps the mapping.
        unsafe { &*(self.ring_base(side) as *const Ctl) }
    }

    /// The first of ring `side`'s `capacity` bytes.
    fn data(&self, side: usize) -> *mut u8 {
        // SAFETY: the ring's bytes follow its control block inside the
        // mapping (see `ring_base`).
        unsafe { self.ring_base(side).add(CTL_BYTES) }
    }
}

/// One direction of a segment. At most one thread writes and one reads at a
/// time (the connection serialises each side with a lock: `Link`'s reader
/// and outbox): `read` and `write` rely on it for their copies to not race.
pub struct Ring<'a> {
    seg: &'a Segment,
    side: usize,
}

impl Ring<'_> {
    fn ctl(&self) -> &Ctl {
        self.seg.ctl(self.side)
    }

    /// The writer says where it maps the segment.
    pub fn set_writer_base(&self) {
        self.ctl().writer_base.store(self.seg.map.base as u64, Ordering::Release);
    }

    /// Where the writer maps the segment (0: not said yet).
    pub fn writer_base(&self) -> u64 {
        self.ctl().writer_base.load(Ordering::Acquire)
    }

    /// The reader says it can read the writer's memory directly.
    pub fn allow_direct_reads(&self) {
        self.ctl().direct_reads.store(1, Ordering::Release);
    }

    /// Whether the reader can read the writer's memory directly.
    pub fn direct_reads(&self) -> bool {
        self.ctl().direct_reads.load(Ordering::Acquire) != 0
    }

    /// The reader has read the messages sent as their address up to number `id`.
    pub fn ack(&self, id: u64) {
        self.ctl().acked.store(id, Ordering::SeqCst);
    }

    /// The number of the last message sent as its address that the reader has read.
    pub fn acked(&self) -> u64 {
        self.ctl().acked.load(Ordering::Acquire)
    }

    /// No more bytes go in; the consumer still drains what is there.
    pub fn close(&self) {
        self.ctl().closed.store(1, Ordering::SeqCst);
    }

    pub fn is_closed(&self) -> bool {
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

    /// Whether a read would find something (bytes, or the end).
    pub fn readable(&self) -> bool {
        let tail = self.ctl().tail.load(Ordering::Relaxed);
        self.filled(tail).map_or(true, |n| n > 0) || self.is_closed()
    }

    /// Copy out what is there: WouldBlock when empty, Ok(0) once closed and drained.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let c = self.ctl();
        let cap = self.seg.capacity;
        let tail = c.tail.load(Ordering::Relaxed);
        let filled = match self.filled(tail)? {
            // Bytes written just before the close still count.
            0 if self.is_closed() => match self.filled(tail)? {
                0 => return Ok(0),
                n => n,
            },
            0 => return Err(io::ErrorKind::WouldBlock.into()),
            n => n,
        };
        let n = filled.min(buf.len());
        let at = (tail as usize) & (cap - 1);
        let first = n.min(cap - at);
        // SAFETY: in bounds: at < cap, first <= cap - at, and n - first <=
        // at (n <= cap, checked by `filled`), so both source ranges lie in
        // the ring's `cap` bytes of the mapping `self.seg` keeps alive, and
        // n <= buf.len() bytes go into `buf`, which is ours and does not
        // overlap the mapping.
        // No race: the writer published [tail, tail + n) with its SeqCst
        // (so Release) store of `head` after copying them in, which our
        // Acquire load in `filled` read; it writes only past `head` and
        // before `tail + cap` as it last read `tail`, so not these bytes
        // until the store of the new tail below (SeqCst, so after the
        // copy), which its Acquire load of `tail` then orders before its
        // next writes. We are the only reader (see `Ring`). A peer that
        // breaks that protocol (scribbles on the positions or the bytes)
        // races with this copy on plain bytes: the copy's bounds do not
        // depend on anything it wrote, and the bytes, which may then be
        // wrong, are checked as frames by the reader like any peer's.
        unsafe {
            std::ptr::copy_nonoverlapping(self.seg.data(self.side).add(at), buf.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.seg.data(self.side), buf.as_mut_ptr().add(first), n - first);
        }
        // Positions live in memory the peer can write: wrapping, never trusted to not overflow.
        c.tail.store(tail.wrapping_add(n as u64), Ordering::SeqCst);
        Ok(n)
    }

    /// Whether a write would find room (or the end).
    pub fn writable(&self) -> bool {
        self.room() > 0 || self.is_closed()
    }

    fn room(&self) -> usize {
        let c = self.ctl();
        let used = c.head.load(Ordering::Relaxed).wrapping_sub(c.tail.load(Ordering::Acquire)) as usize;
        self.seg.capacity - used.min(self.seg.capacity)
    }

    /// Copy in as much of `bufs` as fits: WouldBlock when full, BrokenPipe once closed.
    pub fn write(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        if self.is_closed() {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Ok(0);
        }
        let room = self.room();
        if room == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let c = self.ctl();
        let cap = self.seg.capacity;
        let head = c.head.load(Ordering::Relaxed);
        let mut pos = head;
        let mut left = room.min(total);
        for b in bufs {
            let mut src: &[u8] = b;
            while left > 0 && !src.is_empty() {
                let at = (pos as usize) & (cap - 1);
                let n = src.len().min(left).min(cap - at);
                // SAFETY: at < cap and n <= cap - at: inside the ring's bytes
                // in the mapping `self.seg` keeps alive; `src` is the
                // caller's, not in the mapping. No race: these bytes are in
                // [head, tail + cap) with the tail we last read (Acquire),
                // which the reader is done with (it stored that tail after
                // copying them out) and will not read before our SeqCst
                // store of the new head below publishes them; we are the
                // only writer (see `Ring`). A reader that breaks the
                // protocol can only read bytes half written.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.seg.data(self.side).add(at), n) };
                src = &src[n..];
                pos = pos.wrapping_add(n as u64);
                left -= n;
            }
        }
        c.head.store(pos, Ordering::SeqCst);
        Ok(pos.wrapping_sub(head) as usize)
    }

    /// The consumer is about to wait: true if it really must (nothing to read).
    pub fn reader_waits(&self) -> bool {
        announce(&self.ctl().reader_sleeps, || !self.readable())
    }

    pub fn reader_woke(&self) {
        self.ctl().reader_sleeps.store(0, Ordering::Relaxed);
    }

    /// The producer is about to wait: true if it really must (no room).
    pub fn writer_waits(&self) -> bool {
        announce(&self.ctl().writer_sleeps, || !self.writable())
    }

    pub fn writer_woke(&self) {
        self.ctl().writer_sleeps.store(0, Ordering::Relaxed);
    }

    /// After a write: whether the consumer waits to be woken.
    pub fn reader_asleep(&self) -> bool {
        fence(Ordering::SeqCst);
        self.ctl().reader_sleeps.load(Ordering::SeqCst) != 0
    }

    /// After a read: whether the producer waits to be woken.
    pub fn writer_asleep(&self) -> bool {
        fence(Ordering::SeqCst);
        self.ctl().writer_sleeps.load(Ordering::SeqCst) != 0
    }
}

/// Set `flag`, then re-check: keep it set (and wait) only if `must_wait` still holds.
fn announce(flag: &AtomicU32, must_wait: impl Fn() -> bool) -> bool {
    flag.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    if must_wait() {
        return true;
    }
    flag.store(0, Ordering::Relaxed);
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn rings(capacity: usize) -> (Segment, Segment) {
        let (seg, fd) = Segment::create(capacity).unwrap();
        let other = Segment::open(&fd).unwrap();
        (seg, other)
    }

    #[test]
    fn bytes_arrive_in_order_across_wraps_without_blocking() {
        let (a, b) = rings(64 << 10);
        let data: Vec<u8> = (0..1_000_003u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (w, r) = (a.ring(0), b.ring(0));
        let (mut sent, mut got) = (0, Vec::new());
        let mut buf = vec![0u8; 40_961];
        while got.len() < data.len() {
            // Header and payload in one call, like frames.
            let chunk = &data[sent..(sent + 40_961).min(data.len())];
            let (h, p) = chunk.split_at(chunk.len().min(32));
            match w.write(&[IoSlice::new(h), IoSlice::new(p)]) {
                Ok(n) => sent += n,
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
            }
            match r.read(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
            }
        }
        assert!(got == data);
        assert_eq!(r.read(&mut buf).unwrap_err().kind(), io::ErrorKind::WouldBlock, "empty, not ended");
        w.close();
        assert_eq!(r.read(&mut buf).unwrap(), 0, "EOF after close and drain");
        assert_eq!(w.write(&[IoSlice::new(&[1])]).unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_waiting_side_is_seen_by_the_other() {
        let (a, b) = rings(64 << 10);
        let (w, r) = (a.ring(1), b.ring(1));
        assert!(r.reader_waits(), "empty: the reader waits");
        w.write(&[IoSlice::new(b"hello")]).unwrap();
        assert!(w.reader_asleep(), "the writer sees it must wake the reader");
        r.reader_woke();
        assert!(!r.reader_waits(), "data is there: no wait");
        assert!(!w.reader_asleep());
        let full = vec![0u8; 64 << 10];
        w.write(&[IoSlice::new(&full)]).unwrap();
        assert!(w.writer_waits(), "full: the writer waits");
        r.read(&mut [0u8; 100]).unwrap();
        assert!(r.writer_asleep(), "the reader sees it must wake the writer");
    }

    #[test]
    fn segments_are_checked() {
        // SAFETY: a valid C string for the name; no pointers kept.
        let raw = unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a new descriptor that nothing else owns.
        let plain = unsafe { OwnedFd::from_raw_fd(raw) };
        assert!(Segment::open(&plain).is_err(), "an unsealed memfd is refused");
    }

    /// A capacity whose size wraps around to the memfd's, or that would
    /// misalign the second control block, is refused.
    #[test]
    fn forged_capacities_are_refused() {
        for (capacity, len) in [(1usize << 63, 2 * CTL_BYTES), (1, 2 * (CTL_BYTES + 1)), (8, 2 * (CTL_BYTES + 8))] {
            let fd = sealed_memfd(len).unwrap();
            let forged = Segment { map: Mapping::of(fd.as_raw_fd(), CTL_BYTES).unwrap(), capacity: 0 };
            forged.ctl(0).capacity.store(capacity as u64, Ordering::Relaxed);
            forged.ctl(0).magic.store(MAGIC, Ordering::Release);
            assert!(Segment::open(&fd).is_err(), "capacity {capacity} in {len} bytes");
        }
    }
}
