//! Staged ops (as CUDA tensors are staged) without torch or a GPU: host
//! memory stands in for the device (tests/threads).

mod threads;

use rustc10d::engine::{run_in_pieces, Device, Event, StagedBuffer, Staging, StreamThread};
use threads::*;

/// Host memory standing in for a device: copies happen at once, and every
/// call is logged.
struct FakeDevice {
    device: RawBuf,
    host: RawBuf,
    log: Arc<Mutex<Vec<String>>>,
    /// The first copy to the host of the range starting here fails.
    fail_in_at: Option<usize>,
}
unsafe impl Send for FakeDevice {}

impl Device for FakeDevice {
    fn to_host(&mut self, _: usize, start: usize, len: usize) -> rustc10d::error::Result<Event> {
        self.log.lock().unwrap().push(format!("in {start}+{len}"));
        if self.fail_in_at == Some(start) {
            self.fail_in_at = None;
            return Err(rustc10d::error::Error::io(format!("device copy at {start} failed")));
        }
        unsafe { std::ptr::copy_nonoverlapping(self.device.ptr.add(start), self.host.ptr.add(start), len) };
        Ok(start as Event)
    }
    fn wait(&mut self, event: Event) -> rustc10d::error::Result<()> {
        self.log.lock().unwrap().push(format!("wait {event}"));
        Ok(())
    }
    fn to_device(&mut self, _: usize, start: usize, len: usize) -> rustc10d::error::Result<()> {
        self.log.lock().unwrap().push(format!("out {start}+{len}"));
        unsafe { std::ptr::copy_nonoverlapping(self.host.ptr.add(start), self.device.ptr.add(start), len) };
        Ok(())
    }
}

/// `host` staged for `device`, in pieces of `piece_bytes`; the log of device calls.
fn staged<T>(device: &mut [T], host: &mut [T], piece_bytes: usize) -> (Staging, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let buffer = StagedBuffer { host: raw(host), copy_in: true, copy_out: true, contiguous: true };
    let device = FakeDevice { device: raw(device), host: raw(host), log: log.clone(), fail_in_at: None };
    (Staging::new(vec![buffer], Box::new(device), piece_bytes), log)
}

/// `staged`, on `stream` (stream-ordered completion, as test staging runs),
/// the device's copy to the host of the range at `fail_in_at` failing.
fn streamed<T>(
    stream: &StreamThread,
    device: &mut [T],
    host: &mut [T],
    piece_bytes: usize,
    contiguous: bool,
    fail_in_at: Option<usize>,
) -> (Staging, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let buffer = StagedBuffer { host: raw(host), copy_in: true, copy_out: true, contiguous };
    let device = FakeDevice { device: raw(device), host: raw(host), log: log.clone(), fail_in_at };
    (Staging::new(vec![buffer], Box::new(stream.op(Box::new(device))), piece_bytes), log)
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
        wait_ok(unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() });
        let reduce_log = log.lock().unwrap().clone();

        let mut bdevice: Vec<u8> = if rank == 1 { (0..=255).cycle().take(7000).collect() } else { vec![0; 7000] };
        let mut bhost = vec![0xEEu8; 7000];
        let (staging, blog) = staged(&mut bdevice, &mut bhost, 2999);
        let part = Collective::Broadcast { buf: raw(&mut bhost), root: 1 };
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
        let stream = StreamThread::start("test-stream").unwrap();
        let n = 1001;
        let mut device: Vec<f64> = (0..n).map(|i| (i * 3 + rank) as f64).collect();
        let mut host = vec![f64::NAN; n];
        let (staging, log) = streamed(&stream, &mut device, &mut host, 2999, true, None);
        let part = Collective::AllReduce { buf: raw(&mut host), red: Reduction::new(DType::F64, ReduceOp::Sum) };
        wait_ok(unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() });
        let log = log.lock().unwrap().clone();
        (device, log)
    });
    for (device, log) in out {
        assert_eq!(device, (0..1001).map(|i| (i * 9 + 3) as f64).collect::<Vec<_>>());
        let ranges = [(0, 2992), (2992, 2992), (5984, 2024)];
        let ins = ranges.iter().flat_map(|(s, l)| [format!("in {s}+{l}"), format!("wait {s}")]);
        assert_eq!(log, ins.chain(["out 0+8008".to_string()]).collect::<Vec<_>>());
    }
}

