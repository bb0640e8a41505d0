//! Encryption between hosts (RUSTC10D_ENCRYPT, src/transport/links/seal.rs)
//! against someone on the path between two ranks: a relay that every TCP
//! connection of the group crosses (as a router, or a neighbour that
//! spoofs ARP, would be), which records what passes and alters one byte.
//! Without sealing (the secret set, so that it cannot prove itself) it
//! reads the payloads and changes a result silently; sealed, it sees none
//! of them, and the altered byte fails the op, naming the peer, instead of
//! changing its result.

#[path = "../support/hostile/mod.rs"]
mod hostile;

use hostile::*;
use rustc10d::config::LaneCount;
use rustc10d::secret::{Sealed, Secret};
use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::Mutex;

const SECRET: &str = "a job's secret, given to every rank out of band";
/// The payload every rank reduces: a value whose bytes are easy to find on the wire.
const VALUE: f32 = 1234.5678;

fn config(encrypt: bool) -> Config {
    Config {
        transport: TransportMode::Tcp,
        nsocks: LaneCount::Fixed(1),
        secret: Some(Arc::new(Secret::new(SECRET).unwrap())),
        encrypt,
        ..Config::default()
    }
}

/// What the relay does to the bytes it passes.
#[derive(Clone, Copy, PartialEq)]
enum Tamper {
    /// Nothing.
    None,
    /// Flip a bit of the first payload value it sees.
    Payload,
    /// Flip a bit of the 200th byte after the handshake, each way.
    After,
}

/// Bytes each side sends before its frames: the dialler its hello and its
/// proof, the listener its challenge and its proof.
const HANDSHAKE: [usize; 2] = [HELLO_LEN + PROOF_LEN, CHALLENGE_LEN + PROOF_LEN];

/// A relay in front of one rank: it takes the connections meant for it and
/// passes their bytes both ways, keeping what it saw.
struct Relay {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl Relay {
    fn start(to: SocketAddr, tamper: Tamper) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = seen.clone();
        std::thread::spawn(move || {
            for dialled in listener.incoming() {
                let Ok(dialled) = dialled else { return };
                let Ok(real) = TcpStream::connect(to) else { return };
                let (d2, r2) = (dialled.try_clone().unwrap(), real.try_clone().unwrap());
                let (k1, k2) = (kept.clone(), kept.clone());
                std::thread::spawn(move || pass(dialled, real, k1, tamper, HANDSHAKE[0]));
                std::thread::spawn(move || pass(r2, d2, k2, tamper, HANDSHAKE[1]));
            }
        });
        Relay { addr, seen }
    }
}

/// Copy `from` to `to` until either ends, keeping a copy and tampering as
/// told (`handshake`: the bytes `from` sends before its frames).
fn pass(mut from: TcpStream, mut to: TcpStream, seen: Arc<Mutex<Vec<u8>>>, tamper: Tamper, handshake: usize) {
    let (mut buf, mut total, mut done) = (vec![0u8; 1 << 16], 0usize, false);
    let pattern = VALUE.to_le_bytes();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &mut buf[..n];
        if !done {
            let at = match tamper {
                Tamper::None => None,
                Tamper::Payload => chunk.windows(4).position(|w| w == pattern),
                Tamper::After => (handshake + 200).checked_sub(total).filter(|&i| i < n),
            };
            if let Some(i) = at {
                chunk[i] ^= 0x40;
                done = true;
            }
        }
        seen.lock().unwrap().extend_from_slice(chunk);
        total += n;
        if to.write_all(chunk).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// A Store in which every rank's record names a relay in front of it (as if
/// the relay sat on the path: it cannot write records, lacking the secret).
struct OnPath {
    store: MemStore,
    tamper: Tamper,
    relays: Mutex<HashMap<String, Relay>>,
}

impl Store for OnPath {
    fn set(&self, key: &str, value: &[u8]) -> rustc10d::error::Result<()> {
        self.store.set(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> rustc10d::error::Result<Vec<u8>> {
        let value = self.store.get(key, timeout)?;
        if !key.contains("/addr/") {
            return Ok(value);
        }
        let secret = Secret::new(SECRET).unwrap();
        let record = Sealed { store: &self.store, secret: Some(&secret) }.get(key, timeout)?;
        let record = String::from_utf8(record).unwrap();
        let mut fields: Vec<String> = record.split(' ').map(String::from).collect();
        let mut relays = self.relays.lock().unwrap();
        let relay =
            relays.entry(key.to_string()).or_insert_with(|| Relay::start(fields[1].parse().unwrap(), self.tamper));
        fields[1] = relay.addr.to_string();
        // Sealed as the rank sealed its own, in a Store of its own, then read as it lies there.
        let forged = MemStore::default();
        Sealed { store: &forged, secret: Some(&secret) }.set(key, fields.join(" ").as_bytes())?;
        forged.get(key, timeout)
    }

    fn add(&self, key: &str, delta: i64) -> rustc10d::error::Result<i64> {
        self.store.add(key, delta)
    }

    fn delete(&self, key: &str) -> rustc10d::error::Result<bool> {
        self.store.delete(key)
    }
}

/// A group of 2 whose connections cross relays, and the relays.
fn group_on_path(encrypt: bool, tamper: Tamper) -> (Vec<Engine>, Arc<OnPath>) {
    let store = Arc::new(OnPath { store: MemStore::default(), tamper, relays: Mutex::default() });
    let timeout = Duration::from_secs(5);
    let hs: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let cfg = config(encrypt);
                let member = Member { rank, size: 2, timeout, store_host: Some("127.0.0.1".into()) };
                let mesh = connect(&*store, &member, &cfg).unwrap();
                Engine::new(Arc::new(mesh), &cfg, timeout).unwrap()
            })
        })
        .collect();
    (hs.into_iter().map(|h| h.join().unwrap()).collect(), store)
}

