//! Reading frames off one connection as bytes arrive, never blocking: a
//! frame's header says where its payload goes (straight into a posted
//! receive, folded into it or not; into memory until its receive is posted;
//! nowhere, for a size mismatch), and every read continues where the last
//! one stopped. A message sent as its address (see `conn.rs`) is read from
//! the sender's memory the same way, then acknowledged.

use crate::error::Error;
use crate::locks::{level, Mutex};
use crate::reduce::bytes_of_words;
use crate::transport::links::conn::Conn;
use crate::transport::links::frame::{
    FrameHeader, Key, Remote, ABORT_CHANNEL, ABORT_MAX, HEADER_LEN, KIND_ABORT, KIND_ASK, LEAVE_CHANNEL, REMOTE_LEN,
};
use crate::transport::links::mailbox::{fail_mismatch, AnyPosted, Delivery, Mailbox, PostedRecv};
use std::io;
use std::time::{Duration, Instant};

/// Most memory reserved ahead for one message that arrives before its receive.
const EARLY_RESERVE_MAX: u64 = 64 << 20;

/// A large message, or one sent as its address (64 KiB and up by default),
/// that arrives before its receive waits this long for it before it is read
/// into memory: the copy out of memory later costs as much as the transfer,
/// and the receive is usually posted within microseconds (a ping-pong's
/// echo, the next step of a ring). Frames behind it on the connection wait
/// too, so the grace is short: programs that post receives out of order
/// still progress. (Address messages of 64 KiB to 256 KiB read at once cost
/// a 64 KiB ping-pong 2 copies per byte instead of 1, and a 256 KiB
/// all_reduce at W=4 3 instead of 2.25.)
pub const EARLY_GRACE: Duration = Duration::from_millis(20);
const EARLY_GRACE_MIN_BYTES: u64 = 256 * 1024;

/// How often a connection held back by the early-bytes cap looks again
/// (a receive posted meanwhile resumes it at once).
const HELD_RECHECK: Duration = Duration::from_millis(50);
/// Distinct questions (`Key::ask`) kept for answering per read: a peer that
/// asks in a loop gets one answer per depth, not one per question.
const ASKED_MAX: usize = 8;

/// Pieces a folded receive reads at a time: small enough to stay in cache
/// between the read and the fold.
const FOLD_PIECE: usize = 64 * 1024;
/// The same, read from a peer's memory: larger, since each piece is a system call.
const DIRECT_FOLD_PIECE: usize = 256 * 1024;

/// Where one connection's reading stands.
#[derive(Default)]
pub struct Reader {
    state: State,
    /// 8-byte aligned: folds view the bytes as any dtype.
    bounce: Vec<u64>,
    /// Reads that returned bytes, ever (a poller tells progress by it).
    pub reads: u64,
    /// Questions the peer asked (`Key::ask`, by depth) not answered yet.
    pub asked: Vec<u64>,
    /// Reading is held back by the peer's early-bytes cap (said once per hold).
    holding: bool,
}

#[derive(Default)]
enum State {
    #[default]
    Start,
    /// A header, and the address that follows it for a message sent as one.
    Header { buf: [u8; HEADER_LEN + REMOTE_LEN], got: usize },
    /// A header whose message has no receive yet, waiting up to EARLY_GRACE.
    Early { key: Key, len: u64, since: Instant, remote: Option<Remote> },
    Body {
        len: u64,
        got: u64,
        into: Into,
        /// The bytes are read from the peer's memory there.
        remote: Option<Remote>,
    },
    /// Why the peer gives up: on the connections (`key.group` 0 and no
    /// `ABORT_CHANNEL`), or on the group of that channel.
    Reason { key: Key, buf: Vec<u8>, got: usize },
    /// The connection failed (or was closed) here: every later read says
    /// so again. Were it to start over, a thread reading next (a waiter
    /// polls) would take the end of a stream that broke within a frame
    /// for an end between frames, before the first told of the failure.
    Failed(io::ErrorKind, String),
}

