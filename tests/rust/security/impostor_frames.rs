//! A member that knows the key and passed the handshake, then sends
//! frames that are wrong: corrupt headers, lengths that differ from the
//! receive, oversized abort reasons, messages sent as their address over
//! TCP, questions with a payload. Each fails the ops that involve it, with
//! an error that names the rank and what was wrong, promptly (long before
//! the ops' timeout), without a panic; another group of the same process
//! goes on working. (Stalls and closes: impostor_stalls.rs; calls and
//! sparse rows: impostor_calls.rs.)

#[path = "../support/hostile/mod.rs"]
mod hostile;

use hostile::honest::{all_gather, recv, shut_down};
use hostile::impostor::{group_with_impostor, Wire};
use hostile::*;
use rustc10d::transport::links::frame::{
    FrameHeader, Key, Remote, ABORT_MAX, HEADER_LEN, KIND_ABORT, KIND_ANSWER, KIND_ASK,
};

/// The ops' timeout: far longer than a clear error may take (`PROMPT`), so
/// that an op that merely timed out cannot pass for one that failed clearly.
const TIMEOUT: Duration = Duration::from_secs(20);
/// At most this long for a clear error (generous: the machine is shared).
const PROMPT: Duration = Duration::from_secs(5);

/// A group of two where rank 1 is the impostor: rank 0's engine, and the
/// impostor's connection with it.
fn pair() -> (Engine, Wire) {
    let (mut engines, mut wires) = group_with_impostor(2, 1, TIMEOUT);
    (engines[0].take().unwrap(), wires[0].take().unwrap())
}

fn header(key: Key, len: u64) -> [u8; HEADER_LEN] {
    FrameHeader { key, len, remote: false }.encode()
}

/// A receive from the impostor fails at once, whatever is corrupt in the
/// header it gets, naming the impostor and what is corrupt.
#[test]
fn corrupt_frame_headers_lose_the_peer_naming_the_corruption() {
    let (bystanders, _, _) = group_via(2, TransportMode::Tcp);
    let good = header(Key::p2p(7), 64);
    let with = |at: usize, byte: u8| {
        let mut h = good;
        h[at] = byte;
        h
    };
    let mut abort_as_address = with(4, KIND_ABORT);
    abort_as_address[5] = 1;
    let cases: [(&str, [u8; HEADER_LEN], &str); 7] = [
        ("a wrong magic", with(0, good[0] ^ 1), "magic"),
        ("kind 0", with(4, 0), "kind 0"),
        ("an unknown kind", with(4, 9), "kind 9"),
        ("a reserved flag bit", with(5, 2), "reserved"),
        ("a reserved byte", with(6, 1), "reserved"),
        ("another reserved byte", with(7, 0x80), "reserved"),
        ("an abort sent as an address", abort_as_address, "sent as an address"),
    ];
    for (what, bytes, says) in cases {
        let (e, wire) = pair();
        let op = recv(&e, 1, 7, 64);
        wire.write(&bytes);
        wire.write(&[0u8; 64]);
        let out = op.finish(TIMEOUT * 2);
        let err = out.failed_saying(PROMPT, &["rank 1", "corrupt frame header", says]);
        eprintln!("{what}: {}", err.message);
        shut_down(e);
    }
    still_works(&bystanders);
}

/// A collective's message whose length differs from what the receive was
/// posted for fails it with a size mismatch naming the sender: shorter,
/// longer, empty, and u64::MAX bytes (of which only a few ever come: the
/// mismatch is clear from the header, so the op must not wait for the rest).
#[test]
fn a_collective_message_of_another_length_is_a_size_mismatch_naming_the_sender() {
    let (bystanders, _, _) = group_via(2, TransportMode::Tcp);
    for len in [32u64, 128, 0, u64::MAX] {
        let (e, wire) = pair();
        let op = all_gather(&e, 64, 0xAA);
        let seq = wire.echo_call_check();
        // The one block rank 0 receives in an all-gather of two ranks.
        wire.frame(Key::collective(seq, 0), len, &vec![0x55; len.min(1000) as usize]);
        let out = op.finish(TIMEOUT * 2);
        let says = ["size mismatch", "expects 64 bytes", &format!("rank 1 sent {len}")];
        let err = out.failed_saying(PROMPT, &says);
        assert!(err.message.contains("allgather"), "names the op: {}", err.message);
        shut_down(e);
    }
    still_works(&bystanders);
}

/// The same for a point-to-point receive.
#[test]
fn a_p2p_message_of_another_length_is_a_size_mismatch_naming_the_sender() {
    for len in [63u64, 65, u64::MAX] {
        let (e, wire) = pair();
        let op = recv(&e, 1, 7, 64);
        wire.frame(Key::p2p(7), len, &[1; 65][..len.min(65) as usize]);
        let out = op.finish(TIMEOUT * 2);
        out.failed_saying(PROMPT, &["size mismatch", "expects 64 bytes", &format!("rank 1 sent {len}")]);
        shut_down(e);
    }
}

/// An abort frame whose reason is longer than any rank sends loses the
/// peer with that said; one of a fitting length gives its reason, lossily
/// decoded if it is not UTF-8.
#[test]
fn abort_frames_oversized_or_not() {
    let (e, wire) = pair();
    let op = recv(&e, 1, 7, 64);
    wire.frame(Key::abort(), ABORT_MAX + 1, &vec![b'x'; ABORT_MAX as usize + 1]);
    op.finish(TIMEOUT * 2).failed_saying(PROMPT, &["rank 1", "oversized abort frame"]);
    shut_down(e);

    let (e, wire) = pair();
    let op = recv(&e, 1, 7, 64);
    let why = b"the impostor leaves \xff\xfe";
    wire.frame(Key::abort(), why.len() as u64, why);
    op.finish(TIMEOUT * 2).failed_saying(PROMPT, &["rank 1", "gave up on the group: the impostor leaves"]);
    shut_down(e);

    let (e, wire) = pair();
    let op = recv(&e, 1, 7, 64);
    wire.frame(Key { kind: KIND_ABORT, group: 0, channel: 9, sub: 9 }, ABORT_MAX, &vec![0xff; ABORT_MAX as usize]);
    op.finish(TIMEOUT * 2).failed_saying(PROMPT, &["rank 1", "gave up on the group"]);
    shut_down(e);
}

