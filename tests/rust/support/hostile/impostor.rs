//! A member of a real group played by a script. It joins the rendezvous
//! through the group's Store as one rank, derives the key from the shares
//! there as every member does, proves itself in the real challenge and response over TCP,
//! and then writes whatever bytes a test tells it to: well-formed frames,
//! wrong ones, half ones, or nothing. The other ranks are real (`connect`,
//! `Engine`), threads of this process over real sockets.

use super::*;
use rustc10d::transport::links::auth::Proof;
use rustc10d::transport::links::fdpass::host_key;
use rustc10d::transport::links::frame::{FrameHeader, Key, HEADER_LEN, KIND_COLLECTIVE};
use rustc10d::transport::links::striping::LaneCount;
use std::net::TcpListener;

/// How long the impostor waits for anything a member says or does.
const PATIENCE: Duration = Duration::from_secs(10);

/// The settings of every rank of these groups: TCP only (so no arena and no
/// single copy), one connection to each peer (so every frame the impostor
/// sends arrives on the connection the member reads its receives from).
pub fn tcp_config() -> Config {
    Config { transport: TransportMode::Tcp, nsocks: LaneCount::Fixed(1), ..Config::default() }
}

/// A group of `world` ranks whose rank `at` is the impostor: the honest
/// ranks' engines (None at `at`), with `timeout` for their ops, and the
/// impostor's connections to each of them (None where it has none: at
/// `at`, and to a rank that is not its ring neighbour, which it would have
/// to accept should that rank send to it).
pub fn group_with_impostor(world: usize, at: usize, timeout: Duration) -> (Vec<Option<Engine>>, Vec<Option<Wire>>) {
    let Infiltrated { engines, wires, .. } = infiltrated(world, at, timeout);
    (engines, wires)
}

/// A group with an impostor (see `group_with_impostor`), with the impostor
/// itself and the group's Store, to dial members again.
pub struct Infiltrated {
    pub engines: Vec<Option<Engine>>,
    pub wires: Vec<Option<Wire>>,
    pub impostor: Impostor,
    pub store: Arc<MemStore>,
}

pub fn infiltrated(world: usize, at: usize, timeout: Duration) -> Infiltrated {
    infiltrated_with(world, at, timeout, tcp_config())
}

/// The same, the honest ranks with settings `cfg` (TCP, one connection a peer, as `tcp_config`).
pub fn infiltrated_with(world: usize, at: usize, timeout: Duration, cfg: Config) -> Infiltrated {
    assert!(world >= 2 && at < world);
    let store = Arc::new(MemStore::default());
    let honest: Vec<_> = (0..world)
        .filter(|&rank| rank != at)
        .map(|rank| {
            let (store, cfg) = (store.clone(), cfg.clone());
            let handle = std::thread::spawn(move || {
                let member = Member { rank, size: world, timeout, store_host: Some("127.0.0.1".into()) };
                let mesh = connect(&*store, &member, &cfg).unwrap();
                Engine::new(Arc::new(mesh), &cfg, timeout).unwrap()
            });
            (rank, handle)
        })
        .collect();
    let impostor = Impostor::join(&store, at, world);
    let (left, right) = ((at + world - 1) % world, (at + 1) % world);
    let mut wires: Vec<Option<Wire>> = (0..world).map(|_| None).collect();
    // Its left neighbour dials it at init; it dials its right one, which
    // waits for that (with two ranks, the one dial is enough for both).
    let (from, accepted) = impostor.accept();
    assert_eq!(from, left, "the impostor's left neighbour dials it first");
    wires[left] = Some(accepted);
    if right != left {
        wires[right] = Some(impostor.dial(&store, right));
    }
    let mut engines: Vec<Option<Engine>> = (0..world).map(|_| None).collect();
    for (rank, handle) in honest {
        engines[rank] = Some(handle.join().unwrap());
    }
    Infiltrated { engines, wires, impostor, store }
}

/// The impostor's side of the rendezvous and of the handshakes.
pub struct Impostor {
    me: Identity,
    listener: TcpListener,
}

impl Impostor {
    /// Join the rendezvous in `store` (a fresh one) as `rank` of `size`:
    /// count itself in, publish a TCP address with the same settings as the
    /// members (`tcp_config`) on the same host and a share, and derive the
    /// key from every rank's.
    pub fn join(store: &MemStore, rank: usize, size: usize) -> Impostor {
        let joined = store.add("rustc10d/joined", 1).unwrap();
        assert!(joined <= size as i64, "a fresh Store: the group's first incarnation");
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let host = host_key().unwrap_or_else(|| "unknown".into());
        let addr = listener.local_addr().unwrap();
        let share: String = nonce().unwrap()[..SHARE_LEN].iter().map(|b| format!("{b:02x}")).collect();
        let record = format!("v{PROTOCOL_VERSION} {addr} {host} - {} - {share}", tcp_config().shared());
        store.set(&format!("rustc10d/0/addr/{rank}"), record.as_bytes()).unwrap();
        Impostor { me: Identity::new(rank as u32, size as u32, key_of(store, size)), listener }
    }

