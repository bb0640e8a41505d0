//! The process's I/O thread lives exactly as long as some group uses it (a
//! file of its own: tests in one file share a process, and their groups).
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../support/threads/mod.rs"]
mod threads;

use rustc10d::transport::links::reactor::Reactor;
use threads::*;

#[test]
fn the_io_thread_ends_with_the_last_group_even_if_it_is_not_dropped() {
    for mode in BOTH {
        let engines = group_via(mode, 3, Duration::from_secs(10));
        assert!(Reactor::running());
        std::thread::scope(|s| {
            for (rank, e) in engines.iter().enumerate() {
                s.spawn(move || {
                    let mut v = vec![rank as i32; 1000];
                    wait_ok(all_reduce(e, raw(&mut v), DType::I32, ReduceOp::Sum));
                    assert_eq!(v[0], 3, "0 + 1 + 2");
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