/// Whatever stage an op fails at, the device keeps every byte, and the
/// stream goes on: pieces run through `run_in_pieces` as the engine runs
/// them, each scribbling over its host bytes (a partial result), the k-th
/// failing; a failed copy in; an op dropped before it ran; an op not cut in
/// pieces.
#[test]
fn a_failed_op_leaves_the_device_as_it_was() {
    let stream = StreamThread::start("test-stream").unwrap();
    let original: Vec<u8> = (0..7000u32).map(|i| (i % 251) as u8).collect();
    let ranges = [(0, 2999), (2999, 2999), (5998, 1002)];
    let part_of = |host: &mut [u8]| Collective::Broadcast { buf: raw(host), root: 0 };
    for contiguous in [true, false] {
        for fail_at in 0..=ranges.len() {
            for copy_fails in [false, true] {
                let at = format!("contiguous {contiguous}, piece {fail_at} fails, copy in fails {copy_fails}");
                let mut device = original.clone();
                let mut host = vec![0u8; 7000];
                let fail_in_at = (copy_fails && fail_at < ranges.len()).then(|| ranges[fail_at].0);
                let fail_in_at = fail_in_at.filter(|_| contiguous);
                let (mut staging, _) = streamed(&stream, &mut device, &mut host, 2999, contiguous, fail_in_at);
                let part = part_of(&mut host);
                staging.queue(std::slice::from_ref(&part)).unwrap();
                let ran = run_in_pieces(&mut staging, &part, 2999, |i, piece| {
                    let Collective::Broadcast { buf, .. } = piece else { unreachable!() };
                    unsafe { std::ptr::write_bytes(buf.ptr, 0xAB, buf.len) };
                    if i == fail_at {
                        return Err(Error::io("piece failed"));
                    }
                    Ok(())
                });
                let settled = staging.settle();
                let ok = fail_at == ranges.len() && fail_in_at.is_none();
                assert_eq!(ran.is_ok(), ok, "{at}");
                assert!(settled.is_ok(), "{at}: {settled:?}");
                drop(staging);
                let want = if ok { vec![0xAB; 7000] } else { original.clone() };
                assert!(device == want, "{at}: the device holds what it should not");
            }
        }
    }
    // Dropped before it ran (the engine stopped): nothing changes, nothing stays held.
    let mut device = original.clone();
    let mut host = vec![0u8; 7000];
    let (mut staging, _) = streamed(&stream, &mut device, &mut host, 0, true, None);
    staging.queue(&[]).unwrap();
    unsafe { std::ptr::write_bytes(host.as_mut_ptr(), 0xAB, host.len()) };
    drop(staging);
    assert!(device == original, "a dropped op changed the device");
    // Not cut in pieces: one gate for every output; the stream is not stuck.
    let (mut staging, _) = streamed(&stream, &mut device, &mut host, 0, true, None);
    staging.queue(&[]).unwrap();
    staging.all_in().unwrap();
    host.iter_mut().for_each(|b| *b = b.wrapping_add(1));
    staging.all_out().unwrap();
    staging.settle().unwrap();
    drop(staging);
    assert!(device.iter().zip(&original).all(|(d, o)| *d == o.wrapping_add(1)), "the result came back");
}

/// An op's copies queue behind an earlier op's held copy back (stream
/// order, as on one CUDA stream): the later op's copy in runs once the
/// earlier op is let through.
#[test]
fn a_later_op_waits_behind_a_held_copy_back() {
    let stream = StreamThread::start("test-stream").unwrap();
    let (mut d1, mut h1, mut d2, mut h2) = (vec![1u8; 64], vec![0u8; 64], vec![2u8; 64], vec![0u8; 64]);
    let (mut first, _) = streamed(&stream, &mut d1, &mut h1, 0, true, None);
    first.queue(&[]).unwrap();
    first.all_in().unwrap();
    let (mut second, _) = streamed(&stream, &mut d2, &mut h2, 0, true, None);
    second.queue(&[]).unwrap();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            first.all_out().unwrap();
            first.settle().unwrap();
        });
        second.all_in().unwrap();
    });
    assert!(t0.elapsed() >= Duration::from_millis(100), "the copy in passed a held copy back");
    assert_eq!(h2, vec![2u8; 64]);
    second.settle().unwrap();
}

/// Faults injected at every rank in turn, in a staged all_reduce cut in
/// pieces on each rank's stream: every rank fails promptly, and no device
/// changes however far its pieces got.
#[test]
fn an_injected_fault_leaves_every_device_as_it_was() {
    for fault in
        ["rank=0,op=allreduce,action=fail", "rank=1,op=allreduce,action=drop", "rank=2,op=allreduce,action=fail"]
    {
        let engines = group_with_faults(3, Duration::from_secs(10), fault);
        let t0 = Instant::now();
        let out = on_all(&engines, |rank, e| {
            let stream = StreamThread::start("test-stream").unwrap();
            let original: Vec<f32> = (0..4096).map(|i| (i + rank) as f32).collect();
            let mut device = original.clone();
            let mut host = vec![f32::NAN; 4096];
            let (staging, _) = streamed(&stream, &mut device, &mut host, 4000, true, None);
            let part = Collective::AllReduce { buf: raw(&mut host), red: Reduction::new(DType::F32, ReduceOp::Sum) };
            let waited = unsafe { e.submit(vec![part], None, Some(staging), noop()).unwrap() }.wait(None);
            (waited, device == original)
        });
        assert!(t0.elapsed() < Duration::from_secs(5), "{fault}: no waiting for the timeout");
        for (rank, (waited, unchanged)) in out.into_iter().enumerate() {
            assert!(matches!(waited, Waited::Failed(_)), "{fault}: rank {rank} got {waited:?}");
            assert!(unchanged, "{fault}: rank {rank}'s device changed");
        }
    }
}
