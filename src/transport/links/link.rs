//! One connection of the mesh with a peer: its reading and its queue of
//! frames to write, driven by the reactor when the connection is ready, and
//! by waiting threads that poll it (a thread waiting for a message reads it
//! itself rather than waiting for a hand-off). What happens to the peer when
//! the connection ends is the peer state machine's business (peer.rs),
//! through `Core::peer_event`.

use crate::error::{Error, Result};
use crate::locks::{level, Mutex, MutexGuard};
use crate::transport::links::conn::{Conn, Watch};
use crate::transport::links::frame::{FrameHeader, Key, HEADER_LEN};
use crate::transport::links::mesh_core::Core;
use crate::transport::links::peer::{ConnId, Event};
use crate::transport::links::reactor::{Reactor, Source, Spinner, Token, READABLE, WRITABLE};
use crate::transport::links::reader::{Reader, Stop};
use crate::transport::links::readers::{Next, Readers};
use crate::transport::links::striping::Striping;
use crate::transport::links::writer::{finish_written, Flushed, Outbox, SendReq};
use std::io::{self, IoSlice};
use std::os::fd::RawFd;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, TryLockError, Weak};
use std::time::{Duration, Instant};

pub struct Link {
    pub id: ConnId,
    pub peer: usize,
    pub conn: Conn,
    reader: Mutex<level::LinkReader, Reader>,
    outbox: Mutex<level::LinkOutbox, Outbox>,
    /// The descriptors registered with the reactor, and their tokens.
    watched: Mutex<level::LinkWatched, Vec<(Token, RawFd, Watch)>>,
    /// What the data descriptor is watched for; changed only under this
    /// lock (room: under the outbox lock too, so that it follows the flush
    /// that decided it).
    interest: Mutex<level::LinkInterest, Interest>,
    /// `Interest::paused`, readable without the lock; written only under it.
    paused: AtomicBool,
    /// Threads polling it while they wait, and (shared memory) the reactor
    /// polling it for a while after it was busy (`spin`): meanwhile the peer
    /// need not wake the reactor, since they read what arrives.
    readers: Readers,
    spin: Duration,
    ended: AtomicBool,
    /// The sends that went as their address have been finished up to this number.
    acked: AtomicU64,
    /// Why it was closed: sends queued after that fail with it at once.
    closed: Mutex<level::LinkClosed, Option<Error>>,
    core: Weak<Core>,
    reactor: Arc<Reactor>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Interest {
    /// Reading is paused: a large message waits for its receive. Kept with
    /// the rest of the interest, under one lock, so that a pause and a
    /// resume racing each other cannot leave the link unpaused but unwatched.
    paused: bool,
    /// TCP: threads poll the socket, so the reactor need not wake for it.
    polled: bool,
    /// TCP only: shared memory waits for room through the ring and eventfd.
    room: bool,
}

impl Interest {
    /// With `shm`, the eventfd also says the peer made room or read a message
    /// sent as our address, so it stays watched while reading is paused.
    fn events(self, shm: bool) -> u32 {
        let readable = !self.polled && (!self.paused || shm);
        (if readable { READABLE } else { 0 }) | if self.room { WRITABLE } else { 0 }
    }
}

/// A shared-memory link the reactor polls for a while (see `Link::spin`).
struct Spinning(Arc<Link>);

impl Spinner for Spinning {
    fn spin(&self) -> bool {
        let link = &self.0;
        if link.paused.load(Ordering::Acquire) || link.ended.load(Ordering::Acquire) {
            return false;
        }
        match link.reader.try_lock() {
            Ok(reader) => link.read_with(reader, false),
            Err(_) => true, // somebody else is reading: it is busy
        }
    }

    fn spun(&self) {
        self.0.hand_over(self.0.readers.spun());
    }

    fn contain(&self, why: &Error) {
        self.0.broke(why);
    }
}

/// Registered per descriptor: which one of the link's it is.
struct Watcher(Arc<Link>, Watch);

impl Source for Watcher {
    fn ready(&self, events: u32) {
        let link = &self.0;
        match self.1 {
            Watch::Data => {
                link.conn.woke();
                link.settle();
                let readable =
                    events & (libc::EPOLLIN | libc::EPOLLHUP | libc::EPOLLERR | libc::EPOLLRDHUP) as u32 != 0;
                if readable && !link.is_paused() {
                    link.read();
                }
                link.write();
            }
            Watch::Liveness => {
                // Nothing is sent on it after the handshake: any event is the end.
                link.conn.peer_gone();
            }
        }
    }

