//! Matching of incoming messages with posted receives, for one peer.
//! No I/O here: the connection's reader asks where a payload goes, the caller
//! posts buffers. Messages with the same key match in posting order; a message
//! that arrives before its receive is posted is kept until it is.

use super::frame::Key;
use crate::error::Error;
use crate::status::Status;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// A destination buffer owned by someone who keeps it alive until `status` finishes.
pub struct RecvBuf {
    pub ptr: *mut u8,
    pub len: usize,
}
// The poster guarantees the memory outlives the transfer (see Transport::recv).
unsafe impl Send for RecvBuf {}

pub struct PostedRecv {
    pub buf: RecvBuf,
    pub status: Arc<Status>,
}

/// Where the payload of an arriving frame goes.
pub enum Delivery {
    /// Straight into this posted buffer (the sizes agree).
    Direct(PostedRecv),
    /// A receive is posted but its size differs: drain the payload and fail it.
    Mismatch(PostedRecv),
    /// Nobody is waiting yet: read it into memory and `stash` it.
    Stash,
}

#[derive(Default)]
pub struct Mailbox {
    posted: HashMap<Key, VecDeque<PostedRecv>>,
    early: HashMap<Key, VecDeque<Vec<u8>>>,
    closed: Option<Error>,
}

impl Mailbox {
    /// A frame header arrived from this peer.
    pub fn on_header(&mut self, key: Key, len: u64) -> Delivery {
        let Some(q) = self.posted.get_mut(&key) else { return Delivery::Stash };
        let p = q.pop_front().expect("empty queues are removed");
        if q.is_empty() {
            self.posted.remove(&key);
        }
        if p.buf.len as u64 == len {
            Delivery::Direct(p)
        } else {
            Delivery::Mismatch(p)
        }
    }

    /// An early payload was read into memory. A receive may have been posted
    /// while it was being read: then it completes now.
    pub fn stash(&mut self, key: Key, data: Vec<u8>) {
        match self.on_header(key, data.len() as u64) {
            Delivery::Direct(p) => {
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p.buf.ptr, data.len()) };
                p.status.finish(Ok(data.len() as i64));
            }
            Delivery::Mismatch(p) => fail_mismatch(p, data.len() as u64),
            Delivery::Stash => self.early.entry(key).or_default().push_back(data),
        }
    }

    /// Post a receive. It completes at once from an early message, fails at
    /// once if the peer is gone, or waits for the reader.
    pub fn post(&mut self, key: Key, recv: PostedRecv) {
        if let Some(q) = self.early.get_mut(&key) {
            let data = q.pop_front().expect("empty queues are removed");
            if q.is_empty() {
                self.early.remove(&key);
            }
            if data.len() == recv.buf.len {
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), recv.buf.ptr, data.len()) };
                recv.status.finish(Ok(data.len() as i64));
            } else {
                fail_mismatch(recv, data.len() as u64);
            }
            return;
        }
        if let Some(err) = &self.closed {
            recv.status.finish(Err(err.clone()));
            return;
        }
        self.posted.entry(key).or_default().push_back(recv);
    }

    /// Withdraw a posted receive that has not started. False if the reader
    /// already owns it (it will finish it) or it is finished.
    pub fn cancel(&mut self, key: Key, status: &Arc<Status>) -> bool {
        let Some(q) = self.posted.get_mut(&key) else { return false };
        let Some(i) = q.iter().position(|p| Arc::ptr_eq(&p.status, status)) else { return false };
        q.remove(i);
        if q.is_empty() {
            self.posted.remove(&key);
        }
        true
    }

    /// The peer is gone: fail every waiting receive and all later ones.
    pub fn close(&mut self, err: Error) {
        if self.closed.is_none() {
            self.closed = Some(err.clone());
        }
        for (_, q) in self.posted.drain() {
            for p in q {
                p.status.finish(Err(err.clone()));
            }
        }
    }

    pub fn closed(&self) -> Option<&Error> {
        self.closed.as_ref()
    }
}

pub fn fail_mismatch(p: PostedRecv, got: u64) {
    p.status.finish(Err(Error::invalid(format!(
        "size mismatch: the receive expects {} bytes but the peer sent {got}",
        p.buf.len
    ))));
}

/// Deliver `data` the way a reader would, for tests and for stashed copies.
#[cfg(test)]
pub fn deliver(mb: &mut Mailbox, key: Key, data: &[u8]) {
    match mb.on_header(key, data.len() as u64) {
        Delivery::Direct(p) => {
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p.buf.ptr, data.len()) };
            p.status.finish(Ok(data.len() as i64));
        }
        Delivery::Mismatch(p) => fail_mismatch(p, data.len() as u64),
        Delivery::Stash => mb.stash(key, data.to_vec()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post(mb: &mut Mailbox, key: Key, buf: &mut [u8]) -> Arc<Status> {
        let status = Status::new();
        mb.post(key, PostedRecv { buf: RecvBuf { ptr: buf.as_mut_ptr(), len: buf.len() }, status: status.clone() });
        status
    }

    #[test]
    fn posted_then_arrived_and_early_then_posted() {
        let mut mb = Mailbox::default();
        let mut a = [0u8; 3];
        let sa = post(&mut mb, Key::p2p(1), &mut a);
        assert!(!sa.is_done());
        deliver(&mut mb, Key::p2p(1), &[1, 2, 3]);
        assert_eq!(sa.result().unwrap().unwrap(), 3);
        assert_eq!(a, [1, 2, 3]);

        deliver(&mut mb, Key::p2p(2), &[9, 9]);
        let mut b = [0u8; 2];
        let sb = post(&mut mb, Key::p2p(2), &mut b);
        assert!(sb.is_done());
        assert_eq!(b, [9, 9]);
    }

    #[test]
    fn same_key_matches_in_order_and_tags_do_not_mix() {
        let mut mb = Mailbox::default();
        deliver(&mut mb, Key::p2p(5), &[1]);
        deliver(&mut mb, Key::p2p(6), &[6]);
        deliver(&mut mb, Key::p2p(5), &[2]);
        let (mut x, mut y, mut z) = ([0u8], [0u8], [0u8]);
        post(&mut mb, Key::p2p(5), &mut x);
        post(&mut mb, Key::p2p(5), &mut y);
        post(&mut mb, Key::p2p(6), &mut z);
        assert_eq!((x, y, z), ([1], [2], [6]));
    }

    #[test]
    fn size_mismatch_fails_the_receive() {
        let mut mb = Mailbox::default();
        let mut a = [0u8; 4];
        let s = post(&mut mb, Key::collective(1, 0), &mut a);
        deliver(&mut mb, Key::collective(1, 0), &[1, 2]);
        let err = s.result().unwrap().unwrap_err();
        assert!(err.message.contains("size mismatch"), "{}", err.message);
    }

    #[test]
    fn cancel_and_close() {
        let mut mb = Mailbox::default();
        let mut a = [0u8; 1];
        let mut b = [0u8; 1];
        let sa = post(&mut mb, Key::p2p(1), &mut a);
        let sb = post(&mut mb, Key::p2p(1), &mut b);
        assert!(mb.cancel(Key::p2p(1), &sa));
        assert!(!mb.cancel(Key::p2p(1), &sa));
        mb.close(Error::peer_lost("gone"));
        assert!(!sa.is_done(), "a cancelled receive is the canceller's to finish");
        assert_eq!(sb.result().unwrap().unwrap_err().message, "gone");
        let mut c = [0u8; 1];
        let sc = post(&mut mb, Key::p2p(1), &mut c);
        assert!(sc.result().unwrap().is_err(), "posting to a closed mailbox fails at once");
    }
}
