//! Frames waiting to be written on one connection, in order, written as the
//! connection takes them: by the sending thread at once when nothing waits
//! before it, else by the reactor once there is room. A send whose bytes are
//! not ready yet (a device tensor's copy to the host) holds back the ones
//! behind it until its `ready` has run, on the staging thread. A send that
//! goes as its address (see `conn.rs`) is written as header and address,
//! and finishes when the peer acknowledges it.

use crate::error::{Error, Result};
use crate::status::Status;
use crate::transport::links::conn::Conn;
use crate::transport::links::frame::{FrameHeader, Key, Remote, HEADER_LEN, KIND_COLLECTIVE, KIND_P2P, REMOTE_LEN};
use crate::transport::Ready;
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::Arc;

pub struct SendReq {
    key: Key,
    data: *const u8,
    len: usize,
    pub status: Arc<Status>,
    ready: Readiness,
    /// What goes before the payload (the header; and the address, for a
    /// send that goes as its address), decided when its writing starts.
    head: Option<Head>,
}

struct Head {
    bytes: [u8; HEADER_LEN + REMOTE_LEN],
    len: usize,
    /// Sent as its address, with this number: it waits for the acknowledgement.
    id: Option<u64>,
}
// SAFETY: a SendReq is the only user of `data`, which the sender keeps
// valid and unchanged until `status` finishes (`Transport::send`'s
// contract), whichever thread writes it (the sending one or the reactor).
unsafe impl Send for SendReq {}

enum Readiness {
    Now,
    Later(Ready),
    Running,
}

impl SendReq {
    pub fn new(key: Key, data: *const u8, len: usize, status: Arc<Status>, ready: Option<Ready>) -> SendReq {
        SendReq { key, data, len, status, ready: ready.map_or(Readiness::Now, Readiness::Later), head: None }
    }

    /// A send of `bytes` it owns (a reason, an answer): its status keeps
    /// them until they are written, or the send fails.
    pub fn owning(key: Key, bytes: Vec<u8>) -> SendReq {
        let (data, len) = (bytes.as_ptr(), bytes.len());
        let status = Status::with_callback(Box::new(move |_| {
            drop(bytes);
            Ok(())
        }));
        SendReq::new(key, data, len, status, None)
    }

    /// Payload bytes.
    pub fn len(&self) -> usize {
        self.len
    }
}

/// Why a flush stopped.
pub enum Flushed {
    /// Everything queued is written.
    All,
    /// The connection takes no more for now.
    Full,
    /// The next send's bytes must be made ready first: run this, then `readied`.
    Ready(Ready),
    /// A ready is running; the sends behind it wait.
    Waiting,
    Failed(io::Error),
}

#[derive(Default)]
pub struct Outbox {
    queue: VecDeque<SendReq>,
    /// Bytes of the first frame (header and payload) already written.
    written: usize,
    /// Sends that went as their address, until the peer acknowledges them.
    awaiting: Vec<SendReq>,
    /// The number of the last send that went as its address.
    last_id: u64,
}

impl Outbox {
    pub fn push(&mut self, req: SendReq) {
        self.queue.push_back(req);
    }

    /// Whether a frame is half written on `conn` (nothing else may be written
    /// on it meanwhile): some of it went, or a sealed record of its first
    /// bytes waits for the socket (`Conn::write` counts those bytes written
    /// only once their record is sent whole).
    pub fn mid_frame(&self, conn: &Conn) -> bool {
        self.written > 0 || conn.holds_record()
    }

