//! The process's I/O thread lives exactly as long as some group uses it (a
//! file of its own: tests in one file share a process, and their groups).

use rustc10d::algorithms::RawBuf;
use rustc10d::config::{Config, TransportMode};
use rustc10d::dtype::{DType, ReduceOp};
use rustc10d::engine::{Engine, Waited};
use rustc10d::ops::{Collective, Reduction};
use rustc10d::rendezvous::{connect, MemStore, Member};
use rustc10d::transport::reactor::Reactor;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn group(world: usize, transport: TransportMode) -> Vec<Engine> {
    let store = Arc::new(MemStore::default());
    let timeout = Duration::from_secs(10);
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let cfg = Config { transport, ..Config::default() };
                let member = Member { rank, size: world, timeout, store_host: Some("127.0.0.1".into()) };
                let mesh = connect(&*store, &member, &cfg).unwrap();
                Engine::new(Arc::new(mesh), &cfg, timeout).unwrap()
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn the_io_thread_ends_with_the_last_group_even_if_it_is_not_dropped() {
    for mode in [TransportMode::Tcp, TransportMode::Shm] {
        let engines = group(3, mode);
        assert!(Reactor::running());
        std::thread::scope(|s| {
            for (rank, e) in engines.iter().enumerate() {
                s.spawn(move || {
                    let mut v = vec![rank as i32; 1000];
                    let buf = RawBuf::new(v.as_mut_ptr().cast(), 4000);
                    let part = Collective::AllReduce { buf, red: Reduction::new(DType::I32, ReduceOp::Sum) };
                    let h = unsafe { e.submit(vec![part], None, None, Box::new(|_| {})).unwrap() };
                    assert_eq!(h.wait(None), Waited::Done);
                });
            }
        });
        // Shut down (destroy_process_group) while torch may still hold the objects.
        for e in &engines {
            e.shutdown();
        }
        let t0 = Instant::now();
        while Reactor::running() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!Reactor::running(), "{mode:?}: the I/O thread outlived its groups");
        drop(engines);
    }
}