enum Into {
    Posted(PostedRecv),
    /// Bytes not yet folded wait in the bounce buffer (`pending` of them).
    Folded(PostedRecv, usize),
    Early(Key, Vec<u8>),
    /// Nowhere: its receive expects another length and has failed already.
    Drain,
}

/// Why a pump stopped.
#[derive(Debug, PartialEq)]
pub enum Stop {
    /// Nothing more to read for now.
    Drained,
    /// A large message waits for its receive: read no further until one is
    /// posted or the grace (this much longer) passes.
    Early(Duration),
    /// The peer said why it gives up; it closes the connection next.
    Reason(Error),
    /// The connection ended, cleanly between frames.
    End,
}

impl Reader {
    /// Read and deliver what `conn` has, for `peer`'s `mailbox`. An error
    /// (the connection failed, or ended within a frame) has already failed
    /// the receive being filled.
    pub fn pump(
        &mut self,
        conn: &Conn,
        peer: usize,
        mailbox: &Mutex<level::Mailbox, Mailbox>,
        any: &Mutex<level::AnyPosted, AnyPosted>,
    ) -> io::Result<Stop> {
        loop {
            match self.step(conn, peer, mailbox, any) {
                Ok(None) => {
                    self.reads += 1;
                    continue;
                }
                Ok(Some(stop)) => return Ok(stop),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Stop::Drained),
                Err(e) => {
                    self.abandon(&Error::peer_lost(format!("lost connection to rank {peer}: {e}")));
                    self.state = State::Failed(e.kind(), e.to_string());
                    return Err(e);
                }
            }
        }
    }

    /// The connection will not be read again (it failed, or was closed):
    /// fail the receive being filled, if any, with `why`. Nothing else
    /// would ever finish it, and its op would wait for it forever.
    pub fn abandon(&mut self, why: &Error) {
        let failed = State::Failed(io::ErrorKind::NotConnected, why.message.clone());
        if let State::Body { into: Into::Posted(p) | Into::Folded(p, _), .. } =
            std::mem::replace(&mut self.state, failed)
        {
            p.status.finish(Err(why.clone()));
        }
    }

    fn step(
        &mut self,
        conn: &Conn,
        peer: usize,
        mailbox: &Mutex<level::Mailbox, Mailbox>,
        any: &Mutex<level::AnyPosted, AnyPosted>,
    ) -> io::Result<Option<Stop>> {
        let Reader { state, bounce, asked, holding, .. } = self;
        match state {
            State::Start => {
                let mut buf = [0u8; HEADER_LEN + REMOTE_LEN];
                let got = read_some(conn, &mut buf[..HEADER_LEN])?;
                if got == 0 {
                    return Ok(Some(Stop::End));
                }
                *state = State::Header { buf, got };
            }
            State::Header { buf, got } => {
                // The header first: only it says whether an address follows.
                let header = (*got >= HEADER_LEN)
                    .then(|| FrameHeader::decode(buf[..HEADER_LEN].try_into().unwrap()))
                    .transpose()
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.message))?;
                let need = match header {
                    Some(h) if h.remote => HEADER_LEN + REMOTE_LEN,
                    _ => HEADER_LEN,
                };
                if *got < need {
                    let n = read_some(conn, &mut buf[*got..need])?;
                    if n == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    *got += n;
                    return Ok(None);
                }
                let header = header.expect("read");
                // Only a peer this side lets read its memory sends addresses
                // (conn.rs); anywhere else the address is refused before any
                // receive is matched with it, whatever its length.
                if header.remote && !conn.takes_addresses() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a message sent as its address, on a connection that does not take them",
                    ));
                }
                if header.key.kind == KIND_ASK {
                    if header.len != 0 {
                        return Err(io::Error::new(io::ErrorKind::InvalidData, "a question with a payload"));
                    }
                    *state = State::Start;
                    if asked.len() < ASKED_MAX && !asked.contains(&header.key.channel) {
                        asked.push(header.key.channel);
                    }
                    return Ok(None);
                }
                if header.key.kind == KIND_ABORT {
                    if header.len > ABORT_MAX {
                        return Err(io::Error::new(io::ErrorKind::InvalidData, "oversized abort frame"));
                    }
                    *state = State::Reason { key: header.key, buf: vec![0; header.len as usize], got: 0 };
                } else {
                    let remote = header.remote.then(|| Remote::decode(buf[HEADER_LEN..].try_into().unwrap()));
                    *state = State::Early { key: header.key, len: header.len, since: Instant::now(), remote };
                }
            }
            State::Early { key, len, since, remote } => {
                let (key, len, remote) = (*key, *len, *remote);
                let mut mb = mailbox.lock().unwrap();
                let into = match mb.on_header(key, len, any) {
                    Delivery::Direct(p) if p.buf.fold.is_some() => Into::Folded(p, 0),
                    Delivery::Direct(p) => Into::Posted(p),
                    // Failed now: the header says it all, and the announced
                    // length is the peer's word (it may never send that much).
                    Delivery::Mismatch(p) => {
                        fail_mismatch(p, len, peer);
                        Into::Drain
                    }
                    Delivery::Drop => Into::Drain,
                    Delivery::Stash => {
                        let waited = since.elapsed();
                        if (len >= EARLY_GRACE_MIN_BYTES || remote.is_some()) && waited < EARLY_GRACE {
                            return Ok(Some(Stop::Early(EARLY_GRACE - waited)));
                        }
                        if !mb.admit_early(len) {
                            if !std::mem::replace(holding, true) {
                                tracing::warn!(
                                    "rustc10d: a message of {len} bytes from rank {peer} has no receive yet, and {} \
                                     bytes of that rank's messages wait for theirs already, at the cap \
                                     (RUSTC10D_EARLY_BYTES_MAX={}): its connection is read no further until a \
                                     receive takes some",
                                    mb.early_bytes(),
                                    mb.early_max()
                                );
                            }
                            // Not read, so the end would go unseen: look for it.
                            if conn.peer_closed() {
                                return Err(io::Error::new(
                                    io::ErrorKind::UnexpectedEof,
                                    "the connection ended while a message waited for its receive",
                                ));
                            }
                            return Ok(Some(Stop::Early(HELD_RECHECK)));
                        }
                        *holding = false;
                        // The length is the peer's word: reserve only so much ahead.
                        Into::Early(key, Vec::with_capacity(len.min(EARLY_RESERVE_MAX) as usize))
                    }
                };
                drop(mb);
                *state = State::Body { len, got: 0, into, remote };
            }
            State::Body { len, got, into, remote } => {
                if *got < *len {
                    let n = fill(bounce, conn, *len, *got, into, *remote)?;
                    if n == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    *got += n as u64;
                    return Ok(None);
                }
                if remote.is_some() && conn.peer_let_go() {
                    return Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "the peer gave up while its message was being read",
                    ));
                }
                let State::Body { len, into, remote, .. } = std::mem::take(state) else { unreachable!() };
                if let Some(r) = remote {
                    conn.ack_read(r.id);
                }
                match into {
                    Into::Posted(p) => p.complete(len as usize, peer),
                    Into::Folded(p, pending) => {
                        fold_pending(bounce, &p, len as usize, pending);
                        p.complete(len as usize, peer);
                    }
                    Into::Early(key, data) => mailbox.lock().unwrap().stash(key, data, any),
                    Into::Drain => {}
                }
            }
            State::Failed(kind, why) => return Err(io::Error::new(*kind, why.clone())),
            State::Reason { key, buf, got } => {
                if *got < buf.len() {
                    let n = read_some(conn, &mut buf[*got..])?;
                    if n == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    *got += n;
                    return Ok(None);
                }
                let (key, text) = (*key, String::from_utf8_lossy(buf).into_owned());
                *state = State::Start;
                let (group, sent_below) = (key.group, key.channel);
                if key.sub == LEAVE_CHANNEL {
                    // It left the group: what it sent before stays, and
                    // receives from any peer may still be met by another.
                    let why = Error::peer_lost(format!("left the group: {text}"));
                    mailbox.lock().unwrap().peer_destroyed_group(group, sent_below, why);
                    return Ok(None);
                }
                let why = Error::peer_lost(format!("gave up on the group: {text}"));
                if group == 0 && key.sub != ABORT_CHANNEL {
                    return Ok(Some(Stop::Reason(why)));
                }
                // One group's channel closes, the connection goes on, for
                // the other groups. Mailbox, then `any` (locks.rs).
                let mut mailbox = mailbox.lock().unwrap();
                mailbox.peer_left_group(group, sent_below, why.clone());
                any.lock().unwrap().fail_group_from(group, peer, &why);
            }
        }
        Ok(None)
    }
}

