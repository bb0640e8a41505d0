//! `Mesh`: one connection (occasionally two) per peer, opened lazily when a
//! rank first sends to it: shared memory to a peer on this host, TCP to the
//! others. Each connection has a reader thread that fills posted buffers
//! straight from it; the connection a rank sends on has a writer thread, so
//! queued sends never block the caller.

use super::conn::Conn;
use super::frame::{FrameHeader, Hello, Key, ABORT_MAX, HEADER_LEN, HELLO_LEN, KIND_ABORT, KIND_P2P};
use super::mailbox::{fail_mismatch, u64_bytes, AnyPosted, Delivery, Fold, Mailbox, PostedRecv, RecvBuf};
use super::shm::{self, Segment, ShmConn};
use super::{Ready, Transport};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::status::Status;
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Upper bound on one handshake, so a silent client cannot pin a thread.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most memory reserved ahead for one message that arrives before its receive.
const EARLY_RESERVE_MAX: u64 = 64 << 20;

/// Handshakes in progress at once; connections beyond are closed at once, so
/// a flood of connections cannot exhaust threads.
const MAX_HANDSHAKES: usize = 64;

pub struct Mesh {
    inner: Arc<Inner>,
}

/// Where a peer listens.
#[derive(Debug, Clone)]
pub struct PeerAddr {
    pub tcp: SocketAddr,
    /// The abstract Unix socket name to reach it through shared memory, for
    /// a peer on this host; None: over TCP.
    pub shm: Option<String>,
}

/// This rank's end for shared-memory peers: a Unix socket in the abstract
/// namespace (nothing on disk), where peers hand over their segments.
pub struct ShmEndpoint {
    pub listener: UnixListener,
    pub ring_bytes: usize,
}

impl ShmEndpoint {
    /// Listen under a fresh random name; the name goes to peers via the Store.
    /// The segments this rank creates have rings of `ring_bytes`.
    pub fn bind(ring_bytes: usize) -> Result<(ShmEndpoint, String)> {
        let mut r = [0u8; 16];
        if unsafe { libc::getrandom(r.as_mut_ptr().cast(), r.len(), 0) } != r.len() as isize {
            return Err(Error::io("rustc10d: getrandom failed"));
        }
        let name = format!("rustc10d-{}", r.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io(e.to_string()))?;
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| Error::io(format!("rustc10d: cannot listen on a Unix socket: {e}")))?;
        Ok((ShmEndpoint { listener, ring_bytes }, name))
    }
}

