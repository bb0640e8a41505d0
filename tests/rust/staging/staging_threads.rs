//! Staged ops (as CUDA tensors are staged) without torch or a GPU: host
//! memory stands in for the device (tests/rust/support/threads).
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../support/threads/mod.rs"]
mod threads;

use rustc10d::engine::{
    run_in_pieces, Device, Event, GateWord, GatedOp, HeldCopies, HostHeld, HostStream, StagedBuffer, Staging,
    StreamGates,
};
use std::collections::VecDeque;
use std::sync::Condvar;
use threads::*;

/// Host memory standing in for a device: copies happen at once, and every
/// call is logged.
#[derive(Clone)]
struct FakeDevice {
    device: RawBuf,
    host: RawBuf,
    log: Arc<Mutex<Vec<String>>>,
    /// The first copy to the host of the range starting here fails.
    fail_in_at: Option<usize>,
    /// Where its copies back are held, with gates.
    held: Option<HeldStream>,
    /// The copy that failed, on a held stream's device.
    failed: Option<Event>,
}
// SAFETY: the RawBufs are the test's `device` and `host` vectors, which
// outlive the op that moves the FakeDevice to the engine's threads;
// they are only touched in the order the engine's staging calls it.
unsafe impl Send for FakeDevice {}

impl Device for FakeDevice {
    fn to_host(&mut self, _: usize, start: usize, len: usize) -> rustc10d::error::Result<Event> {
        self.log.lock().unwrap().push(format!("in {start}+{len}"));
        if self.fail_in_at == Some(start) {
            self.fail_in_at = None;
            // Queued on a held stream's device: the copy fails as it is waited for.
            if self.held.is_some() {
                self.failed = Some(start as Event);
                return Ok(start as Event);
            }
            return Err(rustc10d::error::Error::io(format!("device copy at {start} failed")));
        }
        // SAFETY: start + len <= both buffers' lengths (the staging asks for ranges
        // of its buffer, which both are as long as); the "device" is not the
        // host buffer, and nothing else touches either during the copy in.
        unsafe { std::ptr::copy_nonoverlapping(self.device.ptr.add(start), self.host.ptr.add(start), len) };
        Ok(start as Event)
    }
    fn wait(&mut self, event: Event) -> rustc10d::error::Result<()> {
        self.log.lock().unwrap().push(format!("wait {event}"));
        if self.failed == Some(event) {
            return Err(rustc10d::error::Error::io(format!("device copy at {event} failed")));
        }
        Ok(())
    }
    fn to_device(&mut self, _: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        self.log.lock().unwrap().push(format!("out {start}+{len}"));
        // SAFETY: as for the copy in: a range of both buffers, copied back once
        // the op is done with the host buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.host.ptr.add(start), self.device.ptr.add(start), len) };
        Ok(())
    }
}

/// A held stream as a CUDA stream runs it (`cuStreamWaitValue32`, then
/// copies back): a thread runs what is queued in order, and a wait for the
/// word holds everything behind it until the word reaches its value.
#[derive(Clone, Default)]
struct HeldStream(Arc<(Mutex<OnStream>, Condvar)>);

#[derive(Default)]
struct OnStream {
    word: u32,
    queue: VecDeque<Queued>,
}

enum Queued {
    Until(u32),
    Copy { from: RawBuf, to: RawBuf },
}

impl HeldStream {
    fn start() -> HeldStream {
        let stream = HeldStream::default();
        let run = stream.clone();
        std::thread::spawn(move || run.run());
        stream
    }

    /// Until nothing but this thread holds the stream.
    fn run(&self) {
        let (state, changed) = &*self.0;
        let mut s = state.lock().unwrap();
        while Arc::strong_count(&self.0) > 1 {
            let runnable = match s.queue.front() {
                Some(Queued::Until(v)) => (s.word.wrapping_sub(*v) as i32) >= 0,
                Some(Queued::Copy { .. }) => true,
                None => false,
            };
            if !runnable {
                s = changed.wait_timeout(s, Duration::from_millis(20)).unwrap().0;
                continue;
            }
            if let Some(Queued::Copy { from, to }) = s.queue.pop_front() {
                // SAFETY: a copy queued by `to_device_held`: both ranges are `len` bytes
                // of the test's host and device buffers, which outlive the stream's
                // work (`drained` is checked before they go), and nothing else
                // touches the device buffer while the stream owns it.
                unsafe { std::ptr::copy_nonoverlapping(from.ptr, to.ptr, from.len) };
            }
            changed.notify_all();
        }
    }