    fn contain(&self, why: &Error) {
        self.0.broke(why);
    }
}

impl Link {
    pub fn new(core: &Arc<Core>, id: ConnId, peer: usize, conn: Conn) -> Arc<Link> {
        Arc::new(Link {
            id,
            peer,
            conn,
            reader: Mutex::default(),
            outbox: Mutex::default(),
            watched: Mutex::default(),
            interest: Mutex::new(Interest { paused: false, polled: false, room: false }),
            paused: AtomicBool::new(false),
            readers: Readers::default(),
            spin: core.spin,
            ended: AtomicBool::new(false),
            acked: AtomicU64::new(0),
            closed: Mutex::new(None),
            core: Arc::downgrade(core),
            reactor: core.reactor.clone(),
        })
    }

    /// Code serving this link panicked: its state cannot be trusted, so the
    /// group gives up on the peer (the ops waiting for it fail with `why`).
    fn broke(&self, why: &Error) {
        if let Some(core) = self.core.upgrade() {
            core.give_up(self.peer, why);
        }
    }

    /// Register with the reactor and read what is there.
    pub fn start(self: &Arc<Self>) -> Result<()> {
        // Sends may have queued already: watch for what they need.
        let interest = self.interest.lock().unwrap();
        for (fd, watch) in self.conn.watched() {
            let events = if watch == Watch::Data { interest.events(self.conn.is_shm()) } else { READABLE };
            let token = self.reactor.register(fd, events, Arc::new(Watcher(self.clone(), watch)))?;
            self.watched.lock().unwrap().push((token, fd, watch));
        }
        drop(interest);
        let l = self.clone();
        self.reactor.defer(Box::new(move || l.read()));
        Ok(())
    }

    /// Queue a frame and write what the connection takes now.
    pub fn send(self: &Arc<Self>, req: SendReq) {
        // Before it is queued, so that its writing is reported after this.
        self.measure(|striping, unsent| striping.queued(req.len(), Instant::now(), unsent));
        {
            let mut outbox = self.outbox.lock().unwrap();
            if let Some(why) = self.closed.lock().unwrap().clone() {
                drop(outbox);
                req.status.finish(Err(why));
                return;
            }
            outbox.push(req);
        }
        self.write();
    }

    /// Tell the peer's striping (TCP only) about a send.
    fn measure(&self, report: impl FnOnce(&mut Striping, &dyn Fn() -> u64)) {
        if self.conn.is_shm() {
            return;
        }
        if let Some(core) = self.core.upgrade() {
            let slot = &core.peers[self.peer];
            report(&mut slot.state.lock().unwrap().striping, &|| slot.unsent());
        }
    }

    /// A thread starts polling (see `readers`): the peer need not wake the reactor.
    pub fn poll_begin(&self) {
        if self.readers.poll_begin() {
            match self.conn {
                Conn::Shm(_) => self.conn.reader_polled(),
                Conn::Tcp(_) => self.set_interest(|i| i.polled = true),
            }
        }
    }

    /// A thread stops polling: the reactor waits for the peer again, unless
    /// something arrived meanwhile, which it then reads.
    pub fn poll_end(self: &Arc<Self>) {
        match (self.readers.poll_end(self.spins()), &self.conn) {
            (Next::Nothing, _) => {}
            // Level-triggered: what arrived meanwhile wakes the reactor at once.
            (_, Conn::Tcp(_)) => self.set_interest(|i| i.polled = false),
            (next, Conn::Shm(_)) => self.hand_over(next),
        }
    }

    /// Whether the reactor polls the link for a while once nobody else reads
    /// it (shared memory, with a spin set): a busy link's next message is near.
    fn spins(&self) -> bool {
        self.conn.is_shm() && self.spin > Duration::ZERO
    }

    /// Shared memory, nobody else reads it now: spin, or wait to be woken
    /// (unless something came meanwhile: then read it).
    fn hand_over(self: &Arc<Self>, next: Next) {
        match next {
            Next::Nothing => {}
            Next::Spin => self.reactor.spin(Arc::new(Spinning(self.clone())), self.spin),
            Next::Wait if self.conn.reader_waits() => {}
            Next::Wait => {
                let l = self.clone();
                self.reactor.defer(Box::new(move || l.read()));
            }
        }
    }

