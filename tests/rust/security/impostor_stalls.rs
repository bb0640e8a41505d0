//! A member that knows the key and passed the handshake, then stalls or
//! closes where it must not: within a header, within a message, after
//! announcing more than it ever sends, or by no longer reading. The ops
//! that wait for it end within their timeout (plus a bounded grace) with an
//! error that says "Timed out" and names what they waited for, or at once,
//! naming the rank, where it closes; a slow peer that does send everything
//! is read right. Nothing hangs; another group of the process goes on.

#[path = "../support/hostile/mod.rs"]
mod hostile;

use hostile::honest::{all_gather, recv, send, shut_down};
use hostile::impostor::{group_with_impostor, infiltrated, infiltrated_with, tcp_config, Infiltrated, Wire};
use hostile::*;
use rustc10d::transport::links::frame::{FrameHeader, Key, HEADER_LEN};

/// The ops' timeout, short: these tests wait for it.
const TIMEOUT: Duration = Duration::from_secs(2);
/// What an op that timed out may take beyond its timeout: asking the peer
/// what it waits for (at most 0.4 s), cutting a connection that holds a
/// receive being filled (0.5 s), and a busy machine.
const SLACK: Duration = Duration::from_secs(4);
/// At most this long for a failure that needs no timeout.
const PROMPT: Duration = Duration::from_secs(5);

fn pair(timeout: Duration) -> (Engine, Wire) {
    let (mut engines, mut wires) = group_with_impostor(2, 1, timeout);
    (engines[0].take().unwrap(), wires[0].take().unwrap())
}

fn header(key: Key, len: u64) -> [u8; HEADER_LEN] {
    FrameHeader { key, len, remote: false }.encode()
}

/// The impostor stalls within the one message of an all-gather that rank 0
/// waits for (its header cut short, or its body), keeping the connection
/// open: the op times out naming the impostor, and ends.
#[test]
fn a_peer_that_stalls_within_a_frame_times_the_op_out_naming_it() {
    let (bystanders, _, _) = group_via(2, TransportMode::Tcp);
    for (what, cut) in [("within the header", HEADER_LEN / 2), ("within the body", HEADER_LEN + 32)] {
        let (e, wire) = pair(TIMEOUT);
        let op = all_gather(&e, 64, 0xAA);
        let seq = wire.echo_call_check();
        let frame = [&header(Key::collective(seq, 0), 64)[..], &[0x55; 64]].concat();
        wire.write(&frame[..cut]);
        let out = op.finish(TIMEOUT + SLACK * 2);
        let took = out.took;
        let err = out.failed_saying(TIMEOUT + SLACK, &["Timed out", "waiting for data from rank 1"]);
        assert!(took >= TIMEOUT, "{what}: failed before its timeout: {}", err.message);
        eprintln!("{what}: after {took:?}: {}", err.message);
        shut_down(e);
        drop(wire);
    }
    still_works(&bystanders);
}

/// The same for a point-to-point receive.
#[test]
fn a_peer_that_stalls_within_a_frame_times_a_receive_out_naming_it() {
    for cut in [HEADER_LEN / 2, HEADER_LEN + 32] {
        let (e, wire) = pair(TIMEOUT);
        let op = recv(&e, 1, 7, 64);
        wire.write(&[&header(Key::p2p(7), 64)[..], &[0x55; 32]].concat()[..cut]);
        let out = op.finish(TIMEOUT + SLACK * 2);
        out.failed_saying(TIMEOUT + SLACK, &["Timed out", "recv #0 from rank 1", "waiting for data"]);
        shut_down(e);
        drop(wire);
    }
}

/// A header for a message nobody posted a receive for, announcing 2^62
/// bytes, and then nothing: such a message is read into memory as it
/// comes, so the reader must reserve only a bounded amount ahead for it
/// (never what the header announces), and the receives behind it time out
/// naming the impostor. Then the same for a collective.
#[test]
fn a_huge_announced_length_for_nobody_reserves_little_and_times_out() {
    let (e, wire) = pair(TIMEOUT);
    let op = recv(&e, 1, 7, 64);
    wire.frame(Key::p2p(99), 1 << 62, &[]);
    let out = op.finish(TIMEOUT + SLACK * 2);
    out.failed_saying(TIMEOUT + SLACK, &["Timed out", "recv #0 from rank 1", "waiting for data"]);
    shut_down(e);

    let (e, wire) = pair(TIMEOUT);
    let op = all_gather(&e, 64, 0xAA);
    let seq = wire.echo_call_check();
    wire.frame(Key::collective(seq, 5), 1 << 62, &[1, 2, 3]);
    let out = op.finish(TIMEOUT + SLACK * 2);
    out.failed_saying(TIMEOUT + SLACK, &["Timed out", "waiting for data from rank 1"]);
    shut_down(e);
    drop(wire);
}