struct Inner {
    me: Hello,
    addrs: Vec<PeerAddr>,
    peers: Vec<Peer>,
    /// Receives posted for any peer (recv with src=None).
    any: Mutex<AnyPosted>,
    listener: TcpListener,
    local: Option<ShmEndpoint>,
    stopping: AtomicBool,
    handshakes: AtomicUsize,
    /// Why this rank gave up on the group (an abort frame), once it has.
    gave_up: Mutex<Option<Vec<u8>>>,
    /// Connections this rank opens to each peer it sends to (Config::nsocks).
    nsocks: usize,
    /// How long a shared-memory wait polls before it sleeps.
    spin: Duration,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

struct Peer {
    mailbox: Mutex<Mailbox>,
    /// Notified when a receive is posted (for this peer or any peer).
    posted: Condvar,
    link: Mutex<Link>,
    linked: Condvar,
}

/// A large message that arrives before its receive waits this long for it
/// before it is read into memory: the copy out of memory later costs as much
/// as the transfer, and the receive is usually posted within microseconds
/// (a ping-pong's echo). Frames behind it on the connection wait too, so the
/// grace is short: programs that post receives out of order still progress.
const EARLY_GRACE: Duration = Duration::from_millis(20);
const EARLY_GRACE_MIN_BYTES: u64 = 256 * 1024;
/// How long a failed write waits for the reader to learn why the peer left.
const WHY_GRACE: Duration = Duration::from_millis(50);

/// Frames up to this size are written on the caller's thread when nothing is
/// queued: a thread hand-off costs more than the write.
const INLINE_SEND_MAX: usize = 64 * 1024;

/// The connection this rank sends on: a queue to its writer thread, and the
/// socket itself for inline writes.
#[derive(Clone)]
struct Outbox {
    queue: Sender<SendReq>,
    half: Arc<WriteHalf>,
}

struct WriteHalf {
    /// Held while one frame is written, so frames never interleave.
    stream: Mutex<Conn>,
    /// Frames queued for the writer thread and not yet written: while any
    /// are, inline writes would overtake them, so they queue too.
    queued: AtomicUsize,
}

#[derive(Default)]
struct Link {
    /// The connections this rank sends on (RUSTC10D_NSOCKS of them at most).
    /// Point-to-point frames always take the first, so they stay in order;
    /// collective frames, whose keys are unique, are spread over all.
    lanes: Vec<Outbox>,
    /// Every connection with the peer, kept to shut them down.
    streams: Vec<Conn>,
    /// Those we do not send on (both ranks dialled at once). A reason to give
    /// up goes on them too: the peer may read only these so far.
    unused: Vec<Conn>,
    /// Connections whose reader is still running.
    readers: usize,
    /// Why the peer gave up, once it said so on one of them.
    why: Option<Error>,
    lost: Option<Error>,
}

struct SendReq {
    header: [u8; HEADER_LEN],
    data: *const u8,
    len: usize,
    status: Arc<Status>,
    ready: Option<Ready>,
}
// The sender keeps `data` alive until `status` finishes (Transport::send's contract).
unsafe impl Send for SendReq {}

impl Mesh {
    /// Start accepting on `listener`, connect to `eager` peers and wait until
    /// each of `expect` has connected to us, all before `deadline`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        listener: TcpListener,
        local: Option<ShmEndpoint>,
        me: Hello,
        addrs: Vec<PeerAddr>,
        cfg: &Config,
        eager: &[usize],
        expect: &[usize],
        deadline: Instant,
    ) -> Result<Mesh> {
        let peers = (0..addrs.len())
            .map(|p| Peer {
                mailbox: Mutex::new(Mailbox::new(p)),
                posted: Condvar::new(),
                link: Mutex::default(),
                linked: Condvar::new(),
            })
            .collect();
        let inner = Arc::new(Inner {
            me,
            addrs,
            peers,
            any: Mutex::default(),
            listener,
            local,
            stopping: AtomicBool::new(false),
            handshakes: AtomicUsize::new(0),
            gave_up: Mutex::new(None),
            nsocks: cfg.nsocks,
            spin: cfg.spin,
            threads: Mutex::new(Vec::new()),
        });
        let acceptor = inner.clone();
        inner.spawn("rustc10d-accept", move || acceptor.accept_loop());
        if inner.local.is_some() {
            let acceptor = inner.clone();
            inner.spawn("rustc10d-accept-shm", move || acceptor.accept_shm_loop());
        }
        let mesh = Mesh { inner };
        for &p in eager {
            mesh.inner.sender(p, 0, deadline)?;
        }
        for &p in expect {
            mesh.inner.wait_linked(p, deadline)?;
        }
        Ok(mesh)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.inner.listener.local_addr().expect("bound listener")
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}

impl Transport for Mesh {
    fn rank(&self) -> usize {
        self.inner.me.rank as usize
    }

    fn size(&self) -> usize {
        self.inner.me.size as usize
    }

    fn describe_peer(&self, peer: usize) -> String {
        self.inner.describe(peer)
    }

    /// A small frame is written at once from the calling thread when nothing
    /// is queued before it; anything else, and any send with `ready`, goes
    /// through the lane's writer thread.
    unsafe fn send(
        &self,
        peer: usize,
        key: Key,
        data: *const u8,
        len: usize,
        status: Arc<Status>,
        deadline: Instant,
        ready: Option<Ready>,
    ) -> Result<()> {
        let lane = if key.kind == KIND_P2P { 0 } else { key.sub as usize };
        let out = self.inner.sender(peer, lane, deadline)?;
        let header = FrameHeader { key, len: len as u64 }.encode();
        if ready.is_none() && len <= INLINE_SEND_MAX && out.half.queued.load(Ordering::SeqCst) == 0 {
            if let Ok(mut stream) = out.half.stream.try_lock() {
                if out.half.queued.load(Ordering::SeqCst) == 0 {
                    let written = write_frame(&mut stream, &header, std::slice::from_raw_parts(data, len));
                    drop(stream);
                    self.inner.sent(peer, written, len, &status);
                    return Ok(());
                }
            }
        }
        out.half.queued.fetch_add(1, Ordering::SeqCst);
        if let Err(e) = out.queue.send(SendReq { header, data, len, status, ready }) {
            // The writer has exited: the peer was lost after we took its queue.
            out.half.queued.fetch_sub(1, Ordering::SeqCst);
            let err = self.inner.lost_error(peer);
            e.0.status.finish(Err(err));
        }
        Ok(())
    }

