//! Strangers on the listening ports must not disturb a running group: random
//! bytes, truncated hellos, silent clients, floods of connections, other
//! users on the shared-memory socket. (Forged and replayed handshakes:
//! forged_handshakes.rs.)

#[path = "../support/hostile/mod.rs"]
mod hostile;

use hostile::*;
use std::os::unix::process::CommandExt;

fn group(world: usize) -> (Vec<Engine>, Vec<SocketAddr>) {
    let (engines, addrs, _) = group_via(world, TransportMode::Tcp);
    (engines, addrs)
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
/// (its name is listed in /proc/net/unix) gets at most a challenge, no proof, no segment,
/// and does not disturb the group.
#[test]
fn strangers_on_the_shared_memory_socket_get_nothing() {
    let (engines, _, store) = group_via(2, TransportMode::Shm);
    still_works(&engines);
    let name = shm_name(&store, 0).expect("rank 0 offers shared memory");
    // Junk.
    let mut junk = unix_stranger(&name);
    junk.say(&[7u8; 100]);
    assert!(junk.rest().is_empty());
    // A hello that fits, then a proof made with another group's key (a second job on this host).
    let mut other_job = unix_stranger(&name);
    let mine = nonce().unwrap();
    let challenge = other_job.hello(1, 0, 2, mine).expect("a hello that fits gets a challenge");
    let t = Transcript { size: 2, dialler: 1, listener: 0, dialler_nonce: mine, listener_nonce: challenge.nonce };
    other_job.say(&Identity::new(1, 2, GroupKey::derive(b"", &[[0x5A; SHARE_LEN]; 2])).prove(Side::Dialler, &t));
    assert!(other_job.rest().is_empty(), "no proof, no descriptors for another job");
    assert!(!contains(&other_job.heard, key_of(&store.watcher(), 2).bytes()));
    still_works(&engines);
}

/// A process of another user gets nothing from the shared-memory socket, not
/// even a challenge, though it knew the key. Needs root (to run a process
/// as another user): elsewhere it says so and passes.
#[test]
fn another_user_gets_nothing_from_the_shared_memory_socket() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: running a process as another user needs root");
        return;
    }
    let (engines, _, store) = group_via(2, TransportMode::Shm);
    let name = shm_name(&store, 0).expect("rank 0 offers shared memory");
    let shares: String = shares_of(&store.watcher(), 2).concat().iter().map(|b| format!("{b:02x}")).collect();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "other_user_role", "--nocapture", "--test-threads=1"])
        .env(OTHER_USER_SOCKET, &name)
        .env(OTHER_USER_SHARES, shares)
        .uid(65534)
        .gid(65534)
        .output();
    let out = match out {
        Ok(out) => out,
        // A test binary under a directory only root may enter (a private temporary clone, say).
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return eprintln!("skipped: uid 65534 cannot run this test binary: {e}");
        }
        Err(e) => panic!("run a process as uid 65534: {e}"),
    };
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("heard 0 bytes"), "the other user heard something: {said}");
    assert!(out.status.success(), "{said}\n{}", String::from_utf8_lossy(&out.stderr));
    still_works(&engines);
}

const OTHER_USER_SOCKET: &str = "RUSTC10D_TEST_OTHER_USER_SOCKET";
const OTHER_USER_SHARES: &str = "RUSTC10D_TEST_OTHER_USER_SHARES";

/// Not a test by itself: the process of another user in
/// `another_user_gets_nothing_from_the_shared_memory_socket`, which knows
/// the shares (so the key) and tries to join as rank 1 (does nothing without its variables).
#[test]
fn other_user_role() {
    let (Ok(name), Ok(shares)) = (std::env::var(OTHER_USER_SOCKET), std::env::var(OTHER_USER_SHARES)) else { return };
    let bytes: Vec<u8> =
        (0..shares.len()).step_by(2).map(|i| u8::from_str_radix(&shares[i..i + 2], 16).unwrap()).collect();
    let shares: Vec<Share> = bytes.chunks(SHARE_LEN).map(|c| c.try_into().unwrap()).collect();
    let me = Identity::new(1, 2, GroupKey::derive(b"", &shares));
    let mut s = unix_stranger(&name);
    let mine = nonce().unwrap();
    if let Some(challenge) = s.hello(1, 0, 2, mine) {
        let t = Transcript { size: 2, dialler: 1, listener: 0, dialler_nonce: mine, listener_nonce: challenge.nonce };
        s.say(&me.prove(Side::Dialler, &t));
    }
    s.rest();
    println!("heard {} bytes", s.heard.len());
}