/// An all-reduce of VALUE on both ranks: what each got (or why it failed).
fn all_reduce(engines: &[Engine]) -> Vec<Result<Vec<f32>, String>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = engines
            .iter()
            .map(|e| {
                s.spawn(move || {
                    let mut v = vec![VALUE; 4096];
                    let buf = RawBuf::new(v.as_mut_ptr().cast(), v.len() * 4);
                    let part = Collective::AllReduce { buf, red: Reduction::new(DType::F32, ReduceOp::Sum) };
                    // SAFETY: `v` outlives the op, waited for on the next line before it is read.
                    let h = unsafe { e.submit(vec![part], None, None, Box::new(|_| Ok(()))).unwrap() };
                    match h.wait(Some(Duration::from_secs(10))) {
                        Waited::Done => Ok(v),
                        Waited::Failed(e) => Err(e.message),
                        Waited::TimedOut => Err("timed out".into()),
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn seen(store: &OnPath) -> Vec<u8> {
    store.relays.lock().unwrap().values().flat_map(|r| r.seen.lock().unwrap().clone()).collect()
}

/// Plain frames: the relay reads the payload, and one flipped bit changes a
/// result with nobody the wiser. Sealed: the same relay sees no payload
/// and the group works as without it.
#[test]
fn a_relay_reads_plain_frames_and_nothing_sealed() {
    let (engines, store) = group_on_path(false, Tamper::None);
    assert!(all_reduce(&engines).iter().all(|r| r.as_ref().unwrap().iter().all(|&x| x == 2.0 * VALUE)));
    assert!(contains(&seen(&store), &[VALUE.to_le_bytes(); 4].concat()), "plain: the payload crosses as it is");
    drop(engines);

    let (engines, _store) = group_on_path(false, Tamper::Payload);
    let results = all_reduce(&engines);
    let changed = results.iter().any(|r| r.as_ref().is_ok_and(|v| v.iter().any(|&x| x != 2.0 * VALUE)));
    assert!(changed, "plain: a flipped bit changes a result silently: {results:?}");
    drop(engines);

    let (engines, store) = group_on_path(true, Tamper::Payload);
    for _ in 0..3 {
        assert!(all_reduce(&engines).iter().all(|r| r.as_ref().unwrap().iter().all(|&x| x == 2.0 * VALUE)));
    }
    let wire = seen(&store);
    assert!(wire.len() > 3 * 2 * 4096 * 4, "the ops crossed the relay: {} bytes", wire.len());
    assert!(!contains(&wire, &VALUE.to_le_bytes()[1..]), "sealed: no payload value on the wire");
}

/// Sealed, a byte altered on the way fails the op, naming the peer,
/// instead of changing a result.
#[test]
fn an_altered_sealed_frame_fails_the_op_instead_of_its_result() {
    let (engines, _store) = group_on_path(true, Tamper::After);
    let t0 = Instant::now();
    let results = all_reduce(&engines);
    assert!(t0.elapsed() < Duration::from_secs(8), "failed promptly: {:?}", t0.elapsed());
    for v in results.iter().flatten() {
        assert!(v.iter().all(|&x| x == 2.0 * VALUE), "a wrong result: {results:?}");
    }
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(!failed.is_empty(), "the altered record went unnoticed: {results:?}");
    assert!(
        failed.iter().any(|e| e.contains("did not open") && e.contains("rank")),
        "the error says what happened and names the peer: {failed:?}"
    );
}

/// Sealing needs the secret, and every rank must agree on it.
#[test]
fn sealing_needs_the_secret_and_every_rank_to_agree() {
    let no_secret = rustc10d::config::Config::build(
        |k| match k {
            "RUSTC10D_ENCRYPT" => Some("1".into()),
            _ => None,
        },
        &Default::default(),
    );
    let err = no_secret.unwrap_err().message;
    assert!(err.contains("RUSTC10D_ENCRYPT=1 needs the job's secret"), "{err}");

    let store = Arc::new(MemStore::default());
    let timeout = Duration::from_secs(3);
    let hs: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let member = Member { rank, size: 2, timeout, store_host: Some("127.0.0.1".into()) };
                connect(&*store, &member, &config(rank == 0)).map(|_| ()).unwrap_err().message
            })
        })
        .collect();
    let errs: Vec<String> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(errs.iter().any(|e| e.contains("encrypt (RUSTC10D_ENCRYPT)")), "{errs:?}");
}
