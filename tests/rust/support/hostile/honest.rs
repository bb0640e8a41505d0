//! The honest ranks' side of the impostor tests: ops issued on a real
//! engine, whose buffers stay alive until the op is over, and what a
//! failure must look like.

use super::*;
use rustc10d::engine::OpHandle;
use rustc10d::error::Error;
use rustc10d::locks::{level, Mutex};
use rustc10d::ops::{SparseGathered, SparseShape};

/// An op in flight on an honest rank, with the memory it reads and writes.
pub struct Pending {
    handle: OpHandle,
    bufs: Vec<Vec<u8>>,
    sparse: Option<Arc<Mutex<level::SparseGathered, SparseGathered>>>,
    started: Instant,
}

/// How an op ended: its buffers (or what it gathered) on success, and how long it took.
pub struct Outcome {
    pub result: Result<Vec<Vec<u8>>, Error>,
    pub sparse: Option<SparseGathered>,
    pub took: Duration,
}

impl Pending {
    /// Wait for the op, at most `limit`: an op that is not over by then is
    /// a hang, which fails the test (its memory is leaked, since the engine
    /// may still write it). On a thread of its own: a point-to-point op
    /// past its timeout waits, unbounded, for its withdrawal to finish it.
    pub fn finish(self, limit: Duration) -> Outcome {
        let Pending { handle, bufs, sparse, started } = self;
        let (waited, outcome) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = waited.send(handle.wait(Some(limit)));
        });
        let result = match outcome.recv_timeout(limit + Duration::from_secs(5)) {
            Ok(Waited::Done) => Ok(()),
            Ok(Waited::Failed(e)) => Err(e),
            Ok(Waited::TimedOut) | Err(_) => {
                std::mem::forget(bufs);
                panic!("the op did not end within {limit:?}: a hang");
            }
        };
        let took = started.elapsed();
        let sparse = sparse.map(|s| std::mem::take(&mut *s.lock().unwrap()));
        Outcome { result: result.map(|()| bufs), sparse, took }
    }
}

impl Outcome {
    /// The op failed within `within`, with an error that says each of
    /// `says`, and not from a panic (a contained panic reads "internal error").
    pub fn failed_saying(self, within: Duration, says: &[&str]) -> Error {
        let e = match self.result {
            Ok(_) => panic!("the op succeeded; expected an error saying {says:?}"),
            Err(e) => e,
        };
        assert!(!e.message.contains("internal error"), "a panic, not a clear error: {}", e.message);
        for part in says {
            assert!(e.message.contains(part), "the error does not say {part:?}: {}", e.message);
        }
        assert!(self.took < within, "took {:?} (at most {within:?}): {}", self.took, e.message);
        e
    }
}

/// Submit one collective on `e`, whose buffers are `bufs`.
fn submit(
    e: &Engine,
    part: Collective,
    bufs: Vec<Vec<u8>>,
    sparse: Option<Arc<Mutex<level::SparseGathered, SparseGathered>>>,
) -> Pending {
    let started = Instant::now();
    // SAFETY: the buffers `part` points into are `bufs`' heap memory, which
    // `Pending` keeps (moving a Vec does not move it) until the op is over
    // (`finish`), or leaks if it never is.
    let handle = unsafe { e.submit(vec![part], None, None, Box::new(|_| Ok(()))).unwrap() };
    Pending { handle, bufs, sparse, started }
}

/// An all-gather of `block` bytes from every rank (this rank's are all `fill`).
pub fn all_gather(e: &Engine, block: usize, fill: u8) -> Pending {
    let mut input = vec![fill; block];
    let mut outputs: Vec<Vec<u8>> = (0..e.size()).map(|_| vec![0u8; block]).collect();
    let part = Collective::AllGather {
        input: RawBuf::new(input.as_mut_ptr(), block),
        outputs: outputs.iter_mut().map(|o| RawBuf::new(o.as_mut_ptr(), block)).collect(),
        dtype: rustc10d::dtype::BYTES,
    };
    submit(e, part, std::iter::once(input).chain(outputs).collect(), None)
}

/// A sparse all-reduce of one-dimensional tensors of `size` rows (this
/// rank's rows at `rows`, one float64 each).
pub fn sparse_all_reduce(e: &Engine, size: u64, rows: &[i64]) -> Pending {
    let mut indices: Vec<u8> = rows.iter().flat_map(|i| i.to_ne_bytes()).collect();
    let mut values: Vec<u8> = rows.iter().flat_map(|&i| (i as f64).to_ne_bytes()).collect();
    let out = Arc::new(Mutex::new(SparseGathered::default()));
    let part = Collective::AllReduceSparse {
        indices: RawBuf::new(indices.as_mut_ptr(), indices.len()),
        values: RawBuf::new(values.as_mut_ptr(), values.len()),
        shape: SparseShape { sparse_sizes: vec![size], dense_sizes: vec![], value_row: 8 },
        dtype: DType::F64,
        out: out.clone(),
    };
    submit(e, part, vec![indices, values], Some(out))
}

/// A receive of `len` bytes from `from` with `tag`.
pub fn recv(e: &Engine, from: usize, tag: i64, len: usize) -> Pending {
    let mut buf = vec![0u8; len];
    let started = Instant::now();
    // SAFETY: as in `submit`: `Pending` keeps `buf` until the op is over.
    let handle =
        unsafe { e.recv(RawBuf::new(buf.as_mut_ptr(), len), Some(from), tag, None, Box::new(|_| Ok(()))).unwrap() };
    Pending { handle, bufs: vec![buf], sparse: None, started }
}

/// A send of `len` bytes (all `fill`) to `to` with `tag`.
pub fn send(e: &Engine, to: usize, tag: i64, len: usize, fill: u8) -> Pending {
    let mut buf = vec![fill; len];
    let started = Instant::now();
    // SAFETY: as in `submit`: `Pending` keeps `buf` until the op is over.
    let handle =
        unsafe { e.send(RawBuf::new(buf.as_mut_ptr(), len), to, tag, None, None, Box::new(|_| Ok(()))).unwrap() };
    Pending { handle, bufs: vec![buf], sparse: None, started }
}

/// Shut the engine down (its group's connections closed, its worker
/// thread joined), which must end promptly whatever its peer did: a
/// shutdown that hangs fails the test instead of hanging it.
pub fn shut_down(e: Engine) {
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(e);
        let _ = done.send(());
    });
    ended.recv_timeout(Duration::from_secs(10)).expect("the engine's shutdown hung");
}
