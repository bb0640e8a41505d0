//! What the socket tests share: W ranks as threads of one process,
//! rendezvous through an in-memory Store, real TCP sockets on loopback or
//! real shared-memory segments (threads of one process share a host too).
//! Each test file uses part of it.
#![allow(dead_code, unused_imports)]

pub use rustc10d::config::{Config, TransportMode};
pub use rustc10d::dtype::{DType, ReduceOp};
pub use rustc10d::engine::{Engine, OpHandle, Waited};
pub use rustc10d::error::Error;
pub use rustc10d::fault::Faults;
pub use rustc10d::ops::RawBuf;
pub use rustc10d::ops::{Collective, OpKind, Reduction};
pub use rustc10d::rendezvous::{connect, MemStore, Member, Store};
pub use std::sync::{Arc, Mutex};
pub use std::time::{Duration, Instant};

pub const BOTH: [TransportMode; 2] = [TransportMode::Tcp, TransportMode::Shm];

pub fn group(world: usize, timeout: Duration) -> Vec<Engine> {
    group_via(TransportMode::Auto, world, timeout)
}

pub fn group_via(transport: TransportMode, world: usize, timeout: Duration) -> Vec<Engine> {
    group_with(world, timeout, Config { transport, ..Config::default() })
}

/// Small segments, so that modest buffers take many pipelined steps.
pub fn group_segmented(transport: TransportMode, world: usize) -> Vec<Engine> {
    group_with(world, Duration::from_secs(10), Config { transport, segment_bytes: 64, ..Config::default() })
}

/// `faults` in RUSTC10D_FAULT's grammar.
pub fn group_with_faults(world: usize, timeout: Duration, faults: &'static str) -> Vec<Engine> {
    group_with(world, timeout, Config { faults: Arc::new(Faults::parse(faults).unwrap()), ..Config::default() })
}

pub fn group_with(world: usize, timeout: Duration, cfg: Config) -> Vec<Engine> {
    group_on(Arc::new(MemStore::default()), world, timeout, "127.0.0.1", cfg)
}

pub fn member(rank: usize, size: usize, timeout: Duration, host: &str) -> Member {
    Member { rank, size, timeout, store_host: Some(host.into()) }
}

/// W ranks as threads rendezvousing through `store`, advertising the route to `host`.
pub fn group_on(store: Arc<MemStore>, world: usize, timeout: Duration, host: &'static str, cfg: Config) -> Vec<Engine> {
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, cfg) = (store.clone(), cfg.clone());
            std::thread::spawn(move || {
                let mesh = Arc::new(connect(&*store, &member(rank, world, timeout, host), &cfg).unwrap());
                Engine::new(mesh, &cfg, timeout).unwrap()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Run `f(rank, engine)` on every rank at once.
pub fn on_all<T: Send>(engines: &[Engine], f: impl Fn(usize, &Engine) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = engines
            .iter()
            .enumerate()
            .map(|(r, e)| {
                let f = &f;
                s.spawn(move || f(r, e))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

pub fn raw<T>(v: &mut [T]) -> RawBuf {
    RawBuf { ptr: v.as_mut_ptr().cast(), len: std::mem::size_of_val(v) }
}

pub fn noop() -> rustc10d::status::Finisher {
    Box::new(|_| Ok(()))
}

pub fn wait_ok(h: OpHandle) {
    assert_eq!(h.wait(None), Waited::Done);
}

pub fn run(e: &Engine, part: Collective) -> OpHandle {
    // SAFETY: test code: every caller of `run` keeps the op's buffers alive and
    // untouched until it has waited for the handle (the tests do, most
    // with `wait_ok` on the spot).
    unsafe { e.submit(vec![part], None, None, noop()).unwrap() }
}

pub fn all_reduce(e: &Engine, buf: RawBuf, dtype: DType, op: ReduceOp) -> OpHandle {
    run(e, Collective::AllReduce { buf, red: Reduction::new(dtype, op) })
}

pub fn wait_ok_ref(h: &OpHandle) {
    assert_eq!(h.wait(None), Waited::Done);
}
