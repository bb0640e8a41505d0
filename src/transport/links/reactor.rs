//! The process's one I/O thread: an epoll loop that serves every connection
//! and listener of every group, and runs timers and deferred tasks; and, only
//! where a job needs one, a second thread for the few tasks that block (a
//! device copy a send waits for). Both start with the first group and stop
//! when the last one is gone, so the number of threads does not grow with
//! peers or groups.
//!
//! Sources register a file descriptor with the events they want; the loop
//! calls `Source::ready` from its thread. Epoll is level-triggered: a source
//! that cannot make progress must change its interest (or it is called again).

use crate::error::{Error, Result};
use crate::locks::{level, Mutex};
use crate::panics;
use std::collections::{BinaryHeap, HashMap};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const READABLE: u32 = libc::EPOLLIN as u32 | libc::EPOLLRDHUP as u32;
pub const WRITABLE: u32 = libc::EPOLLOUT as u32;

/// Something with a file descriptor the loop watches.
pub trait Source: Send + Sync {
    /// The descriptor is ready: `events` is epoll's mask (EPOLLIN, EPOLLOUT,
    /// EPOLLHUP, EPOLLERR...). May still be called once or twice after
    /// `deregister`, with events fetched before it.
    fn ready(&self, events: u32);

    /// `ready` panicked (`why` says where and what); the source is no longer
    /// watched. Fail what depends on it (a link gives up on its peer, which
    /// fails the ops waiting for it and breaks their groups).
    fn contain(&self, why: &Error) {
        let _ = why;
    }
}

pub type Task = Box<dyn FnOnce() + Send>;

/// Something the loop polls for a while instead of sleeping on a descriptor
/// (a shared-memory connection that was just busy: its next message is
/// likely near, and polling for it costs no syscall on either side).
pub trait Spinner: Send + Sync {
    /// Make progress without blocking; true if there was any.
    fn spin(&self) -> bool;
    /// The loop stops polling: wait on the descriptor again.
    fn spun(&self);

    /// `spin` or `spun` panicked; the loop no longer polls it (see `Source::contain`).
    fn contain(&self, why: &Error) {
        let _ = why;
    }
}

/// A registered source's handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(u64);

pub struct Reactor {
    core: Arc<Core>,
    /// Groups that use it (`Membership`s): the threads stop with the last.
    members: Mutex<level::ReactorMembers, usize>,
    thread: Mutex<level::ReactorThread, Option<JoinHandle<()>>>,
    /// The thread for blocking tasks, once one was needed.
    blocking: Mutex<level::ReactorBlocking, Option<BlockingThread>>,
}

/// The thread for blocking tasks, and where to send it one.
type BlockingThread = (std::sync::mpsc::Sender<Task>, JoinHandle<()>);

struct Core {
    epoll: OwnedFd,
    /// An eventfd the loop watches: written to run tasks or to stop.
    wake: OwnedFd,
    state: Mutex<level::ReactorState, State>,
}

#[derive(Default)]
struct State {
    /// By token: the source and its descriptor (to stop watching it if it panics).
    sources: HashMap<u64, (RawFd, Arc<dyn Source>)>,
    next: u64,
    tasks: Vec<Task>,
    timers: BinaryHeap<Timer>,
    /// Polled until their time is up (extended while they make progress).
    spinners: Vec<(Arc<dyn Spinner>, Instant, Duration)>,
    stopping: bool,
}

struct Timer {
    at: Instant,
    seq: u64,
    task: Task,
}

