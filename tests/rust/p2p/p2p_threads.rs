//! Point-to-point without torch, over real sockets and shared memory
//! (tests/rust/support/threads): any order, any source, timeouts, sends whose bytes come
//! from a device.
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../support/threads/mod.rs"]
mod threads;

use threads::*;

fn p2p_in_any_order_and_recv_timeout_on(mode: TransportMode) {
    let engines = group_via(mode, 2, Duration::from_secs(10));
    on_all(&engines, |rank, e| {
        let peer = 1 - rank;
        let mut inbox = vec![vec![0u32; 4]; 3];
        let mut outbox: Vec<Vec<u32>> = (0..3).map(|t| vec![rank as u32 * 100 + t; 4]).collect();
        let order: [usize; 3] = if rank == 0 { [2, 0, 1] } else { [1, 2, 0] };
        let recvs: Vec<_> = order
            .iter()
            // SAFETY: inbox[t] outlives every handle (all waited for below) and is
            // read only after; each receive has a buffer of its own.
            .map(|&t| unsafe { e.recv(raw(&mut inbox[t]), Some(peer), t as i64, None, noop()).unwrap() })
            .collect();
        let sends: Vec<_> = [0usize, 1, 2]
            .iter()
            .rev()
            // SAFETY: outbox[t] outlives the handles, waited for below, and is not changed.
            .map(|&t| unsafe { e.send(raw(&mut outbox[t]), peer, t as i64, None, None, noop()).unwrap() })
            .collect();
        for h in recvs.into_iter().chain(sends) {
            wait_ok(h);
        }
        for (t, got) in inbox.iter().enumerate() {
            assert_eq!(got, &vec![peer as u32 * 100 + t as u32; 4]);
        }

        let mut never = vec![0u8; 4];
        // SAFETY: `never` outlives the receive, which the engine fails (and
        // withdraws) at its 300 ms timeout, waited for below.
        let h = unsafe { e.recv(raw(&mut never), Some(peer), 999, Some(Duration::from_millis(300)), noop()).unwrap() };
        assert!(!h.is_done());
        assert_eq!(h.wait(Some(Duration::from_millis(50))), Waited::TimedOut, "caller timeout leaves the op running");
        let t0 = Instant::now();
        match h.wait(None) {
            Waited::Failed(Error { message: msg, .. }) => {
                assert!(msg.contains("Timed out after 300 ms") && msg.contains("tag 999"), "{msg}")
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(2));
    });
}

#[test]
fn p2p_in_any_order_and_recv_timeout() {
    BOTH.into_iter().for_each(p2p_in_any_order_and_recv_timeout_on);
}

fn recv_from_any_source_on(mode: TransportMode) {
    let engines = group_via(mode, 3, Duration::from_secs(10));
    on_all(&engines, |rank, e| {
        if rank == 0 {
            let mut got = Vec::new();
            for _ in 0..4 {
                let mut v = [0u32; 2];
                // SAFETY: `v` outlives the receive, waited for on the next line before it is read.
                let h = unsafe { e.recv(raw(&mut v), None, 5, None, noop()).unwrap() };
                wait_ok_ref(&h);
                let src = h.source_rank();
                assert_eq!(v, [src as u32 * 11; 2], "data matches the reported source");
                got.push(src);
            }
            got.sort();
            assert_eq!(got, vec![1, 1, 2, 2]);
            let mut v = [0u32; 2];
            // SAFETY: `v` outlives the receive, which fails at its timeout, waited for next.
            let h = unsafe { e.recv(raw(&mut v), None, 6, Some(Duration::from_millis(200)), noop()).unwrap() };
            assert!(matches!(h.wait(None), Waited::Failed(Error { message: m, .. }) if m.contains("any rank")));
        } else {
            let mut v = [rank as u32 * 11; 2];
            for _ in 0..2 {
                // SAFETY: `v` outlives the send, waited for at once, and is not changed.
                wait_ok(unsafe { e.send(raw(&mut v), 0, 5, None, None, noop()).unwrap() });
            }
        }
    });
}

#[test]
fn recv_from_any_source() {
    BOTH.into_iter().for_each(recv_from_any_source_on);
}

/// A receive from any source fails once a peer is lost (the message it waits
/// for may have been that peer's), naming it, well before its timeout; one
/// posted after the loss fails at once; and shutting the group down fails a
/// pending one at once. (It used to wait for its timeout in all three.)
fn recv_from_any_source_fails_when_a_peer_is_lost_on(mode: TransportMode) {
    let mut engines = group_via(mode, 3, Duration::from_secs(20));
    let dead = engines.pop().unwrap();
    let mut v = [0u32; 2];
    let t0 = Instant::now();
    // SAFETY: `v` outlives the receive, which fails (waited for below) before `v` is reused.
    let h = unsafe { engines[0].recv(raw(&mut v), None, 7, None, noop()).unwrap() };
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(h.wait(Some(Duration::ZERO)), Waited::TimedOut, "nothing was sent yet");
    drop(dead);
    match h.wait(None) {
        Waited::Failed(Error { message: m, .. }) => assert!(m.contains("from any rank") && m.contains("rank 2"), "{m}"),
        other => panic!("expected a failure naming rank 2, got {other:?}"),
    }
    // SAFETY: as above: the receive fails at once and is waited for next.
    let after = unsafe { engines[0].recv(raw(&mut v), None, 8, None, noop()).unwrap() };
    assert!(matches!(after.wait(None), Waited::Failed(_)), "posted after the loss");
    assert!(t0.elapsed() < Duration::from_secs(10), "must not wait for the 20 s timeout");

    let engines = group_via(mode, 2, Duration::from_secs(20));
    let t0 = Instant::now();
    // SAFETY: `v` outlives the receive, which the shutdown fails (waited for
    // below) before `v` is read.
    let h = unsafe { engines[0].recv(raw(&mut v), None, 9, None, noop()).unwrap() };
    engines[0].shutdown();
    match h.wait(None) {
        Waited::Failed(Error { message: m, .. }) => assert!(m.contains("shut down"), "{m}"),
        other => panic!("expected the shutdown to fail it, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "must not wait for the 20 s timeout");
    assert_eq!(v, [0, 0], "a failed receive leaves its buffer alone");
}

#[test]
fn recv_from_any_source_fails_when_a_peer_is_lost() {
    BOTH.into_iter().for_each(recv_from_any_source_fails_when_a_peer_is_lost_on);
}

/// A send whose bytes are filled by `ready` on the sending thread (a device
/// tensor's copy to the host) neither blocks its caller nor lets a later send
/// to the same peer overtake it; a `ready` that fails fails that send alone.
#[test]
fn send_after_ready_keeps_order_and_fails_alone() {
    for mode in BOTH {
        let engines = group_via(mode, 2, Duration::from_secs(10));
        on_all(&engines, |rank, e| {
            if rank == 0 {
                let mut slow = vec![0u32; 1000];
                let mut fast = vec![2u32; 1000];
                let (slow_buf, t0) = (raw(&mut slow), Instant::now());
                struct Fill(RawBuf);
                // SAFETY: a RawBuf of `slow`, which outlives the send that runs `ready`
                // (waited for below); only `ready` writes it, before the send reads it.
                unsafe impl Send for Fill {}
                let fill = Fill(slow_buf);
                let ready = Box::new(move || {
                    let fill = fill;
                    std::thread::sleep(Duration::from_millis(100));
                    // SAFETY: `slow` (4000 bytes) outlives the send, which reads it only after
                    // this `ready` returns; nothing else touches it meanwhile.
                    unsafe { fill.0.slice_mut(0, fill.0.len).copy_from_slice(&[1u8; 4000]) };
                    Ok(())
                });
                // SAFETY: `slow` outlives the send (waited for below) and is written only
                // by `ready`, before the send reads it.
                let h1 = unsafe { e.send(slow_buf, 1, 7, None, Some(ready), noop()).unwrap() };
                assert!(t0.elapsed() < Duration::from_millis(50), "the caller does not wait for ready");
                let failing = Box::new(|| Err(rustc10d::error::Error::io("no device copy")));
                let mut lost = vec![9u32; 1000];
                // SAFETY: `lost` outlives the send, which fails (waited for below) unread.
                let h2 = unsafe { e.send(raw(&mut lost), 1, 7, None, Some(failing), noop()).unwrap() };
                // SAFETY: `fast` outlives the send, waited for below, and is not changed.
                let h3 = unsafe { e.send(raw(&mut fast), 1, 7, None, None, noop()).unwrap() };
                wait_ok(h1);
                match h2.wait(None) {
                    Waited::Failed(Error { message: msg, .. }) => assert!(msg.contains("no device copy"), "{msg}"),
                    other => panic!("a failed ready fails its send: {other:?}"),
                }
                wait_ok(h3);
            } else {
                let (mut a, mut b) = (vec![0u32; 1000], vec![0u32; 1000]);
                // SAFETY: `a` outlives the receive, waited for at once, before it is read.
                wait_ok(unsafe { e.recv(raw(&mut a), Some(0), 7, None, noop()).unwrap() });
                // SAFETY: `b` outlives the receive, waited for at once, before it is read.
                wait_ok(unsafe { e.recv(raw(&mut b), Some(0), 7, None, noop()).unwrap() });
                assert_eq!(a, vec![u32::from_ne_bytes([1; 4]); 1000], "the slow send arrives first, filled");
                assert_eq!(b, vec![2u32; 1000], "then the fast one; the failed one never");
            }
        });
    }
}
