//! Locks with levels: every mutex of the crate has a place in one order, the
//! list in `levels!` below, and a thread that holds a lock takes only locks
//! further down that list. Two threads can then never wait for each other's
//! locks, which is the whole argument against deadlock; a lock's level is
//! part of its type (`Mutex<level::Mailbox, Mailbox>`), so a new lock cannot
//! be added without choosing its place.
//!
//! Checked in debug builds (every `cargo test`) and with the `lock-levels`
//! feature (a release build of the extension for a run of the whole suite):
//! each thread keeps the levels it holds, and taking a lock at or above one
//! of them panics, naming both, before it can block. Locks of one level
//! (one per peer, say) are never held two at a time. `try_lock` cannot
//! block, so it is not checked, but what it holds counts for later locks.
//! Waiting on a `Condvar` keeps the level: the thread takes nothing while it
//! waits. Without checking, a lock is std's (and, an I/O lock, a count in the thread).
//!
//! The transport's locks are also marked `io`: an op that completes while
//! its thread holds one finishes when the thread lets go of the last
//! (`when_unlocked`), since completing it runs torch's callbacks, which may
//! issue the next op and take the same lock again. That part is always on.
//!
//! With `RUSTC10D_LOCK_ORDER_LOG=<file>` a checked build appends each
//! inversion to that file instead of panicking, once per pair of levels:
//! the way to survey a whole suite in one run.
//!
//! Not here: the arena pool's table and each rank's "alive" lock are
//! process-shared pthread mutexes (`arena_pool.rs`), taken last, with
//! nothing else locked while they are held.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::{LockResult, PoisonError, TryLockError, TryLockResult};
use std::time::Duration;

/// A lock's place in the order: locks with a higher `RANK` are taken later.
pub trait Level {
    const RANK: u16;
    const NAME: &'static str;
    /// An I/O lock: completions made under it wait until the thread lets go
    /// of its last such lock (`when_unlocked`).
    const IO: bool;
}