/// The impostor closes its connection at each place within a frame: the
/// op fails at once, naming it.
#[test]
fn a_peer_that_closes_within_a_frame_is_lost_at_once() {
    let (bystanders, _, _) = group_via(2, TransportMode::Tcp);
    let message = [&header(Key::p2p(7), 64)[..], &[0x55; 64]].concat();
    let reason = [&header(Key::abort(), 100)[..], &[b'x'; 50]].concat();
    let nobodys = header(Key::p2p(99), 1 << 62);
    let cases: [(&str, &[u8], &str); 5] = [
        ("before anything", &[], "closed its connection"),
        ("within a header", &message[..HEADER_LEN / 2], "lost connection to rank 1"),
        ("within a message", &message[..HEADER_LEN + 32], "lost connection to rank 1"),
        ("within an abort's reason", &reason, "lost connection to rank 1"),
        ("after announcing 2^62 bytes for nobody", &nobodys, "lost connection to rank 1"),
    ];
    for (what, sent, says) in cases {
        let (e, wire) = pair(Duration::from_secs(20));
        let op = recv(&e, 1, 7, 64);
        wire.write(sent);
        wire.close();
        let err = op.finish(Duration::from_secs(40)).failed_saying(PROMPT, &["rank 1", says]);
        eprintln!("{what}: {}", err.message);
        shut_down(e);
    }
    still_works(&bystanders);
}

/// A peer that sends its message a byte at a time, header and all, is read
/// right: every read continues where the last one stopped.
#[test]
fn a_slow_peer_that_sends_everything_is_read_right() {
    let (e, wire) = pair(Duration::from_secs(20));
    let op = all_gather(&e, 64, 0xAA);
    let seq = wire.echo_call_check();
    let block: Vec<u8> = (0..64).collect();
    wire.trickle(&[&header(Key::collective(seq, 0), 64)[..], &block].concat(), Duration::from_millis(2));
    let out = op.finish(Duration::from_secs(40));
    let bufs = out.result.expect("a slow peer is no failure");
    assert_eq!(bufs[1], vec![0xAA; 64], "rank 0's own block");
    assert_eq!(bufs[2], block, "rank 1's block, as it trickled in");
    let (h, body) = wire.next().expect("rank 0 sent its block");
    assert_eq!((h.key, body), (Key::collective(seq, 0), vec![0xAA; 64]));
    shut_down(e);
}

/// A peer that stops reading: a send larger than the sockets hold times
/// out naming it, and ends (its connection is cut, so that the send no
/// longer touches the buffer).
#[test]
fn a_peer_that_stops_reading_times_a_send_out_naming_it() {
    let (e, wire) = pair(TIMEOUT);
    let op = send(&e, 1, 7, 64 << 20, 0x11);
    let out = op.finish(TIMEOUT + SLACK * 2);
    out.failed_saying(TIMEOUT + SLACK, &["Timed out", "send #0 to rank 1", "still waiting to write its data"]);
    shut_down(e);
    drop(wire);
}

/// A stream that ends within a header is never taken for one that ended
/// between frames ("closed its connection"), whichever of the threads that
/// read the connection (the I/O thread, the waiter polling) sees the end
/// first: it failed one in thirty times before the reader kept its failure.
#[test]
fn an_end_within_a_header_is_never_taken_for_a_clean_close() {
    let half = &header(Key::p2p(7), 64)[..HEADER_LEN / 2];
    for _ in 0..100 {
        let (e, wire) = pair(Duration::from_secs(20));
        let op = recv(&e, 1, 7, 64);
        wire.write(half);
        wire.close();
        let err = op.finish(Duration::from_secs(40)).failed_saying(PROMPT, &["lost connection to rank 1"]);
        assert!(err.message.contains("unexpected end of file"), "{}", err.message);
        shut_down(e);
    }
}

