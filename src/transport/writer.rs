//! Frames waiting to be written on one connection, in order, written as the
//! connection takes them: by the sending thread at once when nothing waits
//! before it, else by the reactor once there is room. A send whose bytes are
//! not ready yet (a device tensor's copy to the host) holds back the ones
//! behind it until its `ready` has run, on the staging thread.

use super::conn::Conn;
use super::frame::{FrameHeader, Key, HEADER_LEN};
use super::Ready;
use crate::error::{Error, Result};
use crate::status::Status;
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::Arc;

pub struct SendReq {
    header: [u8; HEADER_LEN],
    data: *const u8,
    len: usize,
    pub status: Arc<Status>,
    ready: Readiness,
}
// The sender keeps `data` alive until `status` finishes (Transport::send's contract).
unsafe impl Send for SendReq {}

enum Readiness {
    Now,
    Later(Ready),
    Running,
}

impl SendReq {
    pub fn new(key: Key, data: *const u8, len: usize, status: Arc<Status>, ready: Option<Ready>) -> SendReq {
        let header = FrameHeader { key, len: len as u64 }.encode();
        SendReq { header, data, len, status, ready: ready.map_or(Readiness::Now, Readiness::Later) }
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
}

impl Outbox {
    pub fn push(&mut self, req: SendReq) {
        self.queue.push_back(req);
    }

    /// Whether a frame is half written (nothing else may be written on the connection meanwhile).
    pub fn mid_frame(&self) -> bool {
        self.written > 0
    }

    /// Write what `conn` takes; the sends written in full go to `finished`
    /// (to be finished without the lock held).
    pub fn flush(&mut self, conn: &Conn, finished: &mut Vec<SendReq>) -> Flushed {
        while let Some(req) = self.queue.front_mut() {
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
            let payload = unsafe { std::slice::from_raw_parts(req.data, req.len) };
            let total = HEADER_LEN + req.len;
            while self.written < total {
                let n = if self.written < HEADER_LEN {
                    conn.write(&[IoSlice::new(&req.header[self.written..]), IoSlice::new(payload)])
                } else {
                    conn.write(&[IoSlice::new(&payload[self.written - HEADER_LEN..])])
                };
                match n {
                    Ok(0) => return Flushed::Failed(io::ErrorKind::WriteZero.into()),
                    Ok(n) => self.written += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Flushed::Full,
                    Err(e) => return Flushed::Failed(e),
                }
            }
            self.written = 0;
            finished.push(self.queue.pop_front().expect("front"));
        }
        Flushed::All
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

    /// Everything still queued (the connection is gone).
    pub fn take_all(&mut self) -> Vec<SendReq> {
        self.written = 0;
        self.queue.drain(..).collect()
    }
}

/// Finish sends written in full.
pub fn finish_written(reqs: Vec<SendReq>) {
    for r in reqs {
        r.status.finish(Ok(r.len as i64));
    }
}