macro_rules! levels {
    ($($(#[$doc:meta])* $name:ident $(: $io:ident)?,)*) => {
        #[allow(dead_code)]
        #[repr(u16)]
        enum Order { $($name,)* }
        $(
            $(#[$doc])*
            pub struct $name;
            impl Level for $name {
                const RANK: u16 = Order::$name as u16;
                const NAME: &'static str = stringify!($name);
                const IO: bool = levels!(@io $($io)?);
            }
        )*
    };
    (@io io) => { true };
    (@io) => { false };
}

/// The levels, outermost first: a thread holding one of these locks takes
/// only locks listed after it. Each says where it lives and, where it
/// matters, what is taken under it. Those marked `io` are the transport's:
/// no op completes under them (see `when_unlocked`).
pub mod level {
    use super::Level;

    levels! {
        /// `Engine::running`: held while a job runs, so that jobs run one at
        /// a time. First: the op's completion runs under it, and may issue
        /// the next op (which then only tries it, `turn_here`); the worker
        /// takes it with nothing else held.
        EngineTurn,
        /// A link's reader: held while a connection is read (blocking only
        /// by a thread that holds nothing else: the reactor's, a poller's;
        /// a waiter only tries it). What arrives completes receives under
        /// it, whose callbacks (the user's code) may take anything below.
        LinkReader,
        /// `python.rs`: the process's watched groups.
        WatchedGroups,
        /// `ffi::Group::name`.
        GroupName,
        /// `ffi::Group::batch`: the fences of a `_coalescing_manager` batch.
        CoalescedFences,
        /// `ffi::Group::host_gates`: the group's host stream and its gates.
        HostGates,
        /// `ffi::Group::gates`: the group's device gates, by device.
        DeviceGates,
        /// `Engine::queue`: the sender of the engine's jobs.
        EngineQueue,
        /// `Engine::coalescing`: the ops of an open coalesced batch.
        Coalescing,
        /// `Engine::worker`: the worker thread's handle.
        EngineWorker,
        /// `Engine::broken`: the error that broke the engine.
        EngineBroken,
        /// Whether a staged send is still on: its ready (which stages the
        /// tensor) runs under it, so that the send's end waits for it.
        SendLive,
        /// An op's torch half (`translate::SharedCompletion`): the shim's
        /// calls on it one at a time (issuing queues its copies in under
        /// `EngineQueue`). Its future is completed (torch's callbacks run,
        /// the user's code) once it is let go (`publish`).
        Completion,
        /// `translate::Fence`: whether a stream-ordered op's fence passed.
        Fence,
        /// How many of a set of fences have yet to pass (`Fence::after_all`).
        FencesLeft,
        /// `StreamGates`' thread handle.
        GatesThread,
        /// `StreamGates`' tickets (`GateWord` calls under it).
        GatesState,
        /// `HostStream`'s queue.
        HostStreamState,
        /// `HostStream`'s thread handle.
        HostStreamThread,
        /// An op's sparse all-reduce result, gathered by the engine.
        SparseGathered,
        /// Accepted connections still in their handshake.
        Handshakes: io,
        /// One handshake's state.
        Shake: io,
        /// `Mesh::membership`.
        Membership,
        /// `Mesh::listeners`.
        Listeners,
        /// `Mesh::peer_reads`: the grant to read peers' memory.
        PeerReadsGrant,
        /// `Mesh::channels`: the groups' channels; taken alone, also on the
        /// I/O thread.
        Channels: io,
        /// `Mesh::arena`: the world group's arena.
        MeshArena,
        /// A channel's (a group's) arena.
        ChannelArena,
        /// `Arena::local`: this rank's view of a round.
        ArenaLocal,
        /// A pipelined op's first error.
        PipelineError,
        /// A peer's connections (`mesh_core::PeerConns`: their life and
        /// striping); `linked` waits under it.
        PeerState: io,
        /// A peer's links.
        PeerLinks: io,
        /// A link's outbox.
        LinkOutbox: io,
        /// A link's interest with the reactor.
        LinkInterest: io,
        /// A link's watched descriptors.
        LinkWatched: io,
        /// A connection's sealer (outgoing frames).
        Sealer: io,
        /// A connection's opener (incoming frames).
        Opener: io,
        /// The test transport's cut links (`fake.rs`).
        FakeCut: io,
        /// The test transport's held sends (`fake.rs`).
        FakeHeld: io,
        /// A peer's mailbox: messages and posted receives.
        Mailbox: io,
        /// Receives posted for any peer; taken under a mailbox.
        AnyPosted: io,
        /// `Mesh::waits`: the ops waiting, for the watchdog.
        Waits: io,
        /// A link's closing error.
        LinkClosed: io,
        /// The process's current reactor; a group joins it, and
        /// counts itself a member, under it.
        CurrentReactor,
        /// The reactor's members.
        ReactorMembers,
        /// The reactor's thread handle.
        ReactorThread,
        /// The reactor's blocking-task thread.
        ReactorBlocking,
        /// The reactor's state.
        ReactorState,
        /// Read grants of peers' memory held by this rank.
        PeerReadsHeld,
        /// An op's status (`status.rs`); its condvar waits under it.
        StatusState,
        /// The in-process Store (`rendezvous.rs`).
        StoreMap,
        /// The in-process Store's deleted keys.
        StoreDeleted,
        /// The first failure among the parts of `Status::all`.
        FirstFailure,
        /// Fault injection's rules.
        FaultRules,
        /// The process's spare descriptor.
        SpareFd,
        /// The process's spare CUDA streams.
        SpareStreams,
        /// A group's scratch pool.
        ScratchPool,
        /// Per-op statistics.
        Stats,
        /// What a test records from the threads it runs.
        TestRecord,
    }
}

/// A mutex with a level (see the module's doc).
pub struct Mutex<L: Level, T: ?Sized> {
    level: PhantomData<fn() -> L>,
    inner: std::sync::Mutex<T>,
}

impl<L: Level, T> Mutex<L, T> {
    pub const fn new(value: T) -> Mutex<L, T> {
        Mutex { level: PhantomData, inner: std::sync::Mutex::new(value) }
    }

    pub fn into_inner(self) -> LockResult<T> {
        self.inner.into_inner()
    }
}

impl<L: Level, T: ?Sized> Mutex<L, T> {
    /// Takes the lock (checked: only below every lock this thread holds).
    pub fn lock(&self) -> LockResult<MutexGuard<'_, L, T>> {
        let held = Held::<L>::taking(true);
        match self.inner.lock() {
            Ok(inner) => Ok(MutexGuard { inner, held }),
            Err(e) => Err(PoisonError::new(MutexGuard { inner: e.into_inner(), held })),
        }
    }

    /// Takes the lock if it is free (never blocks, so in any order).
    pub fn try_lock(&self) -> TryLockResult<MutexGuard<'_, L, T>> {
        match self.inner.try_lock() {
            Ok(inner) => Ok(MutexGuard { inner, held: Held::taking(false) }),
            Err(TryLockError::WouldBlock) => Err(TryLockError::WouldBlock),
            Err(TryLockError::Poisoned(e)) => Err(TryLockError::Poisoned(PoisonError::new(MutexGuard {
                inner: e.into_inner(),
                held: Held::taking(false),
            }))),
        }
    }

    pub fn get_mut(&mut self) -> LockResult<&mut T> {
        self.inner.get_mut()
    }
}

impl<L: Level, T: Default> Default for Mutex<L, T> {
    fn default() -> Self {
        Mutex::new(T::default())
    }
}

impl<L: Level, T: ?Sized + std::fmt::Debug> std::fmt::Debug for Mutex<L, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mutex").field("level", &L::NAME).field("inner", &&self.inner).finish()
    }
}