    fn push(&self, q: Queued) {
        self.0 .0.lock().unwrap().queue.push_back(q);
        self.0 .1.notify_all();
    }

    /// Whether everything queued has run within a second.
    fn drained(&self) -> bool {
        let (state, changed) = &*self.0;
        let s = state.lock().unwrap();
        !changed.wait_timeout_while(s, Duration::from_secs(1), |s| !s.queue.is_empty()).unwrap().1.timed_out()
    }
}

impl GateWord for HeldStream {
    fn hold_until(&self, value: u32) -> rustc10d::error::Result<()> {
        self.push(Queued::Until(value));
        Ok(())
    }
    fn release_to(&self, value: u32) {
        self.0 .0.lock().unwrap().word = value;
        self.0 .1.notify_all();
    }
}

impl HeldCopies for FakeDevice {
    fn to_device_held(&mut self, _: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        self.log.lock().unwrap().push(format!("held {start}+{len}"));
        // SAFETY: start <= the buffers' lengths (ranges the staging asks for); the
        // pointers are only queued here.
        let (from, to) = unsafe { (self.host.ptr.add(start), self.device.ptr.add(start)) };
        let held = self.held.as_ref().expect("a device with a held stream");
        held.push(Queued::Copy { from: RawBuf::new(from, len), to: RawBuf::new(to, len) });
        Ok(())
    }
    fn restore(&mut self, _: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        self.log.lock().unwrap().push(format!("restore {start}+{len}"));
        // SAFETY: as for the copy in: a range of both buffers, restored before
        // the op completes.
        unsafe { std::ptr::copy_nonoverlapping(self.device.ptr.add(start), self.host.ptr.add(start), len) };
        Ok(())
    }
}

/// Stream-ordered completion as test staging runs it (a host stream that a
/// thread runs, the copies happening at once), or as a CUDA device does (a
/// held stream whose copies are queued); the same gates on both.
enum Streams {
    Host(HostStream, Arc<StreamGates>),
    Gated(HeldStream, Arc<StreamGates>),
}

impl Streams {
    fn new(gated: bool) -> Streams {
        if gated {
            let held = HeldStream::start();
            let gates = Arc::new(StreamGates::new(Box::new(held.clone())).unwrap());
            Streams::Gated(held, gates)
        } else {
            let stream = HostStream::start("test-stream").unwrap();
            let gates = Arc::new(StreamGates::new(Box::new(stream.clone())).unwrap());
            Streams::Host(stream, gates)
        }
    }

    /// `host` staged for `device` on these streams, in pieces of
    /// `piece_bytes`, the copy to the host of the range at `fail_in_at` failing.
    fn staged<T>(
        &self,
        device: &mut [T],
        host: &mut [T],
        piece_bytes: usize,
        contiguous: bool,
        fail_in_at: Option<usize>,
    ) -> Staging {
        let buffer = StagedBuffer { host: raw(host), copy_in: true, copy_out: true, contiguous };
        let log = Arc::default();
        let mut device = FakeDevice { device: raw(device), host: raw(host), log, fail_in_at, held: None, failed: None };
        let device: Box<dyn Device> = match self {
            Streams::Host(stream, gates) => {
                Box::new(GatedOp::new(HostHeld::new(device, stream.clone()), gates.clone()))
            }
            Streams::Gated(held, gates) => {
                device.held = Some(held.clone());
                Box::new(GatedOp::new(device, gates.clone()))
            }
        };
        Staging::new(vec![buffer], device, piece_bytes)
    }

    /// Whether the copies queued so far have run within a second.
    fn drained(&self) -> bool {
        match self {
            Streams::Host(stream, _) => {
                let (tx, rx) = std::sync::mpsc::channel();
                let at = stream.run(Box::new(|| {}));
                stream.after(
                    at,
                    Box::new(move || {
                        let _ = tx.send(());
                    }),
                );
                rx.recv_timeout(Duration::from_secs(1)).is_ok()
            }
            Streams::Gated(held, _) => held.drained(),
        }
    }
}