impl PartialEq for Timer {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Timer {}
impl PartialOrd for Timer {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Timer {
    /// The earliest first (BinaryHeap is a max-heap).
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// The token of the wake-up eventfd.
const WAKE: u64 = u64::MAX;

static CURRENT: Mutex<level::CurrentReactor, Weak<Reactor>> = Mutex::new(Weak::new());

/// A group's use of the reactor: the reactor's threads run while any exists.
pub struct Membership(Arc<Reactor>);

impl Drop for Membership {
    fn drop(&mut self) {
        let mut current = CURRENT.lock().unwrap();
        let mut members = self.0.members.lock().unwrap();
        *members -= 1;
        if *members == 0 {
            if current.upgrade().is_some_and(|r| Arc::ptr_eq(&r, &self.0)) {
                *current = Weak::new();
            }
            drop((members, current));
            self.0.stop();
        }
    }
}

impl Reactor {
    /// The process's reactor, started if no group uses it, and this group's
    /// membership (its threads stop when the last membership is dropped).
    pub fn join() -> Result<(Arc<Reactor>, Membership)> {
        let mut current = CURRENT.lock().unwrap();
        let r = match current.upgrade() {
            Some(r) => r,
            None => {
                let r = Arc::new(Reactor::start()?);
                *current = Arc::downgrade(&r);
                r
            }
        };
        *r.members.lock().unwrap() += 1;
        Ok((r.clone(), Membership(r)))
    }

    fn start() -> Result<Reactor> {
        let os = crate::transport::links::shared_mem::os_error;
        // SAFETY: epoll_create1 takes only flags and touches no memory of ours.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(os("epoll_create1"));
        }
        // SAFETY: a descriptor epoll_create1 just returned (checked >= 0), owned by nothing else.
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        // SAFETY: eventfd takes a count and flags and touches no memory of ours.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(os("eventfd"));
        }
        // SAFETY: a descriptor eventfd just returned (checked >= 0), owned by nothing else.
        let wake = unsafe { OwnedFd::from_raw_fd(wake) };
        let core = Arc::new(Core { epoll, wake, state: Mutex::default() });
        core.ctl(libc::EPOLL_CTL_ADD, core.wake.as_raw_fd(), libc::EPOLLIN as u32, WAKE)?;
        let run = core.clone();
        let thread = std::thread::Builder::new()
            .name("rustc10d-io".into())
            .spawn(move || run.run())
            .map_err(|e| Error::resource(format!("rustc10d: could not start the I/O thread: {e}")))?;
        Ok(Reactor { core, members: Mutex::new(0), thread: Mutex::new(Some(thread)), blocking: Mutex::new(None) })
    }

    /// Watch `fd` for `interest`; `source` is called when it is ready.
    pub fn register(&self, fd: RawFd, interest: u32, source: Arc<dyn Source>) -> Result<Token> {
        let token = {
            let mut st = self.core.state.lock().unwrap();
            st.next += 1;
            let t = st.next;
            st.sources.insert(t, (fd, source));
            t
        };
        if let Err(e) = self.core.ctl(libc::EPOLL_CTL_ADD, fd, interest, token) {
            self.core.state.lock().unwrap().sources.remove(&token);
            return Err(e);
        }
        Ok(Token(token))
    }

    /// Change what `fd` is watched for.
    pub fn modify(&self, token: Token, fd: RawFd, interest: u32) {
        // A descriptor already closed (its connection is gone) has nothing to watch.
        let _ = self.core.ctl(libc::EPOLL_CTL_MOD, fd, interest, token.0);
    }

    /// Stop watching `fd` (before it is closed).
    pub fn deregister(&self, token: Token, fd: RawFd) {
        let _ = self.core.ctl(libc::EPOLL_CTL_DEL, fd, 0, token.0);
        self.core.state.lock().unwrap().sources.remove(&token.0);
    }

    /// Run `task` on the I/O thread, soon.
    pub fn defer(&self, task: Task) {
        self.core.state.lock().unwrap().tasks.push(task);
        self.core.wake();
    }

    /// Run `task` on the I/O thread after `delay`.
    pub fn after(&self, delay: Duration, task: Task) {
        let mut st = self.core.state.lock().unwrap();
        st.next += 1;
        let seq = st.next;
        st.timers.push(Timer { at: Instant::now() + delay, seq, task });
        drop(st);
        self.core.wake();
    }