    unsafe fn recv(
        &self,
        peer: usize,
        key: Key,
        data: *mut u8,
        len: usize,
        fold: Option<Fold>,
        status: Arc<Status>,
    ) -> Result<()> {
        let recv = PostedRecv { buf: RecvBuf { ptr: data, len, fold }, status, any_source: false };
        let p = &self.inner.peers[peer];
        p.mailbox.lock().unwrap().post(key, recv);
        p.posted.notify_all();
        Ok(())
    }

    unsafe fn recv_any(&self, key: Key, data: *mut u8, len: usize, status: Arc<Status>) -> Result<()> {
        let inner = &self.inner;
        // Post first, then look for a message that came early: a reader that
        // gets one meanwhile finds the posted receive.
        inner.any.lock().unwrap().push(
            key,
            PostedRecv { buf: RecvBuf { ptr: data, len, fold: None }, status: status.clone(), any_source: true },
        );
        for peer in (0..inner.peers.len()).filter(|&p| p != inner.rank()) {
            if inner.peers[peer].mailbox.lock().unwrap().offer_early(key, &status, &inner.any) {
                break;
            }
        }
        for p in &inner.peers {
            p.posted.notify_all();
        }
        Ok(())
    }

    fn cancel_recv_any(&self, key: Key, status: &Arc<Status>) -> bool {
        self.inner.any.lock().unwrap().remove(key, status).is_some()
    }

    fn cancel_recv(&self, peer: usize, key: Key, status: &Arc<Status>) -> bool {
        self.inner.peers[peer].mailbox.lock().unwrap().cancel(key, status)
    }

    fn break_peer(&self, peer: usize, reason: &Error) {
        self.inner.lose_peer(peer, reason.clone());
    }

