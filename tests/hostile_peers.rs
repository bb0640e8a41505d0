//! Strangers on the listening port must not disturb a running group: random
//! bytes, truncated or forged hellos, silent clients, floods of connections.

use rustc10d::algorithms::RawBuf;
use rustc10d::config::{Config, TransportMode};
use rustc10d::dtype::{DType, ReduceOp};
use rustc10d::engine::{Engine, Waited};
use rustc10d::ops::{Collective, Reduction};
use rustc10d::rendezvous::{connect, MemStore, Member, Store};
use rustc10d::transport::frame::{Hello, HELLO_LEN, PROTOCOL_VERSION, TOKEN_LEN};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn group(world: usize) -> (Vec<Engine>, Vec<SocketAddr>) {
    let (engines, addrs, _) = group_via(world, TransportMode::Tcp);
    (engines, addrs)
}

/// The group, its TCP addresses, and the Store it met through.
fn group_via(world: usize, transport: TransportMode) -> (Vec<Engine>, Vec<SocketAddr>, Arc<MemStore>) {
    let store = Arc::new(MemStore::default());
    let timeout = Duration::from_secs(10);
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let cfg = Config { transport, ..Config::default() };
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
fn still_works(engines: &[Engine]) {
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

/// Whatever the server says back before closing (it must say nothing to strangers).
fn reply(mut s: TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    got
}

#[test]
fn random_bytes_and_truncated_hellos_are_dropped() {
    let (engines, addrs) = group(2);
    let mut seed = 0x2545F4914F6CDD1Du64;
    for len in [1usize, 10, 31, 32, 33, 500, 5000] {
        let mut s = TcpStream::connect(addrs[0]).unwrap();
        let junk: Vec<u8> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let _ = s.write_all(&junk);
        let _ = s.shutdown(std::net::Shutdown::Write);
        assert!(reply(s).is_empty(), "no answer to {len} random bytes");
    }
    still_works(&engines);
}

#[test]
fn a_forged_hello_learns_nothing() {
    let (engines, addrs) = group(2);
    let forged = Hello { version: PROTOCOL_VERSION, rank: 1, size: 2, token: [0xAB; TOKEN_LEN] };
    let mut s = TcpStream::connect(addrs[0]).unwrap();
    s.write_all(&forged.encode()).unwrap();
    let got = reply(s);
    assert!(got.len() < HELLO_LEN, "the group's hello (and token) must not reach a stranger: {got:?}");
    still_works(&engines);
}

#[test]
fn silent_clients_and_floods_leave_the_group_alone() {
    let (engines, addrs) = group(3);
    let silent: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(addrs[1]).unwrap()).collect();
    let flood: Vec<TcpStream> = (0..300).filter_map(|_| TcpStream::connect(addrs[0]).ok()).collect();
    still_works(&engines);
    drop(flood);
    still_works(&engines);
    drop(silent);
    // Shutting down does not wait for handshakes that strangers hold open.
    let lingering = TcpStream::connect(addrs[2]).unwrap();
    let t0 = Instant::now();
    drop(engines);
    assert!(t0.elapsed() < Duration::from_secs(3), "shutdown took {:?}", t0.elapsed());
    drop(lingering);
}

/// A process on the same host (another job, say) that finds a rank's shared-memory socket
/// (its name is listed in /proc/net/unix) gets no hello, no segment, and does not disturb the group.
#[test]
fn strangers_on_the_shared_memory_socket_get_nothing() {
    let (engines, _, store) = group_via(2, TransportMode::Shm);
    still_works(&engines);
    let published = String::from_utf8(store.get("rustc10d/0/addr/0", Duration::from_secs(1)).unwrap()).unwrap();
    let name = published.split(' ').nth(3).expect("rank 0 offers shared memory").to_string();
    let connect = || {
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let s = UnixStream::connect_addr(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };
    let answer = |mut s: UnixStream| {
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        got
    };
    // Junk, then a hello with another group's token (a second job on this host).
    let s = connect();
    let _ = (&s).write_all(&[7u8; 100]);
    assert!(answer(s).is_empty());
    let other_job = Hello { version: PROTOCOL_VERSION, rank: 1, size: 2, token: [0x5A; TOKEN_LEN] };
    let s = connect();
    (&s).write_all(&other_job.encode()).unwrap();
    assert!(answer(s).is_empty(), "the group's hello must not reach another job");
    still_works(&engines);
}