    /// Write what `conn` takes; the sends written in full go to `finished`
    /// (to be finished without the lock held).
    pub fn flush(&mut self, conn: &Conn, finished: &mut Vec<SendReq>) -> Flushed {
        let Outbox { queue, written, awaiting, last_id } = self;
        while let Some(req) = queue.front_mut() {
            match std::mem::replace(&mut req.ready, Readiness::Now) {
                Readiness::Now => {}
                Readiness::Later(ready) => {
                    req.ready = Readiness::Running;
                    return Flushed::Ready(ready);
                }
                Readiness::Running => {
                    req.ready = Readiness::Running;
                    return Flushed::Waiting;
                }
            }
            let (key, data, len) = (req.key, req.data, req.len);
            // Only messages go as their address: a reason, a question or an
            // answer sent so would be refused by the peer (frame.rs).
            let direct = matches!(key.kind, KIND_COLLECTIVE | KIND_P2P) && conn.sends_directly(len);
            let head = req.head.get_or_insert_with(|| head(key, data, len, direct, last_id));
            let payload = match head.id {
                Some(_) => &[][..],
                // SAFETY: the sender keeps `len` bytes at `data` valid and unchanged until
                // the status finishes (`Transport::send`'s contract; `data` is never
                // null: empty sends point at a dangling, aligned address), and its
                // `ready`, if any, has run (checked just above).
                None => unsafe { std::slice::from_raw_parts(data, len) },
            };
            let (head_len, total) = (head.len, head.len + payload.len());
            while *written < total {
                let n = if *written < head_len {
                    conn.write(&[IoSlice::new(&head.bytes[*written..head_len]), IoSlice::new(payload)])
                } else {
                    conn.write(&[IoSlice::new(&payload[*written - head_len..])])
                };
                match n {
                    Ok(0) => return Flushed::Failed(io::ErrorKind::WriteZero.into()),
                    Ok(n) => {
                        // The payload's share of what was written.
                        let copied = (*written + n).saturating_sub(head_len) - written.saturating_sub(head_len);
                        req.status.copied(copied);
                        *written += n;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Flushed::Full,
                    Err(e) => return Flushed::Failed(e),
                }
            }
            *written = 0;
            let req = queue.pop_front().expect("front");
            match req.head.as_ref().and_then(|h| h.id) {
                Some(_) => awaiting.push(req),
                None => finished.push(req),
            }
        }
        Flushed::All
    }

    /// The peer has read the sends that went as their address up to number
    /// `id` (they are read in order): take them.
    pub fn acked(&mut self, id: u64) -> Vec<SendReq> {
        let read = self.awaiting.iter().take_while(|r| r.head.as_ref().and_then(|h| h.id) <= Some(id)).count();
        self.awaiting.drain(..read).collect()
    }

    /// The first send's ready has run: with an error, that send fails alone.
    pub fn readied(&mut self, result: Result<()>) -> Option<(SendReq, Error)> {
        let req = self.queue.front_mut()?;
        debug_assert!(matches!(req.ready, Readiness::Running));
        req.ready = Readiness::Now;
        match result {
            Ok(()) => None,
            Err(e) => Some((self.queue.pop_front().expect("front"), e)),
        }
    }

    /// Everything still queued or unacknowledged (the connection is gone).
    pub fn take_all(&mut self) -> Vec<SendReq> {
        self.written = 0;
        self.queue.drain(..).chain(self.awaiting.drain(..)).collect()
    }
}

/// The bytes before a frame's payload: its header, and for a send that goes
/// as its address (`direct`), the address and a new number.
fn head(key: Key, data: *const u8, len: usize, direct: bool, last_id: &mut u64) -> Head {
    let mut bytes = [0u8; HEADER_LEN + REMOTE_LEN];
    bytes[..HEADER_LEN].copy_from_slice(&FrameHeader { key, len: len as u64, remote: direct }.encode());
    if !direct {
        return Head { bytes, len: HEADER_LEN, id: None };
    }
    *last_id += 1;
    bytes[HEADER_LEN..].copy_from_slice(&Remote { addr: data as u64, id: *last_id }.encode());
    Head { bytes, len: HEADER_LEN + REMOTE_LEN, id: Some(*last_id) }
}

/// Finish sends written in full.
pub fn finish_written(reqs: Vec<SendReq>) {
    for r in reqs {
        r.status.finish(Ok(r.len as i64));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::links::conn::tests::pair_direct_from;

    #[test]
    fn a_send_that_goes_as_its_address_finishes_only_once_read() {
        let (a, _b) = pair_direct_from(1024);
        let (big, small) = (vec![1u8; 4096], vec![2u8; 100]);
        let mut outbox = Outbox::default();
        let (s1, s2, s3) = (Status::new(), Status::new(), Status::new());
        outbox.push(SendReq::new(Key::p2p(0), big.as_ptr(), big.len(), s1.clone(), None));
        outbox.push(SendReq::new(Key::p2p(0), small.as_ptr(), small.len(), s2.clone(), None));
        outbox.push(SendReq::new(Key::p2p(0), big.as_ptr(), big.len(), s3.clone(), None));
        let mut written = Vec::new();
        assert!(matches!(outbox.flush(&a, &mut written), Flushed::All));
        assert_eq!(written.len(), 1, "only the small one, through the ring, is done when written");
        assert!(outbox.acked(0).is_empty());
        let read = outbox.acked(1);
        assert_eq!(read.len(), 1);
        assert!(Arc::ptr_eq(&read[0].status, &s1), "the first one sent as its address");
        assert_eq!(outbox.take_all().len(), 1, "the unread one fails with the connection");
    }
}