    fn abort_all(&self, reason: &Error) {
        let inner = &self.inner;
        let why = reason.message.as_bytes();
        let why = &why[..why.len().min(ABORT_MAX as usize)];
        inner.gave_up.lock().unwrap().get_or_insert_with(|| why.to_vec());
        let peers = || (0..inner.peers.len()).filter(|&p| p != inner.rank());
        // Write straight to each connection we send on: the queue may be stuck
        // behind the very transfer that failed.
        let grace = Instant::now() + Duration::from_millis(200);
        for peer in peers() {
            let (out, unused) = {
                let link = inner.peers[peer].link.lock().unwrap();
                (link.lanes.first().cloned(), link.unused.iter().filter_map(|c| c.try_clone().ok()).collect::<Vec<_>>())
            };
            for mut stream in unused {
                write_abort(&mut stream, why);
            }
            let Some(out) = out else { continue };
            loop {
                if let Ok(mut stream) = out.half.stream.try_lock() {
                    write_abort(&mut stream, why);
                    break;
                }
                if Instant::now() >= grace {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        for peer in peers() {
            inner.lose_peer(peer, reason.clone());
        }
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }

    fn link_kind(&self, peer: usize) -> Option<&'static str> {
        let link = self.inner.peers.get(peer)?.link.lock().unwrap();
        link.streams.first().map(|c| if c.is_shm() { "shm" } else { "tcp" })
    }
}

impl Inner {
    fn rank(&self) -> usize {
        self.me.rank as usize
    }

    fn describe(&self, peer: usize) -> String {
        let a = &self.addrs[peer];
        match a.shm {
            Some(_) => format!("rank {peer} ({}, shared memory)", a.tcp),
            None => format!("rank {peer} ({})", a.tcp),
        }
    }

    fn spawn(&self, name: &str, f: impl FnOnce() + Send + 'static) {
        let handle = std::thread::Builder::new().name(name.into()).spawn(f).expect("spawn thread");
        let mut threads = self.threads.lock().unwrap();
        threads.retain(|h| !h.is_finished());
        threads.push(handle);
    }

    fn lost_error(&self, peer: usize) -> Error {
        let link = self.peers[peer].link.lock().unwrap();
        link.lost.clone().unwrap_or_else(|| Error::peer_lost(format!("connection to {} closed", self.describe(peer))))
    }

    /// The connection to send to `peer` on (`lane` picks one of several),
    /// dialling the peer first if we have none.
    fn sender(self: &Arc<Self>, peer: usize, lane: usize, deadline: Instant) -> Result<Outbox> {
        if peer == self.rank() || peer >= self.peers.len() {
            return Err(Error::invalid(format!("rank {} cannot send to rank {peer}", self.rank())));
        }
        loop {
            {
                let link = self.peers[peer].link.lock().unwrap();
                if let Some(err) = &link.lost {
                    return Err(err.clone());
                }
                if !link.lanes.is_empty() {
                    return Ok(link.lanes[lane % link.lanes.len()].clone());
                }
            }
            if self.addrs[peer].shm.is_some() {
                let conn = self.dial_shm(peer, deadline)?;
                self.register(peer, conn);
                continue;
            }
            for _ in 0..self.nsocks {
                let stream = self.dial(peer, deadline)?;
                self.register(peer, Conn::Tcp(stream));
            }
        }
    }

    fn dial(&self, peer: usize, deadline: Instant) -> Result<TcpStream> {
        let addr = self.addrs[peer].tcp;
        let mut backoff = Duration::from_millis(20);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            let err = match TcpStream::connect_timeout(&addr, left.clamp(Duration::from_millis(1), HANDSHAKE_TIMEOUT)) {
                Ok(stream) => match stream
                    .set_nodelay(true)
                    .map_err(|e| Error::io(e.to_string()))
                    .and_then(|_| self.handshake(&stream, Some(peer), deadline))
                {
                    Ok(_) => return Ok(stream),
                    // A wrong peer at that address will not become right by retrying.
                    Err(e) => {
                        return Err(Error::io(format!(
                            "rustc10d: rank {} could not connect to {}: handshake failed: {}",
                            self.rank(),
                            self.describe(peer),
                            e.message
                        )))
                    }
                },
                Err(e) => e,
            };
            if self.stopping.load(Ordering::SeqCst) || Instant::now() + backoff >= deadline {
                return Err(Error::timeout(format!(
                    "rustc10d: rank {} could not connect to {} after {attempts} attempts: {err}",
                    self.rank(),
                    self.describe(peer)
                )));
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// Exchange hellos; on success the stream is ready for frames. The dialling
    /// side (`expected` is Some) speaks first; the accepting side answers only
    /// a hello that carries the group's token, so a stranger learns nothing.
    /// Leaves the stream's timeouts at `keep_timeout` (None: blocking).
    fn handshake<S: Timeouts>(&self, stream: &S, expected: Option<usize>, deadline: Instant) -> Result<usize>
    where
        for<'a> &'a S: Read + Write,
    {
        let io_err = |e: io::Error| Error::io(e.to_string());
        let limit =
            deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(10), HANDSHAKE_TIMEOUT);
        stream.timeouts(Some(limit)).map_err(io_err)?;
        let dialling = expected.is_some();
        let mut io = stream;
        if dialling {
            io.write_all(&self.me.encode()).map_err(io_err)?;
        }
        let mut buf = [0u8; HELLO_LEN];
        io.read_exact(&mut buf).map_err(io_err)?;
        let theirs = Hello::decode(&buf)?;
        theirs.verify(&self.me, expected.map(|r| r as u32))?;
        if !dialling {
            io.write_all(&self.me.encode()).map_err(io_err)?;
        }
        stream.timeouts(None).map_err(io_err)?;
        Ok(theirs.rank as usize)
    }

    /// Connect to a peer on this host and hand it a fresh segment: the token
    /// handshake first, so the segment only ever reaches a member of the group.
    fn dial_shm(&self, peer: usize, deadline: Instant) -> Result<Conn> {
        let (Some(local), Some(name)) = (&self.local, &self.addrs[peer].shm) else {
            return Err(Error::invalid("rustc10d: shared memory is not set up here"));
        };
        let fail = |what: String| {
            Error::io(format!(
                "rustc10d: rank {} could not connect to {} through shared memory: {what}",
                self.rank(),
                self.describe(peer)
            ))
        };
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| fail(e.to_string()))?;
        let sock = UnixStream::connect_addr(&addr).map_err(|e| fail(e.to_string()))?;
        self.handshake(&sock, Some(peer), deadline).map_err(|e| fail(format!("handshake failed: {}", e.message)))?;
        let (seg, fd) = Segment::create(local.ring_bytes).map_err(|e| fail(e.message))?;
        sock.timeouts(Some(HANDSHAKE_TIMEOUT)).map_err(|e| fail(e.to_string()))?;
        shm::send_fd(&sock, fd.as_raw_fd()).map_err(|e| fail(e.to_string()))?;
        // The peer answers once it has mapped the segment.
        let mut ack = [0u8; 1];
        (&sock).read_exact(&mut ack).map_err(|e| fail(format!("no answer after sending the segment: {e}")))?;
        sock.timeouts(None).map_err(|e| fail(e.to_string()))?;
        Ok(Conn::Shm(Arc::new(ShmConn::new(Arc::new(seg), true, sock, self.spin))))
    }

    /// The accepting side of `dial_shm`.
    fn accept_shm(&self, sock: &UnixStream) -> Result<(usize, Arc<Segment>)> {
        let peer = self.handshake(sock, None, Instant::now() + HANDSHAKE_TIMEOUT)?;
        sock.timeouts(Some(HANDSHAKE_TIMEOUT)).map_err(|e| Error::io(e.to_string()))?;
        let fd = shm::recv_fd(sock).map_err(|e| Error::io(format!("no segment from rank {peer}: {e}")))?;
        let seg = Segment::open(&fd)?;
        drop(fd); // the mapping keeps the memory; nothing names it any more
        (&*sock).write_all(&[1]).map_err(|e| Error::io(e.to_string()))?;
        sock.timeouts(None).map_err(|e| Error::io(e.to_string()))?;
        Ok((peer, Arc::new(seg)))
    }

    fn accept_loop(self: Arc<Self>) {
        self.accept_until_stopped(
            "",
            || self.listener.accept().map(|(s, _)| s),
            |stream| {
                let from = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                self.handshake_off_thread(from, move |me| {
                    stream.set_nodelay(true).map_err(|e| Error::io(e.to_string()))?;
                    let peer = me.handshake(&stream, None, Instant::now() + HANDSHAKE_TIMEOUT)?;
                    Ok((peer, Conn::Tcp(stream)))
                });
            },
        );
    }

    fn accept_shm_loop(self: Arc<Self>) {
        let Some(local) = &self.local else { return };
        self.accept_until_stopped(
            " on the shared-memory socket",
            || local.listener.accept().map(|(s, _)| s),
            |sock| {
                self.handshake_off_thread("a local process".into(), move |me| {
                    let (peer, seg) = me.accept_shm(&sock)?;
                    Ok((peer, Conn::Shm(Arc::new(ShmConn::new(seg, false, sock, me.spin)))))
                });
            },
        );
    }

    /// Hand each accepted connection to `on` until shutdown (which makes `accept` fail).
    fn accept_until_stopped<S>(&self, what: &str, accept: impl Fn() -> io::Result<S>, on: impl Fn(S)) {
        loop {
            let conn = match accept() {
                Ok(c) => c,
                Err(e) => {
                    if self.stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    tracing::warn!("rustc10d: accept{what} failed: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            on(conn);
        }
    }

    /// Run an accepted connection's handshake on its own thread, so a slow
    /// client cannot block others, and register it if it passes. Not joined
    /// at shutdown: it ends within HANDSHAKE_TIMEOUT.
    fn handshake_off_thread(
        self: &Arc<Self>,
        from: String,
        shake: impl FnOnce(&Arc<Self>) -> Result<(usize, Conn)> + Send + 'static,
    ) {
        if self.handshakes.fetch_add(1, Ordering::SeqCst) >= MAX_HANDSHAKES {
            self.handshakes.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(
                "rustc10d: rank {} dropped a connection from {from}: too many handshakes at once",
                self.rank()
            );
            return;
        }
        let me = self.clone();
        let _ = std::thread::Builder::new().name("rustc10d-hello".into()).spawn(move || {
            let shook = shake(&me);
            me.handshakes.fetch_sub(1, Ordering::SeqCst);
            match shook {
                Ok((peer, conn)) => me.register(peer, conn),
                Err(e) => {
                    tracing::warn!("rustc10d: rank {} dropped a connection from {from}: {}", me.rank(), e.message)
                }
            }
        });
    }

    /// Adopt a connection that passed the handshake: read from it, and send on
    /// it too while we have fewer than RUSTC10D_NSOCKS to that peer.
    fn register(self: &Arc<Self>, peer: usize, mut stream: Conn) {
        let (Ok(reader), Ok(keep)) = (stream.try_clone(), stream.try_clone()) else {
            return;
        };
        let p = &self.peers[peer];
        let mut link = p.link.lock().unwrap();
        if link.lost.is_some() || self.stopping.load(Ordering::SeqCst) {
            // A connection the peer dialled while we were giving up may be
            // the only one it reads yet: tell it why there too.
            let gave_up = self.gave_up.lock().unwrap().clone();
            if let Some(why) = gave_up {
                write_abort(&mut stream, &why);
            }
            stream.shutdown();
            return;
        }
        if let Conn::Shm(shm) = &stream {
            let shm = shm.clone();
            self.spawn("rustc10d-watch", move || shm.watch());
        }
        let lanes = if stream.is_shm() { 1 } else { self.nsocks };
        link.streams.push(keep);
        link.readers += 1;
        let me = self.clone();
        self.spawn("rustc10d-recv", move || me.read_loop(peer, reader));
        if link.lanes.len() >= lanes {
            if let Ok(unused) = stream.try_clone() {
                link.unused.push(unused);
            }
        } else {
            let (queue, rx) = channel();
            let half = Arc::new(WriteHalf { stream: Mutex::new(stream), queued: AtomicUsize::new(0) });
            link.lanes.push(Outbox { queue, half: half.clone() });
            let me = self.clone();
            self.spawn("rustc10d-send", move || me.write_loop(peer, half, rx));
        }
        p.linked.notify_all();
    }

    fn wait_linked(&self, peer: usize, deadline: Instant) -> Result<()> {
        let p = &self.peers[peer];
        let mut link = p.link.lock().unwrap();
        while link.streams.is_empty() {
            if let Some(e) = &link.lost {
                return Err(e.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(format!(
                    "rustc10d: Timed out: rank {} was waiting for {} to connect",
                    self.rank(),
                    self.describe(peer)
                )));
            }
            link = p.linked.wait_timeout(link, deadline - now).unwrap().0;
        }
        Ok(())
    }

    fn read_loop(&self, peer: usize, mut stream: Conn) {
        // u64s: folds view the bytes as any dtype, so they must be 8-byte aligned.
        let mut bounce: Vec<u64> = Vec::new();
        let failure = loop {
            match self.read_frame(peer, &mut stream, &mut bounce) {
                Ok(true) => continue,
                Ok(false) => break None,
                Err(e) => break Some(e),
            }
        };
        let (open, why) = {
            let mut link = self.peers[peer].link.lock().unwrap();
            link.readers -= 1;
            (link.readers, link.why.clone())
        };
        if self.stopping.load(Ordering::SeqCst) {
            return;
        }
        let err = match failure {
            // A peer that leaves closes all its connections; data still in
            // flight on another one must be read before we call it gone.
            None if open > 0 => return,
            None => why.unwrap_or_else(|| Error::peer_lost(format!("{} closed its connection", self.describe(peer)))),
            Some(e) => Error::peer_lost(format!("lost connection to {}: {e}", self.describe(peer))),
        };
        self.lose_peer(peer, err);
    }

    /// Read one frame; Ok(false) when the peer closed the connection between frames.
    fn read_frame(&self, peer: usize, stream: &mut Conn, bounce: &mut Vec<u64>) -> io::Result<bool> {
        let mut hb = [0u8; HEADER_LEN];
        let first = loop {
            match stream.read(&mut hb) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => break other?,
            }
        };
        if first == 0 {
            return Ok(false);
        }
        stream.read_exact(&mut hb[first..])?;
        let header = FrameHeader::decode(&hb).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.message))?;
        if header.key.kind == KIND_ABORT {
            if header.len > ABORT_MAX {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "oversized abort frame"));
            }
            let mut why = vec![0u8; header.len as usize];
            stream.read_exact(&mut why)?;
            let why = String::from_utf8_lossy(&why);
            // The peer is gone once its other connections are drained too:
            // data it sent on them before giving up still counts.
            let err = Error::peer_lost(format!("{} gave up on the group: {why}", self.describe(peer)));
            self.peers[peer].link.lock().unwrap().why.get_or_insert(err);
            return Ok(false);
        }
        let delivery = self.deliver_to(peer, header.key, header.len);
        match delivery {
            Delivery::Direct(p) => {
                let buf = unsafe { std::slice::from_raw_parts_mut(p.buf.ptr, p.buf.len) };
                let read = match &p.buf.fold {
                    Some(fold) => read_folded(stream, buf, fold, bounce),
                    None => stream.read_exact(buf),
                };
                match read {
                    Ok(()) => p.complete(buf.len(), peer),
                    Err(e) => {
                        p.status.finish(Err(Error::peer_lost(e.to_string())));
                        return Err(e);
                    }
                };
            }
            Delivery::Mismatch(p) => {
                io::copy(&mut Read::by_ref(stream).take(header.len), &mut io::sink())?;
                fail_mismatch(p, header.len);
            }
            Delivery::Stash => {
                // Reserve up front (growing by doubling copies the message again
                // and again), but never more than a bound: the length is the
                // peer's word, and the Vec still grows only as bytes arrive.
                let mut data = Vec::with_capacity(header.len.min(EARLY_RESERVE_MAX) as usize);
                Read::by_ref(stream).take(header.len).read_to_end(&mut data)?;
                if data.len() as u64 != header.len {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                self.peers[peer].mailbox.lock().unwrap().stash(header.key, data, &self.any);
            }
        }
        Ok(true)
    }

    /// Where an arriving message goes; a large one waits briefly for its receive.
    fn deliver_to(&self, peer: usize, key: Key, len: u64) -> Delivery {
        let p = &self.peers[peer];
        let mut mailbox = p.mailbox.lock().unwrap();
        let deadline = Instant::now() + EARLY_GRACE;
        loop {
            match mailbox.on_header(key, len, &self.any) {
                Delivery::Stash if len >= EARLY_GRACE_MIN_BYTES && !self.stopping.load(Ordering::SeqCst) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Delivery::Stash;
                    }
                    mailbox = p.posted.wait_timeout(mailbox, deadline - now).unwrap().0;
                }
                d => return d,
            }
        }
    }