    /// Whether a reactor runs (some group uses it).
    pub fn running() -> bool {
        CURRENT.lock().unwrap().upgrade().is_some_and(|r| r.thread.lock().unwrap().is_some())
    }

    /// Run `task`, which may block, off the I/O thread, after the tasks given before it.
    pub fn run_blocking(&self, task: Task) -> Result<()> {
        let mut blocking = self.blocking.lock().unwrap();
        if blocking.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<Task>();
            let thread = std::thread::Builder::new()
                .name("rustc10d-stage".into())
                .spawn(move || {
                    for task in rx {
                        if let Err(e) = panics::contain("a blocking task of the I/O thread", task) {
                            tracing::error!("{}", e.message);
                        }
                    }
                })
                .map_err(|e| Error::resource(format!("rustc10d: could not start the staging thread: {e}")))?;
            *blocking = Some((tx, thread));
        }
        let (tx, _) = blocking.as_ref().expect("started");
        tx.send(task).map_err(|_| Error::aborted("rustc10d: the staging thread has stopped"))
    }

    /// Poll `spinner` for `spin` (again after each bit of progress) instead
    /// of sleeping; then it is told (`spun`) to wait on its descriptor.
    pub fn spin(&self, spinner: Arc<dyn Spinner>, spin: Duration) {
        let mut st = self.core.state.lock().unwrap();
        if st.spinners.iter().any(|(s, ..)| Arc::ptr_eq(s, &spinner)) {
            return;
        }
        st.spinners.push((spinner, Instant::now() + spin, spin));
        drop(st);
        self.core.wake();
    }

