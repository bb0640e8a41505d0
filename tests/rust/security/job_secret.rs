//! The job's secret (src/secret.rs) against a process that can read and
//! write the Store but lacks it: it cannot prove itself to a member (so it
//! cannot join, inject, abort or relay: every frame needs a proved
//! connection), cannot join the rendezvous as a rank, and cannot redirect a
//! rank to an address of its choosing. Each attack is first shown to work
//! on the same group without the secret, so that the test fails if the
//! protection it names is gone. And whatever the secret, the Store holds no
//! process id, no address in a process, and not the secret.

#[path = "../support/hostile/mod.rs"]
mod hostile;

use hostile::impostor::Impostor;
use hostile::*;
use rustc10d::error::Error;
use rustc10d::secret::{Sealed, Secret};
use std::thread::JoinHandle;

const SECRET: &str = "a job's secret, given to every rank out of band";

fn with_secret(transport: TransportMode) -> Config {
    Config { transport, secret: Some(Arc::new(Secret::new(SECRET).unwrap())), ..Config::default() }
}

/// Rank `rank` of a group of 2 joining through `store` with `cfg`, on a thread of its own.
fn join_as(rank: usize, store: Arc<MemStore>, timeout: Duration, cfg: Config) -> JoinHandle<Result<(), Error>> {
    std::thread::spawn(move || {
        let member = Member { rank, size: 2, timeout, store_host: Some("127.0.0.1".into()) };
        connect(&*store, &member, &cfg).map(|_| ())
    })
}

/// A stranger's proof for rank 1 of a group of 2, made with `key`, over TCP
/// to rank 0 and over its shared-memory socket: whether each was answered
/// with rank 0's own proof (the connection taken for rank 1's).
fn proved_with(key: &GroupKey, tcp: SocketAddr, shm: &str) -> [bool; 2] {
    [proves(key, tcp_stranger(tcp)), proves(key, unix_stranger(shm))]
}

fn proves<S>(key: &GroupKey, mut s: Stranger<S>) -> bool
where
    for<'s> &'s S: Read + Write,
{
    let me = Identity::new(1, 2, key.clone());
    let mine = nonce().unwrap();
    let Some(challenge) = s.hello(1, 0, 2, mine) else { return false };
    let t = Transcript { size: 2, dialler: 1, listener: 0, dialler_nonce: mine, listener_nonce: challenge.nonce };
    s.say(&me.prove(Side::Dialler, &t));
    s.hear(PROOF_LEN).is_some_and(|theirs| me.check(Side::Listener, &t, &theirs.try_into().unwrap()).is_ok())
}

/// Without the secret, the shares in the Store give anyone the key: a
/// Store reader's proof is taken. With it, the same reader's proof, made
/// from the shares it read, is refused on both sockets, while the key made
/// with the secret is taken: the group works on, undisturbed.
#[test]
fn a_store_reader_without_the_secret_cannot_prove_itself() {
    let (engines, addrs, store) = group_via(2, TransportMode::Shm);
    let name = shm_name(&store, 0).expect("rank 0 offers shared memory");
    assert_eq!(
        proved_with(&key_of(&store.watcher(), 2), addrs[0], &name),
        [true, true],
        "no secret: the Store is the root of trust"
    );
    drop(engines);

    let (engines, addrs, store) = group_with(2, with_secret(TransportMode::Shm));
    let secret = Secret::new(SECRET).unwrap();
    let sealed = Sealed { store: &store.watcher(), secret: Some(&secret) };
    let name = sealed_shm_name(&sealed, 0);
    let shares = shares_of(&sealed, 2);
    let readers_key = GroupKey::derive(b"", &shares);
    assert_eq!(proved_with(&readers_key, addrs[0], &name), [false, false], "a Store reader's key");
    still_works(&engines);
    let members_key = GroupKey::derive(SECRET.as_bytes(), &shares);
    assert_eq!(proved_with(&members_key, addrs[0], &name), [true, true], "the key made with the secret");
}

/// Rank 0's shared-memory socket, from its sealed record.
fn sealed_shm_name(store: &dyn Store, rank: usize) -> String {
    let record = store.get(&format!("rustc10d/0/addr/{rank}"), Duration::from_secs(1)).unwrap();
    String::from_utf8(record).unwrap().split(' ').nth(3).unwrap().to_string()
}

/// A process that joins the rendezvous as rank 1 (it counts itself in,
/// publishes an address and a share, derives the key from the shares) is a
/// member of a group without the secret; in a group with it, rank 0 fails
/// init at once, naming the record no holder of the secret wrote.
#[test]
fn an_impostor_without_the_secret_cannot_join() {
    let timeout = Duration::from_secs(5);
    let joined = |cfg: Config, answers: bool| {
        let store = Arc::new(MemStore::default());
        let honest = join_as(0, store.clone(), timeout, cfg);
        let impostor = Impostor::join(&store, 1, 2);
        // Rank 0 dials its ring neighbour; the connection stays open until its
        // join is over (closed sooner, rank 0 may see rank 1 leave within it).
        let wire = answers.then(|| impostor.accept());
        let joined = honest.join().unwrap();
        drop(wire);
        joined
    };
    let cfg = Config { secret: None, ..with_secret(TransportMode::Tcp) };
    let one_lane = rustc10d::config::LaneCount::Fixed(1);
    joined(Config { nsocks: one_lane, ..cfg }, true).expect("no secret: the impostor is taken for rank 1");

    let t0 = Instant::now();
    let cfg = with_secret(TransportMode::Tcp);
    let err = joined(Config { nsocks: one_lane, ..cfg }, false)
        .expect_err("the impostor's record carries no tag of the secret");
    assert!(err.message.contains("under rustc10d/0/addr/1 was not written with this rank's secret"), "{}", err.message);
    assert!(t0.elapsed() < Duration::from_secs(3), "at once, not at the timeout: {:?}", t0.elapsed());
}