    /// Read what has arrived, if no other thread is reading (a waiter polls).
    pub fn poll(self: &Arc<Self>) {
        self.settle();
        if !self.paused.load(Ordering::Acquire) {
            if let Ok(reader) = self.reader.try_lock() {
                self.read_with(reader, false);
            }
        }
    }

    /// Read until the connection has nothing more; wait for the reactor then.
    fn read(self: &Arc<Self>) {
        if self.ended.load(Ordering::Acquire) {
            return;
        }
        let reader = self.reader.lock().unwrap();
        self.read_with(reader, true);
    }

    /// Whether anything was read.
    fn read_with(self: &Arc<Self>, mut reader: MutexGuard<'_, level::LinkReader, Reader>, arm: bool) -> bool {
        let Some(core) = self.core.upgrade() else { return false };
        let slot = &core.peers[self.peer];
        let before = reader.reads;
        let stop = reader.pump(&self.conn, self.peer, &slot.mailbox, &core.any);
        let progressed = reader.reads != before;
        let asked = std::mem::take(&mut reader.asked);
        drop(reader);
        // Closed while this thread read: `close` may have found the reader
        // busy. The fence pairs with `close`'s: either this sees the link
        // ended, or `close` finds the reader let go.
        fence(Ordering::SeqCst);
        if self.ended.load(Ordering::Acquire) {
            self.abandon_reading();
        }
        for depth in asked {
            core.answer(self.peer, depth);
        }
        self.settle();
        match stop {
            // Shared memory: a polling thread reads what comes; else the
            // reactor polls for a while, then waits to be woken.
            Ok(Stop::Drained) if arm && self.conn.is_shm() => self.hand_over(self.readers.drained(self.spins())),
            Ok(Stop::Drained) => {}
            Ok(Stop::Early(left)) => self.pause(left),
            Ok(Stop::Reason(why)) => {
                let why = Error::peer_lost(format!("{} {}", core.describe(self.peer), why.message));
                core.peer_event(self.peer, Event::Reason { conn: self.id, why });
                self.end();
            }
            Ok(Stop::End) => {
                self.end();
                core.peer_event(self.peer, Event::Ended { conn: self.id, error: None });
            }
            Err(e) => {
                self.end();
                let error = Error::peer_lost(format!("lost connection to {}: {e}", core.describe(self.peer)));
                core.peer_event(self.peer, Event::Ended { conn: self.id, error: Some(error) });
            }
        }
        progressed
    }

    /// Finish the sends that went as their address and that the peer has read.
    fn settle(&self) {
        let acked = self.conn.acked();
        if acked > self.acked.load(Ordering::Acquire) {
            let done = {
                let mut outbox = self.outbox.lock().unwrap();
                self.acked.fetch_max(acked, Ordering::AcqRel);
                outbox.acked(acked)
            };
            finish_written(done);
        }
    }

    /// Stop reading until a receive is posted (`resume`) or `left` passes.
    fn pause(self: &Arc<Self>, left: Duration) {
        self.set_interest(|i| i.paused = true);
        let l = self.clone();
        self.reactor.after(left, Box::new(move || l.resume()));
    }

    /// Go on reading after a pause (a receive was posted, or the grace is over).
    pub fn resume(self: &Arc<Self>) {
        // Unpaused, as nearly always: no lock. (A pause that comes just after is
        // lifted by its own timer, as is one decided before a receive was posted.)
        if self.paused.load(Ordering::Acquire) && self.set_interest(|i| std::mem::replace(&mut i.paused, false)) {
            self.read();
        }
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Acquire)
    }

    /// Write what the connection takes; wait for room, or run a send's ready first.
    pub fn write(self: &Arc<Self>) {
        let mut done = Vec::new();
        let flushed = {
            let mut outbox = self.outbox.lock().unwrap();
            let flushed = loop {
                match outbox.flush(&self.conn, &mut done) {
                    Flushed::Full if !self.conn.writer_waits() => continue,
                    f => break f,
                }
            };
            // Under the outbox lock: another flush cannot slip in between
            // this one's result and the interest it sets.
            let full = matches!(flushed, Flushed::Full);
            if matches!(self.conn, Conn::Tcp(_)) {
                self.set_interest(|i| i.room = full);
            }
            flushed
        };
        if !done.is_empty() {
            let now = Instant::now();
            self.measure(|striping, unsent| done.iter().for_each(|r| striping.written(r.len(), now, unsent)));
        }
        finish_written(done);
        match flushed {
            Flushed::All | Flushed::Waiting | Flushed::Full => {}
            Flushed::Ready(ready) => {
                let l = self.clone();
                let run = move || {
                    let result = ready();
                    let reactor = l.reactor.clone();
                    reactor.defer(Box::new(move || l.readied(result)));
                };
                if let Err(e) = self.reactor.run_blocking(Box::new(run)) {
                    self.readied(Err(e));
                }
            }
            Flushed::Failed(e) => {
                if let Some(core) = self.core.upgrade() {
                    core.peer_event(self.peer, Event::WriteFailed { conn: self.id, error: Error::io(e.to_string()) });
                }
            }
        }
    }