    /// Whether the caller is the I/O thread.
    pub fn on_io_thread(&self) -> bool {
        let thread = self.thread.lock().unwrap();
        thread.as_ref().is_some_and(|t| t.thread().id() == std::thread::current().id())
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Reactor {
    /// Stop the threads (they finish what they run). Idempotent.
    fn stop(&self) {
        let me = std::thread::current().id();
        if let Some((tx, thread)) = self.blocking.lock().unwrap().take() {
            drop(tx);
            if thread.thread().id() != me {
                let _ = thread.join();
            }
        }
        self.core.state.lock().unwrap().stopping = true;
        self.core.wake();
        if let Some(t) = self.thread.lock().unwrap().take() {
            // The last group may go away on the I/O thread itself: it ends on its own.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        // What the sources and tasks hold goes now, not with the last handle.
        let st = std::mem::take(&mut *self.core.state.lock().unwrap());
        drop(st);
        self.core.state.lock().unwrap().stopping = true;
    }
}

impl Core {
    fn ctl(&self, op: i32, fd: RawFd, events: u32, token: u64) -> Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` is a live local epoll_ctl reads (it keeps no pointer to it);
        // the epoll descriptor is ours and open (owned by `self`).
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut ev) } != 0 {
            return Err(Error::io(format!("rustc10d: epoll_ctl failed: {}", std::io::Error::last_os_error())));
        }
        Ok(())
    }

    fn wake(&self) {
        let one = 1u64;
        // SAFETY: writes the 8 bytes of a live local u64 (an eventfd takes exactly
        // 8) to the eventfd `self` owns; a full counter (EAGAIN) is fine: the
        // loop is woken already.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn run(&self) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
        loop {
            let (tasks, spinners, timeout_ms) = {
                let mut st = self.state.lock().unwrap();
                if st.stopping {
                    return;
                }
                let now = Instant::now();
                let mut due = std::mem::take(&mut st.tasks);
                while st.timers.peek().is_some_and(|t| t.at <= now) {
                    due.push(st.timers.pop().expect("peeked").task);
                }
                let spinners: Vec<_> = st.spinners.iter().map(|(s, ..)| s.clone()).collect();
                let wait = match (due.is_empty() && spinners.is_empty(), st.timers.peek()) {
                    (false, _) => 0,
                    (true, Some(t)) => {
                        t.at.saturating_duration_since(now).as_millis().clamp(1, i32::MAX as u128) as i32
                    }
                    (true, None) => -1,
                };
                (due, spinners, wait)
            };
            for task in tasks {
                // A task has no owner to fail: its link's next event, contained below, does that.
                if let Err(e) = panics::contain("a task of the I/O thread", task) {
                    tracing::error!("{}", e.message);
                }
            }
            if !spinners.is_empty() {
                self.spin_once(&spinners);
            }
            // SAFETY: `events` is a live Vec of events.len() epoll_events, which
            // epoll_wait fills at most maxevents of; the epoll descriptor is ours.
            let n = unsafe {
                libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, timeout_ms)
            };
            for ev in events.iter().take(n.max(0) as usize) {
                let (mask, token) = (ev.events, ev.u64);
                if token == WAKE {
                    let mut count = 0u64;
                    // SAFETY: reads 8 bytes into a live local u64 from the wake-up eventfd
                    // `self` owns (non-blocking: an empty one is EAGAIN, harmless).
                    unsafe { libc::read(self.wake.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
                    continue;
                }
                let source = self.state.lock().unwrap().sources.get(&token).cloned();
                if let Some((fd, source)) = source {
                    if let Err(e) = panics::contain("the I/O thread", || source.ready(mask)) {
                        // Level-triggered: watched still, it would panic again at once.
                        let _ = self.ctl(libc::EPOLL_CTL_DEL, fd, 0, token);
                        self.state.lock().unwrap().sources.remove(&token);
                        tracing::error!("{}", e.message);
                        if let Err(again) = panics::contain("the I/O thread", || source.contain(&e)) {
                            tracing::error!("{}", again.message);
                        }
                    }
                }
            }
        }
    }

    /// Poll every spinner once; extend those that made progress, let go of
    /// those whose time is up, and give the CPU away meanwhile.
    fn spin_once(&self, spinners: &[Arc<dyn Spinner>]) {
        let progressed: Vec<bool> = spinners
            .iter()
            .map(|s| match panics::contain("the I/O thread", || s.spin()) {
                Ok(progress) => progress,
                Err(e) => {
                    self.state.lock().unwrap().spinners.retain(|(other, ..)| !Arc::ptr_eq(other, s));
                    tracing::error!("{}", e.message);
                    let _ = panics::contain("the I/O thread", || s.contain(&e));
                    false
                }
            })
            .collect();
        let now = Instant::now();
        let done = {
            let mut st = self.state.lock().unwrap();
            for (s, p) in spinners.iter().zip(&progressed) {
                if let Some(entry) = st.spinners.iter_mut().find(|(e, ..)| Arc::ptr_eq(e, s)) {
                    if *p {
                        entry.1 = now + entry.2;
                    }
                }
            }
            let (over, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut st.spinners).into_iter().partition(|e| e.1 <= now);
            st.spinners = keep;
            over
        };
        for (s, ..) in done {
            if let Err(e) = panics::contain("the I/O thread", || s.spun()) {
                tracing::error!("{}", e.message);
                let _ = panics::contain("the I/O thread", || s.contain(&e));
            }
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    struct Pipe {
        fd: OwnedFd,
        seen: mpsc::Sender<u32>,
    }

    impl Source for Pipe {
        fn ready(&self, events: u32) {
            let mut buf = [0u8; 16];
            // SAFETY: reads at most buf.len() bytes into the local buffer, from the
            // pipe this source owns.
            unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            let _ = self.seen.send(events);
        }
    }

    /// Panics on its first readiness; says what `contain` was told.
    struct Faulty {
        fd: OwnedFd,
        contained: mpsc::Sender<String>,
    }

    impl Source for Faulty {
        fn ready(&self, _: u32) {
            panic!("a bug in a source of fd {}", self.fd.as_raw_fd() >= 0);
        }
        fn contain(&self, why: &Error) {
            let _ = self.contained.send(why.message.clone());
        }
    }

    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into `fds`, a live local array of two.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) }, 0);
        // SAFETY: the two descriptors pipe2 just made (it returned 0), owned by nothing else.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    #[test]
    fn a_panicking_source_or_task_is_contained_and_the_loop_goes_on() {
        let (r, _member) = Reactor::join().unwrap();
        let (faulty_rd, faulty_wr) = pipe();
        let (contained_tx, contained_rx) = mpsc::channel();
        let raw = faulty_rd.as_raw_fd();
        r.register(raw, READABLE, Arc::new(Faulty { fd: faulty_rd, contained: contained_tx })).unwrap();
        r.defer(Box::new(|| panic!("a bug in a task")));
        // SAFETY: writes one byte of a static string to the pipe's write end, which is open.
        unsafe { libc::write(faulty_wr.as_raw_fd(), b"x".as_ptr().cast(), 1) };
        let why = contained_rx.recv_timeout(Duration::from_secs(5)).expect("contain was called");
        assert!(why.contains("the I/O thread hit an internal error: a bug in a source"), "{why}");
        // The loop still serves other sources, tasks and timers; the faulty
        // source is no longer watched (level-triggered, it would spin).
        let (rd, wr) = pipe();
        let (tx, rx) = mpsc::channel();
        let fd = rd.as_raw_fd();
        r.register(fd, READABLE, Arc::new(Pipe { fd: rd, seen: tx })).unwrap();
        // SAFETY: writes one byte of a static string to the pipe's write end, which is open.
        unsafe { libc::write(wr.as_raw_fd(), b"y".as_ptr().cast(), 1) };
        assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok(), "the loop stopped serving sources");
        let (done_tx, done_rx) = mpsc::channel();
        r.after(Duration::from_millis(1), Box::new(move || done_tx.send(()).unwrap()));
        assert!(done_rx.recv_timeout(Duration::from_secs(5)).is_ok(), "the loop stopped running timers");
        assert!(contained_rx.recv_timeout(Duration::from_millis(100)).is_err(), "contained once");
    }

    #[test]
    fn sources_tasks_and_timers_run_on_the_io_thread() {
        let (r, _member) = Reactor::join().unwrap();
        let (again, _other) = Reactor::join().unwrap();
        assert!(Arc::ptr_eq(&r, &again), "one per process while used");
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into `fds`, a live local array of two.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) }, 0);
        // SAFETY: the two descriptors pipe2 just made (it returned 0), owned by nothing else.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let (tx, rx) = mpsc::channel();
        let raw = rd.as_raw_fd();
        let token = r.register(raw, READABLE, Arc::new(Pipe { fd: rd, seen: tx })).unwrap();
        // SAFETY: writes one byte of a static string to the pipe's write end, which is open.
        unsafe { libc::write(wr.as_raw_fd(), b"x".as_ptr().cast(), 1) };
        let ev = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(ev & libc::EPOLLIN as u32 != 0);
        r.deregister(token, raw);

        let ran = Arc::new(AtomicUsize::new(0));
        let (done_tx, done_rx) = mpsc::channel();
        let (a, b) = (ran.clone(), done_tx.clone());
        let t0 = Instant::now();
        r.after(Duration::from_millis(50), Box::new(move || b.send(a.fetch_add(1, Ordering::SeqCst)).unwrap()));
        let (a, b) = (ran.clone(), done_tx);
        let io = r.clone();
        r.defer(Box::new(move || {
            assert!(io.on_io_thread());
            b.send(a.fetch_add(1, Ordering::SeqCst)).unwrap()
        }));
        assert_eq!(done_rx.recv_timeout(Duration::from_secs(5)).unwrap(), 0, "the task first");
        assert_eq!(done_rx.recv_timeout(Duration::from_secs(5)).unwrap(), 1, "then the timer");
        assert!(t0.elapsed() >= Duration::from_millis(50));
    }
}