/// `host` staged for `device`, in pieces of `piece_bytes`; the log of device calls.
fn staged<T>(device: &mut [T], host: &mut [T], piece_bytes: usize) -> (Staging, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let buffer = StagedBuffer { host: raw(host), copy_in: true, copy_out: true, contiguous: true };
    let device = FakeDevice {
        device: raw(device),
        host: raw(host),
        log: log.clone(),
        fail_in_at: None,
        held: None,
        failed: None,
    };
    (Staging::new(vec![buffer], Box::new(device), piece_bytes), log)
}

/// A staged all_reduce or broadcast runs piece by piece: every piece's copy
/// in is queued first, then each piece runs once its copy is done, and the
/// result goes back whole once every piece has succeeded; the cut is
/// rounded to whole elements, and the "device" ends with the right values
/// although the host buffer started as garbage.
#[test]
fn staged_ops_run_in_pieces() {
    let engines = group(3, Duration::from_secs(10));
    let out = on_all(&engines, |rank, e| {
        let n = 1001; // f64: 8008 bytes, in pieces of 2999 / 8 * 8 = 2992 bytes
        let mut device: Vec<f64> = (0..n).map(|i| (i * 3 + rank) as f64).collect();
        let mut host = vec![f64::NAN; n];
        let (staging, log) = staged(&mut device, &mut host, 2999);
        let part = Collective::AllReduce { buf: raw(&mut host), red: Reduction::new(DType::F64, ReduceOp::Sum) };
        // SAFETY: `host` and `device` outlive the op, waited for at once.
        wait_ok(unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() });
        let reduce_log = log.lock().unwrap().clone();

        let mut bdevice: Vec<u8> = if rank == 1 { (0..=255).cycle().take(7000).collect() } else { vec![0; 7000] };
        let mut bhost = vec![0xEEu8; 7000];
        let (staging, blog) = staged(&mut bdevice, &mut bhost, 2999);
        let part = Collective::Broadcast { buf: raw(&mut bhost), root: 1, dtype: rustc10d::dtype::BYTES };
        // SAFETY: `bhost` and `bdevice` outlive the op, waited for at once.
        wait_ok(unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() });
        let bcast_log = blog.lock().unwrap().clone();
        (device, reduce_log, bdevice, bcast_log)
    });
    for (device, reduce_log, bdevice, bcast_log) in out {
        let want: Vec<f64> = (0..1001).map(|i| (i * 9 + 3) as f64).collect();
        assert_eq!(device, want);
        let pieces = |n: usize, len: usize| {
            let ranges: Vec<(usize, usize)> = (0..len).step_by(n).map(|s| (s, n.min(len - s))).collect();
            let ins = ranges.iter().map(|(s, l)| format!("in {s}+{l}"));
            let waits = ranges.iter().map(|(s, _)| format!("wait {s}"));
            ins.chain(waits).chain([format!("out 0+{len}")]).collect::<Vec<_>>()
        };
        assert_eq!(reduce_log, pieces(2992, 8008));
        assert_eq!(bdevice, (0..=255).cycle().take(7000).collect::<Vec<u8>>());
        assert_eq!(bcast_log, pieces(2999, 7000));
    }
}

/// Ranks that cut the same all_reduce differently (one stages in pieces, the
/// others do not) would match messages of different pieces: the call check
/// names the difference instead, and no buffer is touched.
#[test]
fn ranks_that_cut_an_op_differently_are_refused() {
    let engines = group(3, Duration::from_secs(10));
    let t0 = Instant::now();
    let out = on_all(&engines, |rank, e| {
        let mut device = vec![1.0f32; 1 << 14];
        let mut host = vec![1.0f32; 1 << 14];
        let (staging, _) = staged(&mut device, &mut host, if rank == 2 { 1 << 12 } else { 0 });
        let part = Collective::AllReduce { buf: raw(&mut host), red: Reduction::new(DType::F32, ReduceOp::Sum) };
        // SAFETY: `host` and `device` outlive the op, waited for below in the same closure.
        let h = unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() };
        (h.wait(None), device)
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "no waiting for the timeout");
    let mut named = 0;
    for (waited, device) in out {
        assert_eq!(device, vec![1.0f32; 1 << 14], "nothing was copied back");
        match waited {
            Waited::Failed(Error { message: msg, .. }) => {
                named += msg.contains("staged in pieces of 4096 bytes") as usize
            }
            other => panic!("expected a failure, got {other:?}"),
        }
    }
    assert!(named >= 2, "the neighbours of the odd rank name the piece size");
}

