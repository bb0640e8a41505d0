//! Staged ops (as CUDA tensors are staged) without torch or a GPU: host
//! memory stands in for the device (tests/threads).

mod threads;

use rustc10d::engine::{Device, Event, StagedBuffer, Staging};
use threads::*;

/// Host memory standing in for a device: copies happen at once, and every
/// call is logged.
struct FakeDevice {
    device: RawBuf,
    host: RawBuf,
    log: Arc<Mutex<Vec<String>>>,
}
unsafe impl Send for FakeDevice {}

impl Device for FakeDevice {
    fn to_host(&mut self, _: usize, start: usize, len: usize) -> rustc10d::error::Result<Event> {
        self.log.lock().unwrap().push(format!("in {start}+{len}"));
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
    let device = FakeDevice { device: raw(device), host: raw(host), log: log.clone() };
    (Staging { buffers: vec![buffer], device: Box::new(device), piece_bytes }, log)
}

/// A staged all_reduce or broadcast runs piece by piece: every piece's copy
/// in is queued first, then each piece runs once its copy is done and is
/// copied out right after; the cut is rounded to whole elements, and the
/// "device" ends with the right values although the host buffer started as
/// garbage.
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
            let runs = ranges.iter().flat_map(|(s, l)| [format!("wait {s}"), format!("out {s}+{l}")]);
            ins.chain(runs).collect::<Vec<_>>()
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
