//! Every connection opens with a challenge and response (src/transport/
//! auth.rs): a stranger that forges a hello gets at most a random challenge,
//! a proof made with another key or for another connection is refused, and
//! the key itself never crosses the wire, even in a member's handshake.

#[path = "../support/hostile/mod.rs"]
mod hostile;

use hostile::*;

/// A hello that does not fit the group gets no answer at all; one that fits
/// gets a challenge (a random nonce) and nothing more without a proof.
#[test]
fn a_stranger_gets_at_most_a_challenge() {
    let (engines, addrs, store) = group_via(2, TransportMode::Tcp);
    let key = key_of(&store.watcher(), 2);
    for (from, to, size) in [(1, 0, 3), (1, 1, 2), (0, 0, 2), (5, 0, 2)] {
        let mut s = tcp_stranger(addrs[0]);
        assert!(s.hello(from, to, size, nonce().unwrap()).is_none(), "hello from {from} to {to} of {size}");
        assert!(s.heard.is_empty(), "no answer to a hello that does not fit: {:?}", s.heard);
    }
    let mut s = tcp_stranger(addrs[0]);
    let challenge = s.hello(1, 0, 2, nonce().unwrap()).expect("a hello that fits gets a challenge");
    let mut again = tcp_stranger(addrs[0]);
    let other = again.hello(1, 0, 2, nonce().unwrap()).expect("a challenge");
    assert_ne!(challenge.nonce, other.nonce, "every challenge is new");
    s.say(&[0x42; PROOF_LEN]);
    assert!(s.rest().is_empty(), "a forged proof gets nothing");
    assert_eq!(s.heard.len(), CHALLENGE_LEN);
    assert!(!contains(&s.heard, key.bytes()));
    drop(again);
    still_works(&engines);
}

/// A stranger that knows the protocol but not this group's key: its
/// proof, well made with another key, is refused, over TCP and over the
/// shared-memory socket.
#[test]
fn a_proof_made_with_another_key_is_refused() {
    let (engines, addrs, store) = group_via(2, TransportMode::Shm);
    let impostor = Identity::new(1, 2, GroupKey::derive(b"", &[[0x5A; SHARE_LEN]; 2]));
    let name = shm_name(&store, 0).expect("rank 0 offers shared memory");
    let mut tcp = tcp_stranger(addrs[0]);
    let mut unix = unix_stranger(&name);
    let try_with = |said: &mut dyn FnMut(&[u8]), challenge: Challenge, mine| {
        let t = Transcript { size: 2, dialler: 1, listener: 0, dialler_nonce: mine, listener_nonce: challenge.nonce };
        said(&impostor.prove(Side::Dialler, &t));
    };
    let mine = nonce().unwrap();
    let challenge = tcp.hello(1, 0, 2, mine).unwrap();
    try_with(&mut |b| tcp.say(b), challenge, mine);
    assert!(tcp.rest().is_empty(), "TCP: no proof back");
    let challenge = unix.hello(1, 0, 2, mine).unwrap();
    try_with(&mut |b| unix.say(b), challenge, mine);
    assert!(unix.rest().is_empty(), "shared memory: no proof, no descriptors back");
    still_works(&engines);
}

/// An eavesdropper records a member's whole handshake (here the test plays
/// the member, rank 1, with the group's key), then replays its hello and
/// proof on a new connection: the listener's new nonce makes the old proof
/// worthless. Neither way of the recorded handshake holds the key.
#[test]
fn a_recorded_handshake_replayed_against_a_new_nonce_fails() {
    let (engines, addrs, store) = group_via(2, TransportMode::Tcp);
    let key = key_of(&store.watcher(), 2);
    let member = Identity::new(1, 2, key.clone());
    let mut recorded = tcp_stranger(addrs[0]);
    let mine = nonce().unwrap();
    let challenge = recorded.hello(1, 0, 2, mine).unwrap();
    let t = Transcript { size: 2, dialler: 1, listener: 0, dialler_nonce: mine, listener_nonce: challenge.nonce };
    recorded.say(&member.prove(Side::Dialler, &t));
    let theirs = recorded.hear(PROOF_LEN).expect("a member's proof is answered with the listener's");
    member.check(Side::Listener, &t, &theirs.try_into().unwrap()).expect("the listener proves itself");
    assert!(
        !contains(&recorded.said, key.bytes()) && !contains(&recorded.heard, key.bytes()),
        "the key crossed the wire"
    );

    let mut replay = tcp_stranger(addrs[0]);
    replay.say(&recorded.said[..HELLO_LEN]);
    let fresh = replay.hear(CHALLENGE_LEN).expect("a replayed hello still fits: it gets a challenge");
    assert_ne!(&fresh[..], &recorded.heard[..CHALLENGE_LEN], "with a new nonce");
    replay.say(&recorded.said[HELLO_LEN..]);
    assert!(replay.rest().is_empty(), "the replayed proof is refused");
    // The recorded connection became one of rank 1's: the group is done with.
    drop((recorded, engines));
}
