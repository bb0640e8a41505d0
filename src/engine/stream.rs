//! A stream that a thread runs: copies between a device and its host copies
//! run in the order they were queued, and a copy back may be held behind its
//! op's gate until the engine opens it. This is stream-ordered completion
//! as a CUDA stream gives it (a copy queued behind a wait for a value the
//! engine writes), for devices whose copies happen at once on the calling
//! thread: host memory standing in for a device (`RUSTC10D_TEST_STAGING`),
//! and tests. One per group, so that one group's held copies never hold up
//! another's (as NCCL keeps a stream per communicator).

use super::staging::{Device, Event, Gates};
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long `stop` waits for the queued copies to run.
const STOP_GRACE: Duration = Duration::from_secs(10);

pub struct StreamThread {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Copy>,
    /// Copies queued so far, and run so far: a copy's event is its number.
    queued: Event,
    done: Event,
    closing: bool,
}

/// One queued copy of an op's buffer range.
struct Copy {
    op: Arc<OpShared>,
    index: usize,
    start: usize,
    len: usize,
    /// A copy back (held: until the op's gate opens), or None: a copy to the host.
    back: Option<Held>,
    event: Event,
}

#[derive(Clone, Copy, PartialEq)]
enum Held {
    Yes,
    No,
}

/// What an op's copies share with the stream.
struct OpShared {
    device: Mutex<Box<dyn Device>>,
    /// Whether the op's gate is open (taken under the stream state's lock).
    open: Mutex<bool>,
    /// The op's failed copies (by event), and its first failed copy back.
    failed_in: Mutex<Vec<(Event, Error)>>,
    failed_back: Mutex<Option<Error>>,
}

impl StreamThread {
    pub fn start(name: &str) -> Result<StreamThread> {
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || s.run())
            .map_err(|e| Error::resource(format!("rustc10d: could not start the staging stream's thread: {e}")))?;
        Ok(StreamThread { shared, thread: Mutex::new(Some(thread)) })
    }

    /// One op's side of the stream, over `device`, whose copies the stream
    /// makes (they happen at once, on the stream's thread).
    pub fn op(&self, device: Box<dyn Device>) -> StreamOp {
        let op = Arc::new(OpShared {
            device: Mutex::new(device),
            open: Mutex::new(false),
            failed_in: Mutex::default(),
            failed_back: Mutex::new(None),
        });
        StreamOp { stream: self.shared.clone(), op, last: 0 }
    }

    /// Run what is queued, then stop. Every op has opened its gates by then
    /// (they do when they settle); should one not have, the thread is left
    /// to end once it does, rather than the caller waiting on it forever.
    pub fn stop(&self) {
        let state = self.shared.state.lock().unwrap();
        let (mut state, waited) =
            self.shared.changed.wait_timeout_while(state, STOP_GRACE, |s| !s.queue.is_empty()).unwrap();
        state.closing = true;
        self.shared.changed.notify_all();
        drop(state);
        let thread = self.thread.lock().unwrap().take();
        match thread {
            Some(t) if !waited.timed_out() => drop(t.join()),
            Some(_) => tracing::warn!("rustc10d: the staging stream still held copies at shutdown; left to finish"),
            None => {}
        }
    }
}

impl Drop for StreamThread {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    fn run(&self) {
        let mut state = self.state.lock().unwrap();
        loop {
            let Some(next) = state.queue.front() else {
                if state.closing {
                    return;
                }
                state = self.changed.wait(state).unwrap();
                continue;
            };
            if next.back == Some(Held::Yes) && !*next.op.open.lock().unwrap() {
                // In stream order: nothing after a held copy runs before it.
                state = self.changed.wait(state).unwrap();
                continue;
            }
            let copy = state.queue.pop_front().unwrap();
            drop(state);
            // A copy that panics fails its op, not the stream every later op waits on.
            let copied = crate::panics::contain("a staging stream's copy", || {
                let mut device = copy.op.device.lock().unwrap();
                match copy.back {
                    Some(_) => device.to_device(copy.index, copy.start, copy.len),
                    None => device.to_host(copy.index, copy.start, copy.len).and_then(|e| device.wait(e)),
                }
            })
            .and_then(|r| r);
            match (copied, copy.back) {
                (Err(e), Some(_)) => drop(copy.op.failed_back.lock().unwrap().get_or_insert(e)),
                (Err(e), None) => copy.op.failed_in.lock().unwrap().push((copy.event, e)),
                _ => {}
            }
            state = self.state.lock().unwrap();
            state.done += 1;
            self.changed.notify_all();
        }
    }
}

/// One op's copies on a `StreamThread`.
pub struct StreamOp {
    stream: Arc<Shared>,
    op: Arc<OpShared>,
    /// The event of this op's last queued copy.
    last: Event,
}

impl StreamOp {
    fn queue(&mut self, index: usize, start: usize, len: usize, back: Option<Held>) -> Event {
        let mut state = self.stream.state.lock().unwrap();
        state.queued += 1;
        self.last = state.queued;
        state.queue.push_back(Copy { op: self.op.clone(), index, start, len, back, event: self.last });
        self.stream.changed.notify_all();
        self.last
    }

    /// Block until the stream has run copy `event`.
    fn reached(&self, event: Event) {
        let state = self.stream.state.lock().unwrap();
        drop(self.stream.changed.wait_while(state, |s| s.done < event).unwrap());
    }
}

impl Device for StreamOp {
    fn to_host(&mut self, index: usize, start: usize, len: usize) -> Result<Event> {
        Ok(self.queue(index, start, len, None))
    }

    fn wait(&mut self, event: Event) -> Result<()> {
        self.reached(event);
        let failed = self.op.failed_in.lock().unwrap();
        failed.iter().find(|(e, _)| *e == event).map_or(Ok(()), |(_, why)| Err(why.clone()))
    }

    fn to_device(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        self.queue(index, start, len, Some(Held::No));
        Ok(())
    }

    fn gates(&mut self) -> Option<&mut dyn Gates> {
        Some(self)
    }
}

impl Gates for StreamOp {
    fn to_device_held(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        self.queue(index, start, len, Some(Held::Yes));
        Ok(())
    }

    fn open(&mut self) {
        // Under the stream's lock, so that the thread cannot miss it between its look and its wait.
        let _state = self.stream.state.lock().unwrap();
        *self.op.open.lock().unwrap() = true;
        self.stream.changed.notify_all();
    }

    fn restore(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        let mut device = self.op.device.lock().unwrap();
        device.to_host(index, start, len).and_then(|e| device.wait(e))
    }

    fn finish(&mut self) -> Result<()> {
        self.reached(self.last);
        self.op.failed_back.lock().unwrap().clone().map_or(Ok(()), Err)
    }
}