/// A held lock: std's guard, and this thread's record that it holds the level.
pub struct MutexGuard<'a, L: Level, T: ?Sized> {
    inner: std::sync::MutexGuard<'a, T>,
    held: Held<L>,
}

impl<L: Level, T: ?Sized> Deref for MutexGuard<'_, L, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<L: Level, T: ?Sized> DerefMut for MutexGuard<'_, L, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

/// A condition variable for `Mutex`es with levels.
#[derive(Default, Debug)]
pub struct Condvar(std::sync::Condvar);

impl Condvar {
    pub const fn new() -> Condvar {
        Condvar(std::sync::Condvar::new())
    }

    pub fn notify_all(&self) {
        self.0.notify_all()
    }

    pub fn notify_one(&self) {
        self.0.notify_one()
    }

    pub fn wait<'a, L: Level, T>(&self, guard: MutexGuard<'a, L, T>) -> LockResult<MutexGuard<'a, L, T>> {
        let MutexGuard { inner, held } = guard;
        match self.0.wait(inner) {
            Ok(inner) => Ok(MutexGuard { inner, held }),
            Err(e) => Err(PoisonError::new(MutexGuard { inner: e.into_inner(), held })),
        }
    }

    pub fn wait_timeout<'a, L: Level, T>(
        &self,
        guard: MutexGuard<'a, L, T>,
        dur: Duration,
    ) -> LockResult<(MutexGuard<'a, L, T>, std::sync::WaitTimeoutResult)> {
        let MutexGuard { inner, held } = guard;
        match self.0.wait_timeout(inner, dur) {
            Ok((inner, t)) => Ok((MutexGuard { inner, held }, t)),
            Err(e) => {
                let (inner, t) = e.into_inner();
                Err(PoisonError::new((MutexGuard { inner, held }, t)))
            }
        }
    }

    pub fn wait_timeout_while<'a, L: Level, T, F: FnMut(&mut T) -> bool>(
        &self,
        guard: MutexGuard<'a, L, T>,
        dur: Duration,
        condition: F,
    ) -> LockResult<(MutexGuard<'a, L, T>, std::sync::WaitTimeoutResult)> {
        let MutexGuard { inner, held } = guard;
        match self.0.wait_timeout_while(inner, dur, condition) {
            Ok((inner, t)) => Ok((MutexGuard { inner, held }, t)),
            Err(e) => {
                let (inner, t) = e.into_inner();
                Err(PoisonError::new((MutexGuard { inner, held }, t)))
            }
        }
    }
}

