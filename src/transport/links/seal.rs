//! Sealed records: what the frames of a TCP connection become when the job
//! asks for encryption (`RUSTC10D_ENCRYPT`). Each side cuts the byte stream
//! it writes into records of at most `RECORD_MAX` bytes and seals each with
//! AES-256-GCM under its own direction's key (auth.rs derives both from the
//! connection's handshake, so no two connections share one), its nonce the
//! record's number: a record altered, dropped, replayed or moved from
//! another connection or direction fails to open, and the connection fails
//! with it. A record is its sealed length (4 bytes, little-endian, itself
//! authenticated), the ciphertext and the 16-byte tag.
//!
//! Pure state, no I/O: conn.rs reads and writes the socket around it.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use std::io::{self, IoSlice};
use std::ops::Range;

/// Most plaintext bytes in one record.
pub const RECORD_MAX: usize = 64 << 10;
const LEN_BYTES: usize = 4;
pub const TAG_LEN: usize = 16;
/// What a record adds to its plaintext.
pub const OVERHEAD: usize = LEN_BYTES + TAG_LEN;

/// The two keys of one connection, as one side uses them.
pub struct SealKeys {
    /// What this side seals with.
    pub send: [u8; 32],
    /// What this side opens the peer's records with.
    pub open: [u8; 32],
}

impl std::fmt::Debug for SealKeys {
    // Keys stay out of logs and panic messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKeys(hidden)")
    }
}

/// Record number `n`'s nonce: 4 zero bytes, then the number. Each key seals
/// one direction of one connection, so a number is never used twice with it.
fn nonce(n: u64) -> Nonce {
    let mut b = [0u8; 12];
    b[4..].copy_from_slice(&n.to_le_bytes());
    Nonce::assume_unique_for_key(b)
}

fn cipher(key: &[u8; 32]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key).expect("AES-256 takes a key of 32 bytes"))
}

fn next_number(n: &mut u64) -> io::Result<u64> {
    let this = *n;
    *n = n.checked_add(1).ok_or_else(|| bad("the connection has used up its record numbers"))?;
    Ok(this)
}