    fn write_loop(&self, peer: usize, half: Arc<WriteHalf>, rx: Receiver<SendReq>) {
        for mut req in rx.iter() {
            if let Some(Err(e)) = req.ready.take().map(|ready| ready()) {
                half.queued.fetch_sub(1, Ordering::SeqCst);
                req.status.finish(Err(e));
                continue;
            }
            let payload = unsafe { std::slice::from_raw_parts(req.data, req.len) };
            let written = write_frame(&mut half.stream.lock().unwrap(), &req.header, payload);
            half.queued.fetch_sub(1, Ordering::SeqCst);
            self.sent(peer, written, req.len, &req.status);
        }
    }

    /// Finish a send; a failed write loses the peer.
    fn sent(&self, peer: usize, written: io::Result<()>, len: usize, status: &Status) {
        match written {
            Ok(()) => {
                status.finish(Ok(len as i64));
            }
            Err(e) => {
                let err = self.lost_within(peer, WHY_GRACE).unwrap_or_else(|| {
                    let err = Error::peer_lost(format!("lost connection to {}: {e}", self.describe(peer)));
                    self.lose_peer(peer, err.clone());
                    err
                });
                status.finish(Err(err));
            }
        }
    }

    /// Why `peer` is lost, if its reader finds out within `grace`: a peer that
    /// gives up writes its reason before it closes, so a write that fails on
    /// the closed connection should report that reason, not "broken pipe".
    fn lost_within(&self, peer: usize, grace: Duration) -> Option<Error> {
        let p = &self.peers[peer];
        let deadline = Instant::now() + grace;
        let mut link = p.link.lock().unwrap();
        while link.lost.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            link = p.linked.wait_timeout(link, deadline - now).unwrap().0;
        }
        link.lost.clone()
    }

    /// Mark `peer` gone: close its connections, fail its receives now and its
    /// queued sends as the writer drains them.
    fn lose_peer(&self, peer: usize, err: Error) {
        let first = {
            let mut link = self.peers[peer].link.lock().unwrap();
            let first = link.lost.is_none();
            if first {
                link.lost = Some(err.clone());
            }
            link.lanes.clear();
            // Dropped too: shared-memory segments are unmapped with their last handle.
            link.unused.clear();
            for s in link.streams.drain(..) {
                s.shutdown();
            }
            self.peers[peer].linked.notify_all();
            first
        };
        let message = err.message.clone();
        let waiting = self.peers[peer].mailbox.lock().unwrap().close(err);
        // A peer that closes while we expect nothing from it has just left the group.
        if first && !self.stopping.load(Ordering::SeqCst) {
            if waiting > 0 {
                tracing::warn!("rustc10d: rank {}: {message}", self.rank());
            } else {
                tracing::debug!("rustc10d: rank {}: {message}", self.rank());
            }
        }
    }

    fn shutdown(&self) {
        if self.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(local) = &self.local {
            unsafe { libc::shutdown(local.listener.as_raw_fd(), libc::SHUT_RDWR) };
        }
        let err = Error::aborted("rustc10d: the process group was shut down");
        for peer in 0..self.peers.len() {
            if peer != self.rank() {
                self.lose_peer(peer, err.clone());
            }
        }
        let me = std::thread::current().id();
        loop {
            let batch: Vec<_> = std::mem::take(&mut *self.threads.lock().unwrap());
            if batch.is_empty() {
                break;
            }
            for h in batch {
                if h.thread().id() != me {
                    let _ = h.join();
                }
            }
        }
    }
}