/// A Store writer overwrites rank 1's record with one that sends rank 0 to
/// its own listener (the first step of sitting in the middle). Without the
/// secret rank 0 dials there; with it, rank 0 refuses the record, even
/// one sealed by a member for another key (rank 0's own, moved).
#[test]
fn a_store_writer_cannot_redirect_a_rank() {
    let timeout = Duration::from_millis(1500);
    let redirected = |cfg: Config, forge: &dyn Fn(&MemStore, SocketAddr)| {
        let store = Arc::new(MemStore::default());
        // Rank 1 publishes first; the writer replaces its record; then rank 0 reads it.
        let one = join_as(1, store.clone(), timeout, cfg.clone());
        store.get("rustc10d/0/addr/1", timeout).unwrap();
        let trap = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        forge(&store, trap.local_addr().unwrap());
        let zero = join_as(0, store.clone(), timeout, cfg);
        trap.set_nonblocking(true).unwrap();
        let err = zero.join().unwrap().expect_err("rank 0 cannot reach rank 1");
        let dialled_the_trap = trap.accept().is_ok();
        let _ = one.join().unwrap();
        (err, dialled_the_trap)
    };
    let rewrite = |store: &MemStore, to: SocketAddr| {
        let record = String::from_utf8_lossy(&store.get("rustc10d/0/addr/1", timeout).unwrap()).into_owned();
        let mut fields: Vec<&str> = record.split(' ').collect();
        let to = to.to_string();
        fields[1] = &to;
        store.set("rustc10d/0/addr/1", fields.join(" ").as_bytes()).unwrap();
    };
    let tcp = Config { transport: TransportMode::Tcp, ..Config::default() };
    let (_, dialled) = redirected(tcp, &rewrite);
    assert!(dialled, "without the secret, rank 0 dials where the Store says");

    let (err, dialled) = redirected(with_secret(TransportMode::Tcp), &rewrite);
    assert!(!dialled, "with the secret, rank 0 never dials the writer's address");
    assert!(err.message.contains("under rustc10d/0/addr/1 was not written"), "{}", err.message);
    let tagged_elsewhere = |store: &MemStore, _: SocketAddr| {
        // A value sealed with the secret, for another key.
        let secret = Secret::new(SECRET).unwrap();
        let sealed = Sealed { store, secret: Some(&secret) };
        let record = sealed.get("rustc10d/0/addr/1", timeout).unwrap();
        sealed.set("rustc10d/0/addr/9", &record).unwrap();
        store.set("rustc10d/0/addr/1", &store.get("rustc10d/0/addr/9", timeout).unwrap()).unwrap();
    };
    let (err, dialled) = redirected(with_secret(TransportMode::Tcp), &tagged_elsewhere);
    assert!(!dialled);
    assert!(err.message.contains("under rustc10d/0/addr/1 was not written"), "{}", err.message);
}

/// Ranks given different secrets, or a secret on one rank only, fail init,
/// each saying why.
#[test]
fn ranks_with_different_secrets_fail_init_saying_so() {
    let timeout = Duration::from_secs(3);
    let init = |cfgs: [Config; 2]| {
        let store = Arc::new(MemStore::default());
        let hs: Vec<_> =
            cfgs.into_iter().enumerate().map(|(rank, cfg)| join_as(rank, store.clone(), timeout, cfg)).collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap_err().message).collect::<Vec<_>>()
    };
    let other =
        Config { secret: Some(Arc::new(Secret::new("another job's secret, not ours").unwrap())), ..Config::default() };
    for err in init([with_secret(TransportMode::Auto), other]) {
        assert!(err.contains("was not written with this rank's secret") && err.contains("different secrets"), "{err}");
    }
    let errs = init([with_secret(TransportMode::Auto), Config::default()]);
    assert!(errs[1].contains("disagree on secret (RUSTC10D_SECRET): off on rank 1, on on rank 0"), "{}", errs[1]);
    assert!(errs[0].contains("under rustc10d/0/addr/1 was not written"), "{}", errs[0]);
}

/// What a group leaves in its Store, or had there while its ranks met, with
/// and without the secret: no
/// process id of a rank, no address in a process, and never the secret.
#[test]
fn the_store_holds_no_process_id_no_address_and_not_the_secret() {
    for cfg in [Config::default(), with_secret(TransportMode::Auto)] {
        let (engines, _, store) = group_with(2, Config { single_copy_bytes: 64 << 10, ..cfg });
        still_works(&engines);
        let pid = std::process::id().to_string();
        for (key, value) in store.seen() {
            let text = String::from_utf8_lossy(&value);
            let words: Vec<&str> = text.split([' ', ':', ',', '=']).collect();
            assert!(!words.contains(&pid.as_str()), "{key}: {text}");
            assert!(!contains(&value, SECRET.as_bytes()), "{key}");
            // An address in this process, as the rendezvous once published one (hex of 12 digits and more).
            assert!(
                !words.iter().any(|w| w.len() >= 12 && w.len() < 32 && w.chars().all(|c| c.is_ascii_hexdigit())),
                "{key}: {text}"
            );
        }
    }
}