/// In stream order, every copy of an op is queued when it is issued: the
/// copies in run at once, the copy back once the op has succeeded, and the
/// device ends with the right values.
#[test]
fn a_stream_holds_the_copy_back_until_the_op_has_succeeded() {
    let engines = group(3, Duration::from_secs(10));
    let out = on_all(&engines, |rank, e| {
        let streams = Streams::new(false);
        let n = 1001;
        let mut device: Vec<f64> = (0..n).map(|i| (i * 3 + rank) as f64).collect();
        let mut host = vec![f64::NAN; n];
        let staging = streams.staged(&mut device, &mut host, 2999, true, None);
        let part = Collective::AllReduce { buf: raw(&mut host), red: Reduction::new(DType::F64, ReduceOp::Sum) };
        // SAFETY: `host` and `device` outlive the op, waited for at once.
        wait_ok(unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() });
        assert!(streams.drained());
        device
    });
    for device in out {
        assert_eq!(device, (0..1001).map(|i| (i * 9 + 3) as f64).collect::<Vec<_>>());
    }
}

/// Whatever stage an op fails at, the device keeps every byte, and the
/// stream goes on: pieces run through `run_in_pieces` as the engine runs
/// them, each scribbling over its host bytes (a partial result), the k-th
/// failing; a failed copy in; an op dropped before it ran; an op not cut in
/// pieces. On a stream thread, and on a held stream with gates.
#[test]
fn a_failed_op_leaves_the_device_as_it_was() {
    a_failed_op_leaves_the_device_as_it_was_on(Streams::new(false));
    a_failed_op_leaves_the_device_as_it_was_on(Streams::new(true));
}

fn a_failed_op_leaves_the_device_as_it_was_on(streams: Streams) {
    let original: Vec<u8> = (0..7000u32).map(|i| (i % 251) as u8).collect();
    let ranges = [(0, 2999), (2999, 2999), (5998, 1002)];
    let part_of = |host: &mut [u8]| Collective::Broadcast { buf: raw(host), root: 0, dtype: rustc10d::dtype::BYTES };
    for contiguous in [true, false] {
        for fail_at in 0..=ranges.len() {
            for copy_fails in [false, true] {
                let at = format!("contiguous {contiguous}, piece {fail_at} fails, copy in fails {copy_fails}");
                let mut device = original.clone();
                let mut host = vec![0u8; 7000];
                let fail_in_at = (copy_fails && fail_at < ranges.len()).then(|| ranges[fail_at].0);
                let fail_in_at = fail_in_at.filter(|_| contiguous);
                let mut staging = streams.staged(&mut device, &mut host, 2999, contiguous, fail_in_at);
                let part = part_of(&mut host);
                // Copies in that happen at once (a host stream's) fail as they are queued.
                let queued = staging.queue(std::slice::from_ref(&part));
                let ran = queued.and_then(|()| {
                    run_in_pieces(&mut staging, &part, 2999, |i, piece| {
                        let Collective::Broadcast { buf, .. } = piece else { unreachable!() };
                        // SAFETY: the piece's buffer is a range of `host`, alive, and nothing else
                        // touches it while the piece runs (as an algorithm would).
                        unsafe { std::ptr::write_bytes(buf.ptr, 0xAB, buf.len) };
                        if i == fail_at {
                            return Err(Error::io("piece failed"));
                        }
                        Ok(())
                    })
                });
                staging.settle();
                let ok = fail_at == ranges.len() && fail_in_at.is_none();
                assert_eq!(ran.is_ok(), ok, "{at}");
                drop(staging);
                assert!(streams.drained(), "{at}: the stream is stuck");
                let want = if ok { vec![0xAB; 7000] } else { original.clone() };
                assert!(device == want, "{at}: the device holds what it should not");
            }
        }
    }
    // Dropped before it ran (the engine stopped): nothing changes, nothing stays held.
    let mut device = original.clone();
    let mut host = vec![0u8; 7000];
    let mut staging = streams.staged(&mut device, &mut host, 0, true, None);
    staging.queue(&[]).unwrap();
    // SAFETY: `host` is a live Vec of host.len() bytes, which the dropped-unrun
    // staging does not touch.
    unsafe { std::ptr::write_bytes(host.as_mut_ptr(), 0xAB, host.len()) };
    drop(staging);
    assert!(streams.drained() && device == original, "a dropped op changed the device");
    // Not cut in pieces: one gate for every output; the stream is not stuck.
    let mut staging = streams.staged(&mut device, &mut host, 0, true, None);
    staging.queue(&[]).unwrap();
    staging.all_in().unwrap();
    host.iter_mut().for_each(|b| *b = b.wrapping_add(1));
    staging.all_out().unwrap();
    staging.settle();
    drop(staging);
    assert!(streams.drained());
    assert!(device.iter().zip(&original).all(|(d, o)| *d == o.wrapping_add(1)), "the result came back");
}