fn bad(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

/// The writing side: seals what it is given, one record at a time, and
/// holds it until the socket has taken all of it. Only then are its bytes
/// reported written (`delivered`), so that a send finishes when its bytes
/// are in the kernel, as without sealing, and never while they wait here:
/// a writer that stops after a short write offers the same bytes again.
pub struct Sealer {
    aead: LessSafeKey,
    next: u64,
    /// The sealed record not yet written in full, from `sent` on.
    out: Vec<u8>,
    sent: usize,
    /// The plaintext bytes the record holds.
    holds: usize,
}

impl Sealer {
    pub fn new(key: &[u8; 32]) -> Sealer {
        Sealer { aead: cipher(key), next: 0, out: Vec::new(), sent: 0, holds: 0 }
    }

    /// Sealed bytes the socket has not taken yet.
    pub fn pending(&self) -> &[u8] {
        &self.out[self.sent..]
    }

    /// The socket took `n` more of the pending bytes.
    pub fn sent(&mut self, n: usize) {
        self.sent += n;
        debug_assert!(self.sent <= self.out.len());
    }

    /// Whether a record is held (sealed, not yet reported delivered).
    pub fn holds_record(&self) -> bool {
        self.holds > 0
    }

    /// The plaintext bytes of the record, once the socket has taken all of
    /// it (then the next may be sealed); None while some of it is pending.
    pub fn delivered(&mut self) -> Option<usize> {
        if self.sent < self.out.len() {
            return None;
        }
        self.out.clear();
        self.sent = 0;
        Some(std::mem::take(&mut self.holds))
    }

    /// Seal up to `RECORD_MAX` bytes of `bufs`, in order, as the next record
    /// (none is held); how many were taken (0 for none).
    pub fn seal(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        debug_assert!(!self.holds_record(), "one record at a time");
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let n = total.min(RECORD_MAX);
        if n == 0 {
            return Ok(0);
        }
        self.out.clear();
        self.out.reserve(n + OVERHEAD);
        let header = ((n + TAG_LEN) as u32).to_le_bytes();
        self.out.extend_from_slice(&header);
        for b in bufs {
            let room = LEN_BYTES + n - self.out.len();
            if room == 0 {
                break;
            }
            self.out.extend_from_slice(&b[..b.len().min(room)]);
        }
        let number = next_number(&mut self.next)?;
        let tag = self
            .aead
            .seal_in_place_separate_tag(nonce(number), Aad::from(header), &mut self.out[LEN_BYTES..])
            .map_err(|_| bad("a record could not be sealed"))?;
        self.out.extend_from_slice(tag.as_ref());
        self.sent = 0;
        self.holds = n;
        Ok(n)
    }
}

/// The reading side: gathers records as bytes arrive, opens each whole one
/// in place and hands out its plaintext. A record's length is checked
/// before anything waits for its bytes, which fit the fixed buffer.
pub struct Opener {
    aead: LessSafeKey,
    next: u64,
    /// Two records' room: a partial record is moved to the front when the
    /// rest might not fit behind it.
    buf: Box<[u8]>,
    /// Bytes not yet opened or handed out: `start..end`.
    start: usize,
    end: usize,
    /// Opened bytes not yet handed out.
    plain: Range<usize>,
}

impl Opener {
    pub fn new(key: &[u8; 32]) -> Opener {
        Opener {
            aead: cipher(key),
            next: 0,
            buf: vec![0u8; 2 * (RECORD_MAX + OVERHEAD)].into_boxed_slice(),
            start: 0,
            end: 0,
            plain: 0..0,
        }
    }

    /// Whether opened bytes, or a whole record, wait here: a reader that
    /// stops now must not wait for the socket before it takes them.
    pub fn holds_more(&self) -> bool {
        !self.plain.is_empty() || matches!(self.whole_record(), Ok(Some(_)))
    }

    /// Whether part of a record has arrived (the stream may not end here).
    pub fn mid_record(&self) -> bool {
        self.end > self.start
    }

    /// Where the socket's next bytes go (call when `take` found nothing):
    /// never empty.
    pub fn room(&mut self) -> &mut [u8] {
        debug_assert!(self.plain.is_empty());
        if self.buf.len() - self.end < RECORD_MAX + OVERHEAD {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.buf[self.end..]
    }

    /// The socket wrote `n` bytes into `room`.
    pub fn received(&mut self, n: usize) {
        self.end += n;
        debug_assert!(self.end <= self.buf.len());
    }

    /// The sealed length of the record at `start`, if it has arrived whole; an
    /// error if its length cannot be one we seal.
    fn whole_record(&self) -> io::Result<Option<usize>> {
        let have = &self.buf[self.start..self.end];
        if have.len() < LEN_BYTES {
            return Ok(None);
        }
        let len = u32::from_le_bytes(have[..LEN_BYTES].try_into().expect("4 bytes")) as usize;
        if !(TAG_LEN < len && len <= RECORD_MAX + TAG_LEN) {
            return Err(bad(format!(
                "a sealed record says it holds {len} bytes (between {} and {} expected): the peer does not seal \
                 its frames (RUSTC10D_ENCRYPT must be the same on every rank), or the bytes were altered",
                TAG_LEN + 1,
                RECORD_MAX + TAG_LEN
            )));
        }
        Ok((have.len() >= LEN_BYTES + len).then_some(len))
    }

    /// Hand out up to `out.len()` opened bytes, opening the next record if
    /// it has arrived whole; 0 if more must arrive first. An error (a record
    /// that does not open) is for good: the stream cannot be trusted after it.
    pub fn take(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.plain.is_empty() {
            let Some(len) = self.whole_record()? else { return Ok(0) };
            let (head, body) = self.buf[self.start..self.start + LEN_BYTES + len].split_at_mut(LEN_BYTES);
            let number = next_number(&mut self.next)?;
            self.aead.open_in_place(nonce(number), Aad::from(&*head), body).map_err(|_| {
                bad(format!(
                    "sealed record {number} did not open: it was altered, replayed, reordered or not sealed with \
                     this connection's key"
                ))
            })?;
            self.plain = self.start + LEN_BYTES..self.start + LEN_BYTES + len - TAG_LEN;
            self.start += LEN_BYTES + len;
            if self.start == self.end {
                (self.start, self.end) = (0, 0);
            }
        }
        let n = out.len().min(self.plain.len());
        out[..n].copy_from_slice(&self.buf[self.plain.start..self.plain.start + n]);
        self.plain.start += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KEY: [u8; 32] = [7; 32];

    /// Seal `data` with writes of `writes` bytes each (cycled), as the socket takes it.
    fn seal_all(sealer: &mut Sealer, data: &[u8], writes: &[usize]) -> Vec<u8> {
        let (mut wire, mut at, mut i) = (Vec::new(), 0, 0);
        while at < data.len() {
            let w = writes[i % writes.len()].max(1);
            i += 1;
            let end = (at + w).min(data.len());
            // Two slices, as a header and a payload come.
            let mid = at + (end - at) / 2;
            let n = sealer.seal(&[IoSlice::new(&data[at..mid]), IoSlice::new(&data[mid..end])]).unwrap();
            // The socket takes it in two writes: only the second delivers it.
            let half = sealer.pending().len() / 2;
            wire.extend_from_slice(&sealer.pending()[..half]);
            sealer.sent(half);
            assert_eq!(sealer.delivered(), None);
            wire.extend_from_slice(sealer.pending());
            sealer.sent(sealer.pending().len());
            assert_eq!(sealer.delivered(), Some(n));
            at += n;
        }
        wire
    }

    /// Open `wire`, arriving in pieces of `reads` bytes (cycled), read out `take` at a time.
    fn open_all(opener: &mut Opener, wire: &[u8], reads: &[usize], take: usize) -> io::Result<Vec<u8>> {
        let (mut out, mut at, mut i) = (Vec::new(), 0, 0);
        let mut piece = vec![0u8; take.max(1)];
        loop {
            let n = opener.take(&mut piece)?;
            if n > 0 {
                out.extend_from_slice(&piece[..n]);
                continue;
            }
            if at == wire.len() {
                return Ok(out);
            }
            let room = opener.room();
            let r = reads[i % reads.len()].max(1).min(room.len()).min(wire.len() - at);
            i += 1;
            room[..r].copy_from_slice(&wire[at..at + r]);
            opener.received(r);
            at += r;
        }
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// The record format, pinned: computed independently with Python's `cryptography` as
    /// hdr = struct.pack("<I", 14 + 16); hdr + AESGCM(key).encrypt(b"\0" * 4 + struct.pack("<Q", n),
    /// b"a sealed frame", hdr), with the dialler's sealing key of auth.rs's pinned transcript.
    #[test]
    fn records_are_aes_256_gcm_numbered_from_zero() {
        let mut key = [0u8; 32];
        for (i, k) in key.iter_mut().enumerate() {
            *k = u8::from_str_radix(
                &"f6004c4d2b3b1412879cb834c06b9f65ba28052f22bbed65278d9d3acef89271"[2 * i..2 * i + 2],
                16,
            )
            .unwrap();
        }
        let mut sealer = Sealer::new(&key);
        let wire = seal_all(&mut sealer, b"a sealed frame", &[100]);
        assert_eq!(hex(&wire), "1e000000d0913266842bd7377838a6c8c277b1f7ab503f3a1860267cc032edece266");
        let wire = seal_all(&mut sealer, b"a sealed frame", &[100]);
        assert_eq!(hex(&wire), "1e000000377f82482d9033159c6e50a30901df53e10c5a4383e7b73cd51f8926c005");
    }

    #[test]
    fn what_is_sealed_opens_and_is_not_on_the_wire() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let wire = seal_all(&mut Sealer::new(&KEY), &data, &[RECORD_MAX + 5]);
        assert_eq!(wire.len(), data.len() + 5 * OVERHEAD, "records of at most RECORD_MAX");
        for at in [0, 1000, 150_000, 299_000] {
            assert!(!wire.windows(64).any(|w| w == &data[at..at + 64]), "plaintext at {at} on the wire");
        }
        let mut opener = Opener::new(&KEY);
        assert_eq!(open_all(&mut opener, &wire, &[1000], 4096).unwrap(), data);
        assert!(!opener.mid_record() && !opener.holds_more());
    }

    #[test]
    fn an_altered_replayed_reordered_or_foreign_record_does_not_open() {
        let mut sealer = Sealer::new(&KEY);
        let a = seal_all(&mut sealer, b"first record", &[100]);
        let b = seal_all(&mut sealer, b"second record", &[100]);
        let expect_bad = |wire: &[u8], key: &[u8; 32]| {
            let e = open_all(&mut Opener::new(key), wire, &[7], 64).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
            e.to_string()
        };
        let mut altered = [a.clone(), b.clone()].concat();
        altered[a.len() + 6] ^= 1;
        assert!(expect_bad(&altered, &KEY).contains("record 1 did not open"));
        assert!(expect_bad(&[a.clone(), a.clone()].concat(), &KEY).contains("record 1"), "replayed");
        assert!(expect_bad(&[b.clone(), a.clone()].concat(), &KEY).contains("record 0"), "reordered");
        assert!(expect_bad(&a, &[8; 32]).contains("record 0"), "another key");
        // A longer length is caught by the tag too; an impossible one before anything waits for it.
        let mut long = a.clone();
        long[..4].copy_from_slice(&(RECORD_MAX as u32 + 17).to_le_bytes());
        assert!(expect_bad(&long, &KEY).contains("RUSTC10D_ENCRYPT"));
        // Plain frames read as a sealed stream: refused by their first word.
        let mut plain = vec![0x30, 0x31, 0x43, 0x52];
        plain.extend([0u8; 36]);
        assert!(expect_bad(&plain, &KEY).contains("does not seal"));
        assert_eq!(open_all(&mut Opener::new(&KEY), &[a, b].concat(), &[3], 5).unwrap(), b"first recordsecond record");
    }

    #[test]
    fn a_stream_cut_within_a_record_is_seen_to_be() {
        let wire = seal_all(&mut Sealer::new(&KEY), &[1u8; 1000], &[1000]);
        let mut opener = Opener::new(&KEY);
        assert_eq!(open_all(&mut opener, &wire[..500], &[500], 64).unwrap(), b"");
        assert!(opener.mid_record() && !opener.holds_more());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Any data, cut into any writes and read back in any pieces, opens as it was sealed.
        #[test]
        fn any_stream_opens_as_sealed(
            len in 0usize..200_000,
            writes in proptest::collection::vec(1usize..200_000, 1..5),
            reads in proptest::collection::vec(1usize..200_000, 1..5),
            take in 1usize..100_000,
        ) {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 253) as u8).collect();
            let wire = seal_all(&mut Sealer::new(&KEY), &data, &writes);
            prop_assert_eq!(open_all(&mut Opener::new(&KEY), &wire, &reads, take).unwrap(), data);
        }
    }
}
