//! What the tests of strangers and impostors share: a group of threads over
//! real sockets (with the Store it met through, which holds every rank's
//! share of its key, from which a Store reader derives it without a secret), a
//! check that it still works, and a stranger's end of a handshake. An
//! impostor, a member played by a script, is in `impostor`; the honest
//! ranks' ops against it in `honest`.
#![allow(dead_code, unused_imports)]

pub mod honest;
pub mod impostor;

pub use rustc10d::config::{Config, TransportMode};
pub use rustc10d::dtype::{DType, ReduceOp};
pub use rustc10d::engine::{Engine, Waited};
pub use rustc10d::ops::RawBuf;
pub use rustc10d::ops::{Collective, Reduction};
pub use rustc10d::rendezvous::{connect, MemStore, Member, Store};
pub use rustc10d::transport::links::auth::{
    nonce, GroupKey, Identity, Share, Side, Transcript, NONCE_LEN, PROOF_LEN, SHARE_LEN,
};
pub use rustc10d::transport::links::frame::{Challenge, Hello, CHALLENGE_LEN, HELLO_LEN, PROTOCOL_VERSION};
pub use std::io::{Read, Write};
pub use std::net::{SocketAddr, TcpStream};
pub use std::os::linux::net::SocketAddrExt;
pub use std::os::unix::net::UnixStream;
pub use std::sync::Arc;
pub use std::time::{Duration, Instant};

/// The group, its TCP addresses, and the Store it met through.
pub fn group_via(world: usize, transport: TransportMode) -> (Vec<Engine>, Vec<SocketAddr>, Arc<MemStore>) {
    group_with(world, Config { transport, ..Config::default() })
}

/// The group of `world` ranks with settings `cfg`, its TCP addresses, and the Store it met through.
pub fn group_with(world: usize, cfg: Config) -> (Vec<Engine>, Vec<SocketAddr>, Arc<MemStore>) {
    let store = Arc::new(MemStore::default());
    let timeout = Duration::from_secs(10);
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let (store, cfg) = (store.clone(), cfg.clone());
            std::thread::spawn(move || {
                let member = Member { rank, size: world, timeout, store_host: Some("127.0.0.1".into()) };
                let mesh = connect(&*store, &member, &cfg).unwrap();
                let addr = mesh.local_addr();
                (Engine::new(Arc::new(mesh), &cfg, timeout).unwrap(), addr)
            })
        })
        .collect();
    let (engines, addrs) = hs.into_iter().map(|h| h.join().unwrap()).unzip();
    (engines, addrs, store)
}

/// An all-reduce on every rank gives the right answer, promptly.
pub fn still_works(engines: &[Engine]) {
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (rank, e) in engines.iter().enumerate() {
            s.spawn(move || {
                let mut v = vec![rank as f32 + 1.0; 1000];
                let buf = RawBuf::new(v.as_mut_ptr().cast(), 4000);
                let red = Reduction::new(DType::F32, ReduceOp::Sum);
                let part = Collective::AllReduce { buf, red };
                // SAFETY: `v` outlives the op, waited for on the next line before it is read.
                let h = unsafe { e.submit(vec![part], None, None, Box::new(|_| Ok(()))).unwrap() };
                assert_eq!(h.wait(None), Waited::Done);
                let w = engines.len() as f32;
                assert!(v.iter().all(|&x| x == w * (w + 1.0) / 2.0));
            });
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(3), "the group was slowed down: {:?}", t0.elapsed());
}

/// Every rank's share of the key of a group of `size` (first incarnation), as the Store holds them.
pub fn shares_of(store: &dyn Store, size: usize) -> Vec<Share> {
    (0..size)
        .map(|rank| {
            let record = store.get(&format!("rustc10d/0/addr/{rank}"), Duration::from_secs(10)).unwrap();
            let text = String::from_utf8_lossy(&record).into_owned();
            let hex = text.split(' ').nth(6).expect("a share");
            std::array::from_fn(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        })
        .collect()
}

/// The group's key as a Store reader derives it, where the job has no secret: what every member knows.
pub fn key_of(store: &dyn Store, size: usize) -> GroupKey {
    GroupKey::derive(b"", &shares_of(store, size))
}

/// The abstract name of `rank`'s shared-memory socket, as it published it (None: TCP only).
pub fn shm_name(store: &MemStore, rank: usize) -> Option<String> {
    let published = store.seen_at(&format!("rustc10d/0/addr/{rank}")).expect("published");
    let name = String::from_utf8(published).unwrap().split(' ').nth(3)?.to_string();
    (name != "-").then_some(name)
}

pub fn unix_connect(name: &str) -> UnixStream {
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    UnixStream::connect_addr(&addr).unwrap()
}

/// One end of a connection to a listener, keeping what went each way.
pub struct Stranger<S> {
    pub stream: S,
    pub said: Vec<u8>,
    pub heard: Vec<u8>,
}

impl<S> Stranger<S>
where
    for<'s> &'s S: Read + Write,
{
    /// `stream` must have a read timeout (a silent listener ends the wait).
    pub fn new(stream: S) -> Self {
        Stranger { stream, said: Vec::new(), heard: Vec::new() }
    }

    pub fn say(&mut self, bytes: &[u8]) {
        // A listener that has closed already may refuse it; what it says back tells.
        let _ = (&self.stream).write_all(bytes);
        self.said.extend_from_slice(bytes);
    }

    /// Exactly `n` bytes from the listener, or None if it closes (or says nothing in time) first.
    pub fn hear(&mut self, n: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; n];
        (&self.stream).read_exact(&mut buf).ok()?;
        self.heard.extend_from_slice(&buf);
        Some(buf)
    }

    /// Whatever else the listener says before it closes.
    pub fn rest(&mut self) -> Vec<u8> {
        let mut got = Vec::new();
        let _ = (&self.stream).read_to_end(&mut got);
        self.heard.extend_from_slice(&got);
        got
    }

    /// Send a hello as rank `from` of `size` to rank `to`, and take the
    /// challenge it gets, if any.
    pub fn hello(&mut self, from: u32, to: u32, size: u32, nonce: [u8; NONCE_LEN]) -> Option<Challenge> {
        self.say(&Hello { version: PROTOCOL_VERSION, from, to, size, nonce }.encode());
        let bytes = self.hear(CHALLENGE_LEN)?;
        Some(Challenge::decode(&bytes.try_into().unwrap()).expect("a challenge"))
    }
}

pub fn tcp_stranger(addr: SocketAddr) -> Stranger<TcpStream> {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    Stranger::new(s)
}

pub fn unix_stranger(name: &str) -> Stranger<UnixStream> {
    let s = unix_connect(name);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    Stranger::new(s)
}

pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