/// Read more of a body (`got` of `len` so far) into where it goes: from the
/// connection, or with `remote` from the peer's memory.
fn fill(
    bounce: &mut Vec<u64>,
    conn: &Conn,
    len: u64,
    got: u64,
    into: &mut Into,
    remote: Option<Remote>,
) -> io::Result<usize> {
    let left = (len - got) as usize;
    let read = |buf: &mut [u8]| match remote {
        None => read_some(conn, buf),
        // The address is the peer's word: one that wraps around is refused, not read.
        Some(r) => match r.addr.checked_add(got).filter(|a| a.checked_add(buf.len() as u64).is_some()) {
            Some(addr) => conn.read_peer(addr, buf).map(|()| buf.len()),
            None => Err(io::Error::new(io::ErrorKind::InvalidData, "a message's address runs past the end of memory")),
        },
    };
    match into {
        Into::Posted(p) => {
            // SAFETY: the mailbox gave this receive only because its buffer is `len`
            // bytes (`Mailbox::on_header`), so [got, len) lies inside it; the
            // poster keeps it valid and untouched until its status finishes
            // (`Transport::recv`), and this reader holds the only PostedRecv for
            // it (taken out of the mailbox, so no cancel or other reader has it).
            let dst = unsafe { std::slice::from_raw_parts_mut(p.buf.ptr.add(got as usize), left) };
            let n = read(dst)?;
            p.status.copied(n);
            Ok(n)
        }
        Into::Early(_, data) => {
            let at = data.len();
            data.resize(at + left.min(1 << 20), 0);
            let n = read(&mut data[at..]);
            data.truncate(at + *n.as_ref().unwrap_or(&0));
            n
        }
        // Nothing to read of a message left where it is.
        Into::Drain if remote.is_some() => Ok(left),
        Into::Drain => {
            let mut sink = [0u8; 64 << 10];
            read_some(conn, &mut sink[..left.min(64 << 10)])
        }
        Into::Folded(p, pending) => {
            let fold = p.buf.fold.as_ref().expect("a folded receive");
            let piece = if remote.is_some() { DIRECT_FOLD_PIECE } else { FOLD_PIECE };
            let piece = (piece / fold.unit).max(1) * fold.unit;
            bounce.resize(piece.div_ceil(8), 0);
            let want = piece.min(*pending + left) - *pending;
            let n = read(&mut bytes_of_words(bounce)[*pending..*pending + want])?;
            p.status.copied(n);
            *pending += n;
            // Fold whole pieces (whole elements) as they complete.
            if *pending == piece {
                let at = got as usize + n - *pending;
                // SAFETY: `at` is where the bytes in the bounce buffer start in the body:
                // at + piece = got + n <= len, the buffer's length (see `Into::Posted`
                // for why the buffer is valid and this reader's alone).
                let dst = unsafe { std::slice::from_raw_parts_mut(p.buf.ptr.add(at), piece) };
                fold.apply(dst, &bytes_of_words(bounce)[..piece]);
                p.status.copied(piece);
                *pending = 0;
            }
            Ok(n)
        }
    }
}

