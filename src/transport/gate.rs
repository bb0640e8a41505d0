//! A receive posted once a send from the same memory has finished
//! (`Transport::recv_after`): an algorithm that sends a chunk and later
//! receives into it lends the chunk to both at once, and the transport, not
//! the order of the messages, keeps the receive from writing it while the
//! send may still read it. The receive is posted from the send's completion
//! (`Status::then`), on whichever thread finishes the send; until then the
//! `Transfers` that lent the memory may withdraw it, and a withdrawn one is
//! never posted.

use crate::error::Error;
use crate::status::Status;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

const WAITING: u8 = 0;
const POSTING: u8 = 1;
const POSTED: u8 = 2;
const WITHDRAWN: u8 = 3;

/// A receive's wait for a send: the send, and where the receive is (waiting
/// for it, being posted, posted (or failed with the send), or withdrawn).
pub struct Gate {
    send: Arc<Status>,
    state: AtomicU8,
}

impl Gate {
    /// For a receive that waits for the send whose status is `send`.
    pub fn after(send: Arc<Status>) -> Arc<Gate> {
        Arc::new(Gate { send, state: AtomicU8::new(WAITING) })
    }

    /// Once the send finishes: run `post` if it finished well, else finish
    /// `status` with its error; unless the receive was withdrawn first.
    pub fn post_after(self: &Arc<Self>, status: Arc<Status>, post: impl FnOnce() + Send + 'static) {
        let gate = self.clone();
        self.send.then(Box::new(move |sent| {
            if gate.state.compare_exchange(WAITING, POSTING, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return;
            }
            // Posted, or failed: a panic while posting fails the receive too,
            // so that nobody waits for it (or for the gate) for ever.
            let failed = match sent {
                Ok(_) => crate::panics::contain("posting a receive", post).err(),
                Err(e) => Some(Error::new(e.kind, format!("the send it waited for failed: {}", e.message))),
            };
            if let Some(e) = failed {
                status.finish(Err(e));
            }
            gate.state.store(POSTED, Ordering::Release);
        }));
    }

    /// Withdraw the receive if it was not posted yet: true if it never will
    /// be (its memory is untouched, and its status the caller's to finish).
    /// False once it is posted (or failed): withdraw it from the transport.
    pub fn withdraw(&self) -> bool {
        loop {
            match self.state.compare_exchange(WAITING, WITHDRAWN, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                // Being posted on another thread: a moment, without a lock.
                Err(POSTING) => std::thread::yield_now(),
                Err(_) => return false,
            }
        }
    }
}