    /// Take the next member's connection and answer its handshake as a
    /// listener does: its rank, and the connection.
    pub fn accept(&self) -> (usize, Wire) {
        let (s, _) = self.listener.accept().unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut hello = [0u8; HELLO_LEN];
        (&s).read_exact(&mut hello).unwrap();
        let hello = Hello::decode(&hello).unwrap();
        hello.fits(self.me.rank, self.me.size).unwrap();
        let challenge = Challenge { nonce: nonce().unwrap() };
        (&s).write_all(&challenge.encode()).unwrap();
        let mut proof: Proof = [0; PROOF_LEN];
        (&s).read_exact(&mut proof).unwrap();
        let t = Transcript {
            size: self.me.size,
            dialler: hello.from,
            listener: self.me.rank,
            dialler_nonce: hello.nonce,
            listener_nonce: challenge.nonce,
        };
        self.me.check(Side::Dialler, &t, &proof).expect("a member proves itself");
        (&s).write_all(&self.me.prove(Side::Listener, &t)).unwrap();
        (hello.from as usize, Wire::new(s))
    }

    /// Dial `peer` at the address it published in `store`, as a member dials.
    pub fn dial(&self, store: &MemStore, peer: usize) -> Wire {
        let record = store.watcher().get(&format!("rustc10d/0/addr/{peer}"), PATIENCE).unwrap();
        let addr: SocketAddr = String::from_utf8(record).unwrap().split(' ').nth(1).unwrap().parse().unwrap();
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        let mine = nonce().unwrap();
        let hello =
            Hello { version: PROTOCOL_VERSION, from: self.me.rank, to: peer as u32, size: self.me.size, nonce: mine };
        (&s).write_all(&hello.encode()).unwrap();
        let mut challenge = [0u8; CHALLENGE_LEN];
        (&s).read_exact(&mut challenge).unwrap();
        let challenge = Challenge::decode(&challenge).unwrap();
        let t = Transcript {
            size: self.me.size,
            dialler: self.me.rank,
            listener: peer as u32,
            dialler_nonce: mine,
            listener_nonce: challenge.nonce,
        };
        (&s).write_all(&self.me.prove(Side::Dialler, &t)).unwrap();
        let mut theirs: Proof = [0; PROOF_LEN];
        (&s).read_exact(&mut theirs).unwrap();
        self.me.check(Side::Listener, &t, &theirs).expect("the member proves itself");
        Wire::new(s)
    }
}

/// The impostor's end of one connection with a member, past the handshake.
pub struct Wire {
    pub stream: TcpStream,
}

impl Wire {
    fn new(stream: TcpStream) -> Wire {
        stream.set_nodelay(true).unwrap();
        Wire { stream }
    }

    /// Write `bytes` as they are. A member that has closed already may
    /// refuse them; what it reports is what the tests look at.
    pub fn write(&self, bytes: &[u8]) {
        let _ = (&self.stream).write_all(bytes);
    }

    /// A frame: a well-formed header for `key` announcing `len` bytes, then `body` (of any length).
    pub fn frame(&self, key: Key, len: u64, body: &[u8]) {
        self.write(&[&FrameHeader { key, len, remote: false }.encode()[..], body].concat());
    }

    /// `bytes` one at a time, `pause` apart: a slow peer.
    pub fn trickle(&self, bytes: &[u8], pause: Duration) {
        for b in bytes {
            self.write(std::slice::from_ref(b));
            std::thread::sleep(pause);
        }
    }

    /// The next frame the member sends (members send well-formed ones),
    /// None if it closes or says nothing in time.
    pub fn next(&self) -> Option<(FrameHeader, Vec<u8>)> {
        let mut header = [0u8; HEADER_LEN];
        (&self.stream).read_exact(&mut header).ok()?;
        let header = FrameHeader::decode(&header).expect("a member's frame");
        let mut body = vec![0u8; header.len as usize];
        (&self.stream).read_exact(&mut body).ok()?;
        Some((header, body))
    }

    /// Wait for the member's call check (its fingerprint, the key every
    /// collective's check uses: sub u64::MAX), skipping what comes before;
    /// the collective's sequence number and the fingerprint's bytes.
    pub fn fingerprint(&self) -> (u64, Vec<u8>) {
        loop {
            let (h, body) = self.next().expect("the member checks its call with the impostor");
            if h.key.kind == KIND_COLLECTIVE && h.key.sub == u64::MAX {
                return (h.key.channel, body);
            }
        }
    }

    /// Pass the member's call check by sending its own fingerprint back:
    /// the impostor called as it did. The collective's sequence number.
    pub fn echo_call_check(&self) -> u64 {
        let (seq, fingerprint) = self.fingerprint();
        self.frame(Key::collective(seq, u64::MAX), fingerprint.len() as u64, &fingerprint);
        seq
    }

    /// Close the connection (both ways), as a process that exits does.
    pub fn close(self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}