/// `per_listener` silent connections to every listener of every rank (TCP
/// and, where it has one, its Unix socket), held open until dropped.
fn flood(addrs: &[SocketAddr], store: &MemStore, per_listener: usize) -> (Vec<TcpStream>, Vec<UnixStream>) {
    let tcp = addrs.iter().flat_map(|a| (0..per_listener).map(move |_| TcpStream::connect(a).unwrap())).collect();
    let names: Vec<String> = (0..addrs.len()).filter_map(|r| shm_name(store, r)).collect();
    let unix = names.iter().flat_map(|name| (0..per_listener).map(move |_| unix_connect(name))).collect();
    (tcp, unix)
}

/// Connections between ranks that are not ring neighbours open lazily, after
/// init: a flood of silent strangers on every listener must not keep them
/// out. Each rank sends to and receives from the rank opposite it, then all
/// ranks exchange 64 KiB blocks with all others (which, through shared
/// memory, go pairwise and directly, not through the arena).
fn lazy_connections_get_through_a_flood_on(transport: TransportMode) {
    const WORLD: usize = 4;
    const PER_LISTENER: usize = 100;
    let (engines, addrs, store) = group_via(WORLD, transport);
    let strangers = flood(&addrs, &store, PER_LISTENER);
    let shm = transport == TransportMode::Shm;
    assert_eq!(strangers.1.len(), if shm { WORLD * PER_LISTENER } else { 0 }, "every rank offers shared memory");
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (rank, e) in engines.iter().enumerate() {
            s.spawn(move || {
                let opposite = (rank + WORLD / 2) % WORLD;
                let mut out = vec![rank as u32; 1000];
                let mut got = vec![0u32; 1000];
                let recv = unsafe {
                    e.recv(RawBuf::new(got.as_mut_ptr().cast(), 4000), Some(opposite), 7, None, Box::new(|_| Ok(())))
                };
                let send = unsafe {
                    e.send(RawBuf::new(out.as_mut_ptr().cast(), 4000), opposite, 7, None, None, Box::new(|_| Ok(())))
                };
                for h in [send.unwrap(), recv.unwrap()] {
                    assert_eq!(h.wait(None), Waited::Done, "rank {rank}: send/recv with rank {opposite}");
                }
                assert!(got.iter().all(|&x| x == opposite as u32));

                let block = 64 << 10;
                let mut inputs: Vec<Vec<u8>> = (0..WORLD).map(|to| vec![(rank * 16 + to) as u8; block]).collect();
                let mut outputs = vec![vec![0u8; block]; WORLD];
                let part = Collective::AllToAll {
                    inputs: inputs.iter_mut().map(|v| RawBuf::new(v.as_mut_ptr(), block)).collect(),
                    outputs: outputs.iter_mut().map(|v| RawBuf::new(v.as_mut_ptr(), block)).collect(),
                    dtype: rustc10d::dtype::BYTES,
                };
                let h = unsafe { e.submit(vec![part], None, None, Box::new(|_| Ok(()))).unwrap() };
                assert_eq!(h.wait(None), Waited::Done, "rank {rank}: all_to_all");
                for (from, v) in outputs.iter().enumerate() {
                    assert!(v.iter().all(|&x| x == (from * 16 + rank) as u8), "all_to_all from {from} to {rank}");
                }
            });
        }
    });
    // Generous: one CPU core may be busy elsewhere; the handshake timeout is 10 s.
    assert!(t0.elapsed() < Duration::from_secs(8), "the flood slowed the group down: {:?}", t0.elapsed());
    still_works(&engines);
    drop(strangers);
}

#[test]
fn lazy_tcp_connections_get_through_a_flood_of_silent_strangers() {
    lazy_connections_get_through_a_flood_on(TransportMode::Tcp);
}

#[test]
fn lazy_shared_memory_connections_get_through_a_flood_of_silent_strangers() {
    lazy_connections_get_through_a_flood_on(TransportMode::Shm);
}