/// Fold the last, short piece of a folded body.
fn fold_pending(bounce: &mut [u64], p: &PostedRecv, len: usize, pending: usize) {
    if pending == 0 {
        return;
    }
    let fold = p.buf.fold.as_ref().expect("a folded receive");
    // SAFETY: the last `pending` bytes of the body, len <= the buffer's length
    // (the mailbox matched the lengths); valid and this reader's alone, as
    // for `Into::Posted` in `fill`.
    let dst = unsafe { std::slice::from_raw_parts_mut(p.buf.ptr.add(len - pending), pending) };
    fold.apply(dst, &bytes_of_words(bounce)[..pending]);
    p.status.copied(pending);
}

/// One read, retried when interrupted.
fn read_some(conn: &Conn, buf: &mut [u8]) -> io::Result<usize> {
    if buf.is_empty() {
        return Ok(0);
    }
    conn.read(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Status;
    use crate::transport::links::conn::tests::pair_direct_from;
    use crate::transport::links::mailbox::RecvBuf;
    use std::io::IoSlice;
    use std::sync::Arc;

    /// `from` writes the header and address of `data` (as a sender of a
    /// message sent as its address does); a receive of its length is posted.
    fn sent_as_address(
        from: &Conn,
        data: &[u8],
        id: u64,
        got: &mut [u8],
    ) -> (Mutex<level::Mailbox, Mailbox>, Arc<Status>) {
        let key = Key::p2p(3);
        let header = FrameHeader { key, len: data.len() as u64, remote: true }.encode();
        let remote = Remote { addr: data.as_ptr() as u64, id }.encode();
        from.write(&[IoSlice::new(&header), IoSlice::new(&remote)]).unwrap();
        let mailbox = Mutex::new(Mailbox::new(0));
        let status = Status::new();
        let buf = RecvBuf { ptr: got.as_mut_ptr(), len: got.len(), fold: None };
        mailbox.lock().unwrap().post(key, PostedRecv { buf, status: status.clone(), any_source: None });
        (mailbox, status)
    }

    #[test]
    fn a_message_sent_as_its_address_is_read_from_the_sender_and_acknowledged() {
        let (a, b) = pair_direct_from(1024);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut got = vec![0u8; data.len()];
        let (mailbox, status) = sent_as_address(&a, &data, 7, &mut got);
        let stop = Reader::default().pump(&b, 0, &mailbox, &Mutex::default()).unwrap();
        assert_eq!(stop, Stop::Drained);
        assert_eq!(status.result().unwrap().unwrap(), data.len() as i64);
        assert!(got == data);
        assert_eq!(a.acked(), 7, "the sender may let go of it now");
    }

    #[test]
    fn a_sender_that_gave_up_fails_the_receive_instead_of_handing_over_what_was_read() {
        let (a, b) = pair_direct_from(1024);
        let data = vec![5u8; 100_000];
        let mut got = vec![0u8; data.len()];
        let (mailbox, status) = sent_as_address(&a, &data, 1, &mut got);
        // The sender gives up (closing the rings) before the receiver reads:
        // its memory may have been reused by the time the read ends.
        a.shutdown();
        let err = Reader::default().pump(&b, 0, &mailbox, &Mutex::default()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
        assert!(status.result().unwrap().is_err(), "the receive fails");
        assert_eq!(a.acked(), 0, "nothing acknowledged");
    }

    /// A connected pair over loopback TCP: the writing end, and the
    /// reading end as a non-blocking `Conn`.
    fn tcp_pair() -> (std::net::TcpStream, Conn) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let writer = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let read_end = listener.accept().unwrap().0;
        read_end.set_nonblocking(true).unwrap();
        (writer, Conn::tcp(read_end, None))
    }

    /// A message nobody has posted a receive for is read into memory as it
    /// comes. Its header's length is the peer's word: the reader reserves
    /// at most EARLY_RESERVE_MAX ahead for it, never what the header
    /// says (2^62 bytes here, of which 1000 come), even where the cap on
    /// early bytes would allow that much; under the default cap, such a
    /// message is not read at all until its receive is posted.
    #[test]
    fn an_early_message_reserves_a_bounded_amount_whatever_its_header_says() {
        let header = FrameHeader { key: Key::p2p(99), len: 1 << 62, remote: false }.encode();
        let (mut writer, conn) = tcp_pair();
        std::io::Write::write_all(&mut writer, &[&header[..], &[7u8; 1000]].concat()).unwrap();
        let (mailbox, any) = (Mutex::new(Mailbox::new(1)), Mutex::default());
        let mut reader = Reader::default();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !reader.holding {
            assert!(Instant::now() < deadline, "never held at the cap");
            if let Stop::Early(wait) = reader.pump(&conn, 1, &mailbox, &any).unwrap() {
                std::thread::sleep(wait);
            }
        }
        assert!(matches!(reader.state, State::Early { .. }), "held at the header, nothing reserved");
        assert_eq!(mailbox.lock().unwrap().early_bytes(), 0);

        let (mut writer, conn) = tcp_pair();
        std::io::Write::write_all(&mut writer, &[&header[..], &[7u8; 1000]].concat()).unwrap();
        let (mailbox, any) = (Mutex::new(Mailbox::with_early_max(1, u64::MAX)), Mutex::default());
        let mut reader = Reader::default();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match reader.pump(&conn, 1, &mailbox, &any).unwrap() {
                Stop::Early(wait) => std::thread::sleep(wait),
                _ => std::thread::sleep(Duration::from_millis(1)),
            }
            if let State::Body { got: 1000, into: Into::Early(key, data), .. } = &reader.state {
                assert_eq!(*key, Key::p2p(99));
                assert!(data.capacity() as u64 <= EARLY_RESERVE_MAX, "reserved {} bytes", data.capacity());
                assert_eq!(data.len(), 1000);
                break;
            }
            assert!(Instant::now() < deadline, "the 1000 bytes were never read");
        }
    }

    /// One frame as a peer may send it, right or wrong: its header's kind
    /// (in range or not), tag, whether it says an address follows, the
    /// length it announces, and how many bytes of body really follow.
    #[derive(Debug, Clone)]
    struct Sent {
        kind: u8,
        tag: i64,
        remote: bool,
        len: u64,
        body: usize,
    }

    fn sent() -> impl proptest::strategy::Strategy<Value = Sent> {
        use proptest::prelude::*;
        let kind = prop_oneof![4 => Just(crate::transport::links::frame::KIND_P2P), 1 => 0u8..8];
        let len = prop_oneof![
            3 => Just(64u64),
            3 => 0u64..130,
            1 => Just(ABORT_MAX + 1),
            1 => Just(EARLY_GRACE_MIN_BYTES),
            1 => Just(1u64 << 62),
            1 => any::<u64>()
        ];
        let remote = prop_oneof![9 => Just(false), 1 => Just(true)];
        (kind, prop_oneof![Just(7i64), Just(8)], remote, len, 0usize..200)
            .prop_map(|(kind, tag, remote, len, body)| Sent { kind, tag, remote, len, body })
    }

    /// What a receive of 64 bytes for tag 7 must come to.
    #[derive(Debug, PartialEq)]
    enum Outcome {
        Filled(Vec<u8>),
        Mismatch(u64),
        /// The stream broke while its message was being read into it.
        Broken,
        /// No message for it was read before the stream broke or ended.
        Pending,
    }

    /// The outcome the protocol says `stream` comes to over TCP, read as
    /// the bytes go (a frame whose body is shorter than announced takes
    /// the next frame's bytes as the rest of its body).
    fn expected(stream: &[u8]) -> Outcome {
        let mut at = 0;
        loop {
            let Some(h) = stream.get(at..at + HEADER_LEN) else { return Outcome::Pending };
            let Ok(h) = FrameHeader::decode(h.try_into().unwrap()) else { return Outcome::Pending };
            // Over TCP no address is taken; a question has no payload; a reason is short.
            if h.remote || (h.key.kind == KIND_ASK && h.len != 0) || (h.key.kind == KIND_ABORT && h.len > ABORT_MAX) {
                return Outcome::Pending;
            }
            at += HEADER_LEN;
            let complete = (stream.len() - at) as u64 >= h.len;
            if h.key == Key::p2p(7) {
                return match (h.len, complete) {
                    (64, true) => Outcome::Filled(stream[at..at + 64].to_vec()),
                    (64, false) => Outcome::Broken,
                    (len, _) => Outcome::Mismatch(len),
                };
            }
            if !complete {
                return Outcome::Pending;
            }
            at += h.len as usize;
        }
    }

    // Whatever a peer writes, however it lies about lengths, kinds and
    // addresses, and wherever it stops: reading never panics, never writes
    // outside the posted receive, and the receive comes to what the
    // protocol says (filled with the bytes of its message, failed with a
    // size mismatch as soon as the header says so, failed if the stream
    // breaks within its message, or left for the link to fail).
    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
        #[test]
        fn any_stream_of_frames_is_read_safely(frames in proptest::collection::vec(sent(), 0..6),
                                               cut in proptest::option::of(0usize..1000)) {
            let mut stream = Vec::new();
            for (i, f) in frames.iter().enumerate() {
                let mut h = FrameHeader { key: Key::p2p(f.tag), len: f.len, remote: false }.encode();
                h[4] = f.kind;
                h[5] = f.remote as u8;
                stream.extend_from_slice(&h);
                if f.remote {
                    stream.extend_from_slice(&Remote { addr: 0x1000, id: 1 }.encode());
                }
                let body = (f.body as u64).min(f.len) as usize;
                stream.extend((0..body).map(|j| (i * 64 + j) as u8));
            }
            if let Some(cut) = cut {
                stream.truncate(cut);
            }
            let want = expected(&stream);

            let (mut writer, conn) = tcp_pair();
            std::io::Write::write_all(&mut writer, &stream).unwrap();
            writer.shutdown(std::net::Shutdown::Write).unwrap();

            // The receive's 64 bytes, between guards that nothing may touch.
            let mut buf = [0xC5u8; 16 + 64 + 16];
            let mailbox = Mutex::new(Mailbox::new(1));
            let status = Status::new();
            let recv = RecvBuf { ptr: buf[16..].as_mut_ptr(), len: 64, fold: None };
            mailbox.lock().unwrap().post(Key::p2p(7), PostedRecv { buf: recv, status: status.clone(), any_source: None });
            let any = Mutex::default();
            let mut reader = Reader::default();
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                proptest::prop_assert!(Instant::now() < deadline, "the stream was never read to its end");
                match reader.pump(&conn, 1, &mailbox, &any) {
                    Ok(Stop::Drained) => std::thread::sleep(Duration::from_millis(1)),
                    // Held at the early-bytes cap (a message longer than it, for no receive):
                    // read no further, as the link would until a receive is posted.
                    Ok(Stop::Early(_)) if reader.holding => break,
                    Ok(Stop::Early(wait)) => std::thread::sleep(wait),
                    Ok(Stop::Reason(_)) => {}
                    Ok(Stop::End) | Err(_) => break,
                }
            }
            let got = status.result();
            // What the link does once the reader stops: close the mailbox.
            mailbox.lock().unwrap().close(Error::peer_lost("closed"));
            reader.abandon(&Error::peer_lost("closed"));
            proptest::prop_assert!(buf[..16].iter().chain(&buf[80..]).all(|&b| b == 0xC5), "written outside the receive");
            match (&want, got) {
                (Outcome::Filled(bytes), Some(Ok(64))) => proptest::prop_assert_eq!(&buf[16..80], &bytes[..]),
                (Outcome::Mismatch(len), Some(Err(e))) => {
                    proptest::prop_assert!(e.message.contains(&format!("but rank 1 sent {len}")), "{}", e.message)
                }
                (Outcome::Broken, Some(Err(e))) => {
                    proptest::prop_assert!(e.message.contains("lost connection to rank 1"), "{}", e.message)
                }
                (Outcome::Pending, None) => proptest::prop_assert!(status.is_done(), "the link's close finishes it"),
                (want, got) => proptest::prop_assert!(false, "expected {:?}, got {:?}", want, got),
            }
        }
    }
}