/// This thread's record that it holds a lock of level `L`, for as long as
/// the guard lives.
struct Held<L: Level>(PhantomData<fn() -> L>);

#[cfg(any(debug_assertions, feature = "lock-levels"))]
mod checked {
    use super::Level;
    use std::cell::RefCell;
    use std::collections::HashSet;
    use std::io::Write;
    use std::sync::OnceLock;

    thread_local! {
        /// The levels this thread holds, in the order it took them.
        static HELD: RefCell<Vec<(u16, &'static str)>> = const { RefCell::new(Vec::new()) };
    }

    /// Records that this thread takes `L`; with `check`, first that no lock
    /// it holds comes at or after `L`.
    pub fn taking<L: Level>(check: bool) {
        let above = HELD.try_with(|held| {
            let held = held.borrow();
            held.iter().filter(|(rank, _)| *rank >= L::RANK).max_by_key(|(rank, _)| *rank).copied()
        });
        if let (true, Ok(Some((_, name)))) = (check, above) {
            inverted(L::NAME, name);
        }
        let _ = HELD.try_with(|held| held.borrow_mut().push((L::RANK, L::NAME)));
    }

    /// Records that this thread let go of one lock of level `L`.
    pub fn released<L: Level>() {
        let _ = HELD.try_with(|held| {
            let mut held = held.borrow_mut();
            if let Some(i) = held.iter().rposition(|(rank, _)| *rank == L::RANK) {
                held.remove(i);
            }
        });
    }

    fn inverted(taking: &'static str, holding: &'static str) {
        let what = format!("lock order: {taking} taken while {holding} is held (src/locks.rs lists the order)");
        static LOG: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
        let Some(path) = LOG.get_or_init(|| std::env::var_os("RUSTC10D_LOCK_ORDER_LOG").map(Into::into)) else {
            panic!("{what}");
        };
        static SEEN: std::sync::Mutex<Option<HashSet<(&str, &str)>>> = std::sync::Mutex::new(None);
        if !SEEN.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashSet::new).insert((taking, holding)) {
            return;
        }
        let trace = std::backtrace::Backtrace::force_capture();
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = writeln!(f, "{what}\n{trace}\n");
        }
    }
}

impl<L: Level> Held<L> {
    #[allow(unused_variables)]
    fn taking(check: bool) -> Held<L> {
        #[cfg(any(debug_assertions, feature = "lock-levels"))]
        checked::taking::<L>(check);
        if L::IO {
            let _ = IO_HELD.try_with(|n| n.set(n.get() + 1));
        }
        Held(PhantomData)
    }
}

impl<L: Level> Drop for Held<L> {
    fn drop(&mut self) {
        #[cfg(any(debug_assertions, feature = "lock-levels"))]
        checked::released::<L>();
        // After std's guard, a field before this one: the lock is free.
        if L::IO && IO_HELD.try_with(|n| n.replace(n.get() - 1) == 1).unwrap_or(false) {
            run_deferred();
        }
    }
}

thread_local! {
    /// How many I/O locks this thread holds.
    static IO_HELD: Cell<u32> = const { Cell::new(0) };
    /// What waits for this thread to let go of them.
    static DEFERRED: RefCell<Vec<Box<dyn FnOnce()>>> = const { RefCell::new(Vec::new()) };
}

/// Whether this thread holds an I/O lock now (`when_unlocked` would wait).
pub fn holding_io() -> bool {
    IO_HELD.try_with(|n| n.get() > 0).unwrap_or(false)
}

/// Runs `f` now, or, where this thread holds an I/O lock, as soon as it lets
/// go of the last one. For completing an op: that runs torch's callbacks,
/// the user's code, which may issue the next op on the same peer and so want
/// the mailbox or the connection that the transport completed it under (a
/// deadlock of the I/O thread, found by a test whose receive's callback
/// posted the next receive). `f` must not panic (completions contain theirs).
pub fn when_unlocked(f: Box<dyn FnOnce()>) {
    match holding_io() {
        true => DEFERRED.with(|d| d.borrow_mut().push(f)),
        false => f(),
    }
}