/// A member that floods a rank with connections it proves (it knows the
/// key, so each is adopted: the limit on handshakes holds for those not
/// yet proved) does not keep the other members out: ranks 0 and 2 of four,
/// not ring neighbours, connect lazily meanwhile and exchange messages.
#[test]
fn a_member_flooding_a_rank_with_proved_connections_keeps_nobody_out() {
    let Infiltrated { mut engines, impostor, store, .. } = infiltrated(4, 1, Duration::from_secs(20));
    let flood: Vec<Wire> = (0..100).map(|_| impostor.dial(&store, 0)).collect();
    let (zero, two) = (engines[0].take().unwrap(), engines[2].take().unwrap());
    let t0 = Instant::now();
    let ops =
        [recv(&zero, 2, 5, 4096), send(&two, 0, 5, 4096, 0x22), recv(&two, 0, 6, 4096), send(&zero, 2, 6, 4096, 0x33)];
    let outs: Vec<_> = ops.into_iter().map(|op| op.finish(Duration::from_secs(30))).collect();
    assert!(t0.elapsed() < PROMPT, "the flood slowed the lazy connection down: {:?}", t0.elapsed());
    let bufs: Vec<Vec<Vec<u8>>> = outs.into_iter().map(|o| o.result.expect("a lazy connection got through")).collect();
    assert_eq!((bufs[0][0][0], bufs[2][0][0]), (0x22, 0x33));
    // Nor does rank 0 hold them: a connection proved beyond the peer's
    // lanes (one here) is closed, so a member cannot make a rank keep a
    // reader and a socket for each one it proves.
    let open = |w: &Wire| {
        w.stream.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        // Open: the read waits out its timeout; closed: it ends at once.
        (&w.stream)
            .read(&mut [0u8; 1])
            .is_err_and(|e| matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
    };
    let kept = flood.iter().filter(|w| open(w)).count();
    assert!(kept <= 1, "{kept} of the flood's 100 connections kept");
    drop(flood);
    [zero, two].into_iter().chain(engines.into_iter().flatten()).for_each(shut_down);
}

/// A member that sends message after message that no receive was posted
/// for: the rank keeps at most its cap of them (RUSTC10D_EARLY_BYTES_MAX),
/// then reads that member no further, so the flood stops in the member's
/// own socket, not in the rank's memory. A receive posted for one of them
/// takes it, and lets reading go on.
#[test]
fn a_member_flooding_a_rank_with_messages_nobody_receives_is_held_at_the_cap() {
    const CAP: u64 = 4 << 20;
    const MESSAGE: usize = 64 << 10;
    let cfg = Config { early_bytes_max: CAP, ..tcp_config() };
    let Infiltrated { mut engines, mut wires, .. } = infiltrated_with(2, 1, TIMEOUT, cfg);
    let (e, wire) = (engines[0].take().unwrap(), wires[0].take().unwrap());
    let retained = || e.transport().upgrade().unwrap().retained().early_bytes;
    wire.stream.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let body = vec![0x5a; MESSAGE];
    let messages = 2000; // 125 MiB: far beyond the cap and the sockets' buffers
    let sent = (0..messages)
        .take_while(|&tag| {
            let frame = [&header(Key::p2p(1000 + tag), MESSAGE as u64)[..], &body].concat();
            (&wire.stream).write_all(&frame).is_ok()
        })
        .count();
    assert!(sent < messages as usize, "the member's writes were never held back: {sent} messages sent");
    let kept = retained();
    assert!(kept <= CAP && kept >= CAP - MESSAGE as u64, "kept {kept} bytes, cap {CAP}");

    let first = recv(&e, 1, 1000, MESSAGE).finish(PROMPT);
    assert_eq!(first.result.expect("the first message is there")[0], body);
    // Room for one more: the rank reads on, and holds again at the cap.
    let t0 = Instant::now();
    while retained() < CAP - MESSAGE as u64 / 2 && t0.elapsed() < PROMPT {
        std::thread::sleep(Duration::from_millis(10));
    }
    let kept = retained();
    assert!(kept <= CAP && kept > CAP - MESSAGE as u64, "kept {kept} bytes after a receive, cap {CAP}");
    shut_down(e);
    drop(wire);
}
