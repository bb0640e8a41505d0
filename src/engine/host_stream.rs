//! A held stream that a thread runs, for a device whose copies happen at
//! once on the calling thread: host memory standing in for a CUDA device
//! (`RUSTC10D_TEST_STAGING`), and tests. What is queued runs in order, and a
//! wait for the gate word (`GateWord::hold_until`) holds everything behind
//! it until the word reaches its value, as `cuStreamWaitValue32` holds a
//! CUDA stream; the gates (gates.rs) are the very ones a CUDA device has.
//! The op's consumer here is the host, not a stream: an op's completion runs
//! once its copies back have (`AfterCopies`), where on a device the shim
//! orders the caller's stream after them with an event.

use super::gates::{GateWord, HeldCopies};
use super::staging::{Device, Event};
use crate::error::{Error, Result};
use crate::locks::{level, Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How long `stop` waits for what is queued to run.
const STOP_GRACE: Duration = Duration::from_secs(10);

type Job = Box<dyn FnOnce() + Send>;

/// One group's held stream (clones share it).
#[derive(Clone)]
pub struct HostStream {
    shared: Arc<Shared>,
}

struct Shared {
    /// A leaf lock: nothing is called under it.
    state: Mutex<level::HostStreamState, State>,
    changed: Condvar,
    thread: Mutex<level::HostStreamThread, Option<JoinHandle<()>>>,
}

#[derive(Default)]
struct State {
    word: u32,
    queue: VecDeque<Item>,
    /// Items queued so far, and run so far: an item's position is its number.
    queued: u64,
    done: u64,
    /// What runs once the stream has run everything up to a position.
    after: Vec<(u64, Job)>,
    closing: bool,
}

enum Item {
    /// Wait until the word reaches this value (cyclically).
    Until(u32),
    Run(Job),
}

impl HostStream {
    pub fn start(name: &str) -> Result<HostStream> {
        let shared = Arc::new(Shared { state: Mutex::default(), changed: Condvar::new(), thread: Mutex::new(None) });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || s.run())
            .map_err(|e| Error::resource(format!("rustc10d: could not start the staging stream's thread: {e}")))?;
        *shared.thread.lock().unwrap() = Some(thread);
        Ok(HostStream { shared })
    }

    fn push(&self, item: Item) -> u64 {
        let mut state = self.shared.state.lock().unwrap();
        state.queue.push_back(item);
        state.queued += 1;
        self.shared.changed.notify_all();
        state.queued
    }

    /// Queue `f`: it runs on the stream's thread, in order. Its position.
    pub fn run(&self, f: Job) -> u64 {
        self.push(Item::Run(f))
    }

    /// Run `f` once everything queued up to position `at` has run: on the
    /// stream's thread, or here and now where it has.
    pub fn after(&self, at: u64, f: Job) {
        let mut state = self.shared.state.lock().unwrap();
        if state.done < at {
            state.after.push((at, f));
            return;
        }
        drop(state);
        contained(f);
    }

    /// Run what is queued, then end the thread. Every op has ended its
    /// ticket by now (the gates close first); should something still be
    /// held, the thread is left to end once it is let through.
    pub fn stop(&self) {
        let state = self.shared.state.lock().unwrap();
        let (mut state, waited) = self
            .shared
            .changed
            .wait_timeout_while(state, STOP_GRACE, |s| !s.queue.is_empty() || !s.after.is_empty())
            .unwrap();
        state.closing = true;
        self.shared.changed.notify_all();
        drop(state);
        let thread = self.shared.thread.lock().unwrap().take();
        match thread {
            Some(t) if !waited.timed_out() => drop(t.join()),
            Some(_) => tracing::warn!("rustc10d: the staging stream still held copies at shutdown; left to finish"),
            None => {}
        }
    }
}

fn contained(f: Job) {
    if let Err(e) = crate::panics::contain("the staging stream's work", f) {
        tracing::error!("{}", e.message);
    }
}

impl Shared {
    fn run(&self) {
        let mut state = self.state.lock().unwrap();
        loop {
            let (done, after) = (state.done, std::mem::take(&mut state.after));
            let (due, later): (Vec<_>, Vec<_>) = after.into_iter().partition(|(at, _)| *at <= done);
            state.after = later;
            if !due.is_empty() {
                drop(state);
                due.into_iter().for_each(|(_, f)| contained(f));
                state = self.state.lock().unwrap();
                self.changed.notify_all();
                continue;
            }
            let runnable = match state.queue.front() {
                Some(Item::Until(v)) => (state.word.wrapping_sub(*v) as i32) >= 0,
                Some(Item::Run(_)) => true,
                None if state.closing => return,
                None => false,
            };
            if !runnable {
                state = self.changed.wait(state).unwrap();
                continue;
            }
            if let Some(Item::Run(f)) = state.queue.pop_front() {
                drop(state);
                contained(f);
                state = self.state.lock().unwrap();
            }
            state.done += 1;
            self.changed.notify_all();
        }
    }
}

impl GateWord for HostStream {
    fn hold_until(&self, value: u32) -> Result<()> {
        self.push(Item::Until(value));
        Ok(())
    }

    fn release_to(&self, value: u32) {
        self.shared.state.lock().unwrap().word = value;
        self.shared.changed.notify_all();
    }
}

/// What runs an op's completion once its copies back have run.
pub struct AfterCopies {
    stream: HostStream,
    last: Arc<AtomicU64>,
}

impl AfterCopies {
    pub fn then(&self, f: Job) {
        self.stream.after(self.last.load(Ordering::SeqCst), f);
    }
}

/// An op's copies on a `HostStream`, over a device whose copies happen at
/// once (the clones of `device` share its buffers): the copies in run on the
/// calling thread, at issue; the copies back are queued on the stream.
pub struct HostHeld<D> {
    device: D,
    stream: HostStream,
    /// The position of the op's last queued copy back.
    last: Arc<AtomicU64>,
}

impl<D> HostHeld<D> {
    pub fn new(device: D, stream: HostStream) -> HostHeld<D> {
        HostHeld { device, stream, last: Arc::default() }
    }
}

impl<D: Device + Clone + 'static> Device for HostHeld<D> {
    fn to_host(&mut self, index: usize, start: usize, len: usize) -> Result<Event> {
        self.device.to_host(index, start, len)
    }
    fn wait(&mut self, event: Event) -> Result<()> {
        self.device.wait(event)
    }
    fn to_device(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        self.device.to_device(index, start, len)
    }
}

impl<D: Device + Clone + 'static> HeldCopies for HostHeld<D> {
    fn to_device_held(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        let mut device = self.device.clone();
        let at = self.stream.run(Box::new(move || {
            if let Err(e) = device.to_device(index, start, len) {
                tracing::error!("rustc10d: a staged copy back failed: {}", e.message);
            }
        }));
        self.last.store(at, Ordering::SeqCst);
        Ok(())
    }

    fn restore(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        let e = self.device.to_host(index, start, len)?;
        self.device.wait(e)
    }

    fn after_copies(&self) -> Option<AfterCopies> {
        Some(AfterCopies { stream: self.stream.clone(), last: self.last.clone() })
    }
}