/// Faults injected at every rank in turn, in a staged all_reduce cut in
/// pieces on each rank's stream: every rank fails promptly, and no device
/// changes however far its pieces got.
#[test]
fn an_injected_fault_leaves_every_device_as_it_was() {
    let faults =
        ["rank=0,op=allreduce,action=fail", "rank=1,op=allreduce,action=drop", "rank=2,op=allreduce,action=fail"];
    for (fault, gated) in faults.into_iter().flat_map(|f| [(f, false), (f, true)]) {
        let engines = group_with_faults(3, Duration::from_secs(10), fault);
        let t0 = Instant::now();
        let out = on_all(&engines, |rank, e| {
            let streams = Streams::new(gated);
            let original: Vec<f32> = (0..4096).map(|i| (i + rank) as f32).collect();
            let mut device = original.clone();
            let mut host = vec![f32::NAN; 4096];
            let staging = streams.staged(&mut device, &mut host, 4000, true, None);
            let part = Collective::AllReduce { buf: raw(&mut host), red: Reduction::new(DType::F32, ReduceOp::Sum) };
            // SAFETY: `host` and `device` outlive the op, waited for at once.
            let waited = unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() }.wait(None);
            (waited, streams.drained() && device == original)
        });
        assert!(t0.elapsed() < Duration::from_secs(5), "{fault}: no waiting for the timeout");
        for (rank, (waited, unchanged)) in out.into_iter().enumerate() {
            assert!(matches!(waited, Waited::Failed(_)), "{fault}: rank {rank} got {waited:?}");
            assert!(unchanged, "{fault}: rank {rank}'s device changed");
        }
    }
}

/// With gates, a staged all_reduce in pieces: every copy is queued at issue,
/// the copy back held until the op has succeeded, and the device ends with
/// the right values.
#[test]
fn a_gated_op_lands_once_it_has_succeeded() {
    let engines = group(3, Duration::from_secs(10));
    let out = on_all(&engines, |rank, e| {
        let streams = Streams::new(true);
        let mut device: Vec<f64> = (0..1001).map(|i| (i * 3 + rank) as f64).collect();
        let mut host = vec![f64::NAN; 1001];
        let staging = streams.staged(&mut device, &mut host, 2999, true, None);
        let part = Collective::AllReduce { buf: raw(&mut host), red: Reduction::new(DType::F64, ReduceOp::Sum) };
        // SAFETY: `host` and `device` outlive the op, waited for at once.
        wait_ok(unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() });
        assert!(streams.drained());
        device
    });
    for device in out {
        assert_eq!(device, (0..1001).map(|i| (i * 9 + 3) as f64).collect::<Vec<_>>());
    }
}

/// With gates, an op's copy back runs once every op issued before it has
/// ended too: the second of two ops succeeds first, and its result lands
/// only once the first has ended (failed: its device as it was).
#[test]
fn gated_copies_back_go_in_issue_order() {
    let streams = Streams::new(true);
    let (mut d1, mut h1, mut d2, mut h2) = (vec![1u8; 64], vec![0u8; 64], vec![2u8; 64], vec![0u8; 64]);
    let mut first = streams.staged(&mut d1, &mut h1, 0, true, None);
    let mut second = streams.staged(&mut d2, &mut h2, 0, true, None);
    for op in [&mut first, &mut second] {
        op.queue(&[]).unwrap();
        op.all_in().unwrap();
    }
    h1.fill(7);
    h2.fill(9);
    second.all_out().unwrap();
    second.settle();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(d2, vec![2u8; 64], "the second op's result passed the first op's gate");
    first.settle();
    assert!(streams.drained());
    assert_eq!((d1, d2), (vec![1u8; 64], vec![9u8; 64]));
}