    fn readied(self: &Arc<Self>, result: Result<()>) {
        let failed = self.outbox.lock().unwrap().readied(result);
        if let Some((req, e)) = failed {
            req.status.finish(Err(e));
        }
        self.write();
    }

    /// Change the interest, and what the reactor watches with it; returns what `change` does.
    fn set_interest<T>(&self, change: impl FnOnce(&mut Interest) -> T) -> T {
        let mut interest = self.interest.lock().unwrap();
        let before = *interest;
        let out = change(&mut interest);
        self.paused.store(interest.paused, Ordering::Release);
        if *interest != before {
            for &(token, fd, watch) in self.watched.lock().unwrap().iter() {
                if watch == Watch::Data {
                    self.reactor.modify(token, fd, interest.events(self.conn.is_shm()));
                }
            }
        }
        out
    }

    /// Tell the peer why this rank gives up: written between frames, within
    /// `grace` (a frame half written is finished first, if it can be).
    pub fn tell(&self, why: &[u8], grace: Duration) {
        let deadline = Instant::now() + grace;
        let mut outbox = self.outbox.lock().unwrap();
        let mut done = Vec::new();
        while outbox.mid_frame(&self.conn) && Instant::now() < deadline {
            if let Flushed::Failed(_) = outbox.flush(&self.conn, &mut done) {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if outbox.mid_frame(&self.conn) {
            return;
        }
        let header = FrameHeader { key: Key::abort(), len: why.len() as u64, remote: false }.encode();
        let (mut written, total) = (0, HEADER_LEN + why.len());
        while written < total && Instant::now() < deadline {
            let r = if written < HEADER_LEN {
                self.conn.write(&[IoSlice::new(&header[written..]), IoSlice::new(why)])
            } else {
                self.conn.write(&[IoSlice::new(&why[written - HEADER_LEN..])])
            };
            match r {
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
                Err(_) => return,
            }
        }
    }

    /// Close the connection and stop watching it; queued and later sends
    /// fail with `why`, and so does the receive being read, if any.
    pub fn close(&self, why: &Error) {
        let queued = {
            let mut outbox = self.outbox.lock().unwrap();
            self.closed.lock().unwrap().get_or_insert_with(|| why.clone());
            outbox.take_all()
        };
        self.end();
        // Pairs with the fence in `read_with` (see there). Before the
        // shutdown, which a reader would take for the peer's end and fail
        // the receive with that instead of `why`.
        fence(Ordering::SeqCst);
        self.abandon_reading();
        // Before the sends finish: a shared-memory peer reading one from
        // this process's memory learns first that it may be freed (conn.rs).
        self.conn.shutdown();
        for req in queued {
            req.status.finish(Err(why.clone()));
        }
    }

    /// The link is read no more: fail the receive its reader was filling (a
    /// peer that stalled within a message, or announced more than it sent),
    /// which nothing else would finish, so that the op waiting for it ends.
    /// A thread reading now does it once it has let go of the reader (see
    /// `read_with`): this one must not wait for the reader, which it may be
    /// holding itself (a receive's completion can close the link it came on).
    fn abandon_reading(&self) {
        let mut reader = match self.reader.try_lock() {
            Ok(reader) => reader,
            // A panic while reading: what it left must still be failed.
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        let why = self.closed.lock().unwrap().clone();
        reader.abandon(&why.unwrap_or_else(|| Error::peer_lost("the connection was closed")));
    }

    fn end(&self) {
        if self.ended.swap(true, Ordering::AcqRel) {
            return;
        }
        for (token, fd, _) in self.watched.lock().unwrap().drain(..) {
            self.reactor.deregister(token, fd);
        }
    }
}