/// Pieces a folded receive reads at a time: small enough to stay in cache
/// between the read and the fold.
const FOLD_PIECE: usize = 64 * 1024;

/// Read `dst.len()` bytes and fold them into `dst`, a cache-sized piece at a time.
fn read_folded(stream: &mut Conn, dst: &mut [u8], fold: &Fold, bounce: &mut Vec<u64>) -> io::Result<()> {
    let piece = (FOLD_PIECE / fold.unit).max(1) * fold.unit;
    bounce.resize(piece.min(dst.len()).div_ceil(8), 0);
    let bytes = u64_bytes(bounce);
    for chunk in dst.chunks_mut(piece) {
        let src = &mut bytes[..chunk.len()];
        stream.read_exact(src)?;
        fold.apply(chunk, src);
    }
    Ok(())
}

/// Socket timeouts for the handshake (None: blocking).
trait Timeouts {
    fn timeouts(&self, t: Option<Duration>) -> io::Result<()>;
}

impl Timeouts for TcpStream {
    fn timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(t)?;
        self.set_write_timeout(t)
    }
}

impl Timeouts for UnixStream {
    fn timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(t)?;
        self.set_write_timeout(t)
    }
}

/// Tell the peer why this rank gives up (best effort: a stuck peer gets 100 ms).
fn write_abort(stream: &mut Conn, why: &[u8]) {
    let header = FrameHeader { key: Key::abort(), len: why.len() as u64 }.encode();
    stream.set_write_timeout(Some(Duration::from_millis(100)));
    let _ = write_frame(stream, &header, why);
}

/// Header and payload in as few syscalls as possible (one for small frames).
fn write_frame(stream: &mut Conn, mut header: &[u8], mut payload: &[u8]) -> io::Result<()> {
    while !header.is_empty() || !payload.is_empty() {
        let n = if header.is_empty() {
            stream.write(payload)
        } else {
            stream.write_vectored(&[IoSlice::new(header), IoSlice::new(payload)])
        };
        let n = match n {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let from_header = n.min(header.len());
        header = &header[from_header..];
        payload = &payload[n - from_header..];
    }
    Ok(())
}