/// Everything deferred on this thread, in the order it was deferred; what
/// those add (an op completed under a lock taken meanwhile) runs too.
fn run_deferred() {
    loop {
        let batch = DEFERRED.try_with(|d| std::mem::take(&mut *d.borrow_mut())).unwrap_or_default();
        if batch.is_empty() {
            return;
        }
        batch.into_iter().for_each(|f| f());
    }
}

#[cfg(test)]
mod tests {
    use super::{level, when_unlocked, Condvar, Mutex};
    use std::time::Duration;

    #[test]
    fn locks_taken_in_order_are_allowed_and_released_in_any_order() {
        let outer = Mutex::<level::EngineQueue, u32>::new(1);
        let inner = Mutex::<level::Mailbox, u32>::new(2);
        let a = outer.lock().unwrap();
        let b = inner.lock().unwrap();
        drop(a);
        // The outer one is free again: taking it under `inner` would be an
        // inversion, but taking `inner`'s level again after letting go is not.
        drop(b);
        let _b = inner.lock().unwrap();
    }

    #[test]
    #[should_panic(expected = "lock order: EngineQueue taken while Mailbox is held")]
    fn a_lock_taken_under_a_later_one_panics_before_blocking() {
        let outer = Mutex::<level::EngineQueue, u32>::new(1);
        let inner = Mutex::<level::Mailbox, u32>::new(2);
        let _b = inner.lock().unwrap();
        let _a = outer.lock().unwrap();
    }

    #[test]
    #[should_panic(expected = "lock order: Mailbox taken while Mailbox is held")]
    fn two_locks_of_one_level_are_not_held_at_once() {
        let (one, two) = (Mutex::<level::Mailbox, u32>::new(1), Mutex::<level::Mailbox, u32>::new(2));
        let _a = one.lock().unwrap();
        let _b = two.lock().unwrap();
    }

    #[test]
    fn try_lock_is_not_checked_but_what_it_holds_counts() {
        let outer = Mutex::<level::EngineQueue, u32>::new(1);
        let inner = Mutex::<level::Mailbox, u32>::new(2);
        {
            let _b = inner.lock().unwrap();
            drop(outer.try_lock().unwrap());
        }
        let _b = inner.try_lock().unwrap();
        let taken = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(outer.lock())));
        assert!(taken.is_err(), "a lock taken under one held by try_lock is checked");
    }

    #[test]
    fn work_deferred_under_io_locks_runs_when_the_last_is_let_go() {
        use std::cell::RefCell;
        use std::rc::Rc;
        let ran = Rc::new(RefCell::new(Vec::new()));
        let note = |n: u32| {
            let ran = ran.clone();
            Box::new(move || ran.borrow_mut().push(n)) as Box<dyn FnOnce()>
        };
        let (outer, io, inner) = (
            Mutex::<level::EngineQueue, ()>::new(()),
            Mutex::<level::Mailbox, ()>::new(()),
            Mutex::<level::AnyPosted, ()>::new(()),
        );
        let q = outer.lock().unwrap();
        when_unlocked(note(1));
        assert_eq!(*ran.borrow(), [1], "no I/O lock held: at once");
        let m = io.lock().unwrap();
        when_unlocked(note(2));
        let a = inner.lock().unwrap();
        when_unlocked(note(3));
        drop(a);
        assert_eq!(*ran.borrow(), [1], "the mailbox is still held");
        drop(m);
        assert_eq!(*ran.borrow(), [1, 2, 3], "in order, once the last I/O lock is let go");
        drop(q);
    }

    #[test]
    fn a_condvar_wait_keeps_the_level() {
        let m = Mutex::<level::StatusState, bool>::new(false);
        let cv = Condvar::new();
        let g = m.lock().unwrap();
        let (g, timed_out) = cv.wait_timeout(g, Duration::from_millis(1)).unwrap();
        assert!(timed_out.timed_out() && !*g);
        drop(g);
        let _again = m.lock().unwrap();
    }
}