/// A failed op's restore waits for the caller's work queued before the op,
/// which may wait for an earlier op's copies back (here: the restore waits
/// until the first op's result has landed). So it runs on the gates' thread
/// once the earlier op has ended, not on the thread the failure ended on
/// (which the earlier op may need, as a transport's reader thread is):
/// that thread goes on at once, and both ops land, the failed one as it was.
#[test]
fn a_failed_op_restores_off_its_thread_once_earlier_ops_have_ended() {
    let held = HeldStream::start();
    let gates = Arc::new(StreamGates::new(Box::new(held.clone())).unwrap());
    let (mut d1, mut h1, mut d2, mut h2) = (vec![1u8; 64], vec![0u8; 64], vec![2u8; 64], vec![0u8; 64]);
    let fake = |device: &mut Vec<u8>, host: &mut Vec<u8>| FakeDevice {
        device: raw(device),
        host: raw(host),
        log: Arc::default(),
        fail_in_at: None,
        held: Some(held.clone()),
        failed: None,
    };
    let buffer = |host: &mut Vec<u8>| StagedBuffer { host: raw(host), copy_in: true, copy_out: true, contiguous: true };
    let first = GatedOp::new(fake(&mut d1, &mut h1), gates.clone());
    let second = AfterLanding { device: fake(&mut d2, &mut h2), earlier: raw(&mut d1) };
    let mut first = Staging::new(vec![buffer(&mut h1)], Box::new(first), 0);
    let mut second = Staging::new(vec![buffer(&mut h2)], Box::new(GatedOp::new(second, gates.clone())), 0);
    for op in [&mut first, &mut second] {
        op.queue(&[]).unwrap();
        op.all_in().unwrap();
    }
    h2.fill(9); // a partial result
    let t0 = Instant::now();
    second.settle();
    assert!(t0.elapsed() < Duration::from_millis(500), "the failed op's thread waited for the earlier op");
    // The gates' thread sees the failure while the earlier op is still open,
    // and sleeps: the earlier op's end must wake it (once it did not, and the
    // restore waited for the group's shutdown; only a slow thread hid it).
    std::thread::sleep(Duration::from_millis(50));
    h1.fill(7);
    first.all_out().unwrap();
    first.settle();
    assert!(held.drained(), "a held copy is stuck");
    drop((first, second, gates));
    assert_eq!((d1, d2), (vec![7u8; 64], vec![2u8; 64]));
}

/// A device whose restore waits until an earlier op's result has landed
/// (as a CUDA restore waits for the caller's stream, which waited for it).
struct AfterLanding {
    device: FakeDevice,
    earlier: RawBuf,
}

impl Device for AfterLanding {
    fn to_host(&mut self, index: usize, start: usize, len: usize) -> rustc10d::error::Result<Event> {
        self.device.to_host(index, start, len)
    }
    fn wait(&mut self, event: Event) -> rustc10d::error::Result<()> {
        self.device.wait(event)
    }
    fn to_device(&mut self, index: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        self.device.to_device(index, start, len)
    }
}