/// Only a shared-memory peer that this rank lets read its memory may send
/// a message as its address; over TCP the header says so and is refused,
/// whether a receive waits for it, waits for another length, or none does.
#[test]
fn a_message_sent_as_its_address_over_tcp_is_refused() {
    let (bystanders, _, _) = group_via(2, TransportMode::Tcp);
    let target = [0x42u8; 64];
    // (the message's key, its length) against a receive of 64 bytes with tag 7.
    for (key, len) in [(Key::p2p(7), 64u64), (Key::p2p(7), 0), (Key::p2p(7), 1 << 20), (Key::p2p(99), 1 << 20)] {
        let (e, wire) = pair();
        let op = recv(&e, 1, 7, 64);
        let remote = Remote { addr: target.as_ptr() as u64, id: 1 };
        wire.write(&[&FrameHeader { key, len, remote: true }.encode()[..], &remote.encode()].concat());
        let out = op.finish(TIMEOUT * 2);
        let err = out.failed_saying(PROMPT, &["rank 1", "address"]);
        eprintln!("tag {} of {len} bytes as its address: {}", key.channel, err.message);
        shut_down(e);
    }
    // An empty message as its address, for an empty receive: nothing to
    // read, but the frame is still one the connection does not take.
    let (e, wire) = pair();
    let op = recv(&e, 1, 7, 0);
    wire.write(&[&FrameHeader { key: Key::p2p(7), len: 0, remote: true }.encode()[..], &[0; 16]].concat());
    op.finish(TIMEOUT * 2).failed_saying(PROMPT, &["rank 1", "address"]);
    shut_down(e);
    still_works(&bystanders);
}

/// A question (what are you waiting for?) has no payload; one with a
/// payload loses the peer.
#[test]
fn a_question_with_a_payload_loses_the_peer() {
    let (e, wire) = pair();
    let op = recv(&e, 1, 7, 64);
    wire.frame(Key { kind: KIND_ASK, group: 0, channel: 0, sub: 0 }, 5, b"hello");
    op.finish(TIMEOUT * 2).failed_saying(PROMPT, &["rank 1", "a question with a payload"]);
    shut_down(e);
}

/// A question says how deep in a chain of waits it was asked: the peer's
/// word. At any depth, u64::MAX too, the rank asked answers what it waits
/// for (here rank 0, for rank 2, which never calls the all-gather rank 0
/// called), and nothing overflows.
#[test]
fn a_question_at_any_depth_is_answered() {
    for depth in [0, 2, 3, u64::MAX] {
        let (mut engines, mut wires) = group_with_impostor(3, 1, Duration::from_secs(3));
        let (e, wire) = (engines[0].take().unwrap(), wires[0].take().unwrap());
        let op = all_gather(&e, 64, 0xAA);
        // Rank 0 tells its right neighbour its call, then waits for its left one's.
        wire.fingerprint();
        std::thread::sleep(Duration::from_millis(200));
        wire.frame(Key::ask(depth), 0, &[]);
        let answer = std::iter::from_fn(|| wire.next()).find(|(h, _)| h.key.kind == KIND_ANSWER);
        let (_, text) = answer.unwrap_or_else(|| panic!("no answer to a question at depth {depth}"));
        let text = String::from_utf8_lossy(&text);
        assert!(text.contains("allgather #0 on rank 0 was waiting for data from rank 2"), "depth {depth}: {text}");
        let out = op.finish(Duration::from_secs(20));
        out.failed_saying(Duration::from_secs(10), &["Timed out", "waiting for data from rank 2"]);
        shut_down(e);
    }
}

/// Threads of this process now.
fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().parse().unwrap()
}

/// Each question is answered on a thread of its own (finding the answer
/// may take asking another rank): 5000 questions at once, 160 KB, made
/// 2500 threads at once. A peer gets a few answers made at a time; the
/// other questions go unanswered, and the process keeps its threads.
#[test]
fn a_flood_of_questions_makes_no_flood_of_threads() {
    let (mut engines, mut wires) = group_with_impostor(3, 1, Duration::from_secs(3));
    let (e, wire) = (engines[0].take().unwrap(), wires[0].take().unwrap());
    let op = all_gather(&e, 64, 0xAA);
    wire.fingerprint();
    std::thread::sleep(Duration::from_millis(200));
    let before = threads();
    let question = FrameHeader { key: Key::ask(0), len: 0, remote: false }.encode();
    wire.write(&question.repeat(5000));
    let mut most = before;
    for _ in 0..50 {
        most = most.max(threads());
        std::thread::sleep(Duration::from_millis(5));
    }
    // Generous: the other tests of this binary start threads meanwhile.
    assert!(most < before + 100, "{before} threads before the flood, {most} during it");
    let answer = std::iter::from_fn(|| wire.next()).find(|(h, _)| h.key.kind == KIND_ANSWER);
    assert!(answer.is_some(), "some questions are answered");
    let out = op.finish(Duration::from_secs(20));
    out.failed_saying(Duration::from_secs(10), &["Timed out", "waiting for data from rank 2"]);
    shut_down(e);
}