impl HeldCopies for AfterLanding {
    fn to_device_held(&mut self, index: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        self.device.to_device_held(index, start, len)
    }
    fn restore(&mut self, index: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        let t0 = Instant::now();
        // SAFETY: `earlier` is the first op's device buffer, alive until the
        // test has seen both ops land; a byte read races only with the held
        // stream's copy into it, which writes the value looked for.
        while unsafe { std::ptr::read_volatile(self.earlier.ptr) } != 7 {
            if t0.elapsed() > Duration::from_secs(5) {
                return Err(Error::io("the earlier op never landed"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.device.restore(index, start, len)
    }
}

/// Nobody waits on the host for a stream-ordered op: the gates end one that
/// is overdue (a point-to-point op's timeout), so that what is held behind
/// it goes on; and at shutdown they end every op still holding a ticket.
#[test]
fn the_gates_end_overdue_ops_and_what_is_left_at_shutdown() {
    let held = HeldStream::start();
    let gates = Arc::new(StreamGates::new(Box::new(held.clone())).unwrap());
    let ended = Arc::new(Mutex::new(Vec::new()));
    let expire = |gates: &Arc<StreamGates>, t: u32| -> rustc10d::engine::Expire {
        let (gates, ended) = (gates.clone(), ended.clone());
        Box::new(move |why: Option<Error>| {
            ended.lock().unwrap().push((t, why.map(|e| e.message)));
            gates.release(t);
        })
    };
    let t0 = Instant::now();
    let (a, b) = (gates.hold().unwrap(), gates.hold().unwrap());
    gates.expire_at(a, t0 + Duration::from_millis(50), expire(&gates, a));
    gates.expire_at(b, t0 + Duration::from_secs(3600), expire(&gates, b));
    gates.release(b);
    assert!(held.drained(), "the overdue op still holds the stream");
    assert!(t0.elapsed() >= Duration::from_millis(50));
    assert_eq!(*ended.lock().unwrap(), vec![(a, None)], "only the overdue op, as its own timeout");
    let c = gates.hold().unwrap();
    gates.expire_at(c, t0 + Duration::from_secs(3600), expire(&gates, c));
    gates.close();
    assert!(held.drained());
    let why = ended.lock().unwrap()[1].clone();
    assert!(why.0 == c && why.1.as_ref().is_some_and(|m| m.contains("shut down")), "{why:?}");
    assert!(gates.hold().is_err(), "closed gates take no op");
}

/// One of several ops issued at once from different threads, telling the
/// shared log when it takes its ticket and when the engine runs it.
struct Tagged {
    device: FakeDevice,
    id: usize,
    log: Arc<Mutex<Vec<(&'static str, usize)>>>,
}

impl Device for Tagged {
    fn to_host(&mut self, index: usize, start: usize, len: usize) -> rustc10d::error::Result<Event> {
        self.device.to_host(index, start, len)
    }
    fn wait(&mut self, event: Event) -> rustc10d::error::Result<()> {
        self.log.lock().unwrap().push(("run", self.id));
        self.device.wait(event)
    }
    fn to_device(&mut self, index: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        self.device.to_device(index, start, len)
    }
}

impl HeldCopies for Tagged {
    fn to_device_held(&mut self, index: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        self.log.lock().unwrap().push(("ticket", self.id));
        self.device.to_device_held(index, start, len)
    }
    fn restore(&mut self, index: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        self.device.restore(index, start, len)
    }
}

/// Ops issued from several threads at once take their tickets in the order
/// the engine runs them (else, on a CUDA device, an op that fails could
/// restore behind the copies back of an op run before it, which wait for
/// its ticket: a deadlock; see `Engine::submit`).
#[test]
fn gated_ops_from_many_threads_take_tickets_in_run_order() {
    let engines = group(1, Duration::from_secs(10));
    // A stream that runs nothing: the copies back would outlive the buffers.
    let held = HeldStream::default();
    let gates = Arc::new(StreamGates::new(Box::new(held.clone())).unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|s| {
        for thread in 0..4 {
            let (e, held, gates, log) = (&engines[0], held.clone(), gates.clone(), log.clone());
            s.spawn(move || {
                for i in 0..50 {
                    let (mut device, mut host) = (vec![1.0f32; 8], vec![0.0f32; 8]);
                    let fake = FakeDevice {
                        device: raw(&mut device),
                        host: raw(&mut host),
                        log: Arc::default(),
                        fail_in_at: None,
                        held: Some(held.clone()),
                        failed: None,
                    };
                    let tagged = Tagged { device: fake, id: thread * 1000 + i, log: log.clone() };
                    let buffer = StagedBuffer { host: raw(&mut host), copy_in: true, copy_out: true, contiguous: true };
                    let staging = Staging::new(vec![buffer], Box::new(GatedOp::new(tagged, gates.clone())), 0);
                    let part =
                        Collective::AllReduce { buf: raw(&mut host), red: Reduction::new(DType::F32, ReduceOp::Sum) };
                    // SAFETY: this thread's `host` and `device` outlive the op, waited for at once.
                    wait_ok(unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() });
                }
            });
        }
    });
    let log = log.lock().unwrap();
    let order = |what| log.iter().filter(|(w, _)| *w == what).map(|(_, id)| *id).collect::<Vec<_>>();
    assert_eq!(order("ticket").len(), 200);
    assert_eq!(order("ticket"), order("run"));
}
