//! The private `rustc10d._native` module: builds a backend for the Python
//! creator function. The typed, documented API lives in python/rustc10d.

use crate::engine::Engine;
use crate::ffi::{backend_to_python, store_from_python, store_host, Group};
use crate::rendezvous::{connect, GroupConfig, TransportMode};
use crate::stats::Stats;
use crate::transport::Transport;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Logging level for the engine's `tracing` output on stderr (error, warn, info, debug, trace).
pub const ENV_LOG: &str = "RUSTC10D_LOG";

/// What Python may ask of a live group, by group name (`rustc10d.stats()`, `links()`).
struct Watched {
    stats: Weak<Stats>,
    transport: Weak<dyn Transport>,
}

static GROUPS: Mutex<BTreeMap<String, Watched>> = Mutex::new(BTreeMap::new());

fn watched<T>(group_name: &str, f: impl FnOnce(&Watched) -> Option<T>) -> PyResult<T> {
    let groups = GROUPS.lock().unwrap();
    groups
        .get(group_name)
        .and_then(f)
        .ok_or_else(|| PyRuntimeError::new_err(format!("rustc10d: no live rustc10d group named {group_name:?}")))
}

/// Rendezvous through `store` and return a `torch.distributed.Backend`.
#[pyfunction]
fn create_backend(
    py: Python<'_>,
    store: Bound<'_, PyAny>,
    rank: i32,
    size: i32,
    timeout_ms: i64,
    group_name: String,
) -> PyResult<Py<PyAny>> {
    let err = |e: cxx::Exception| PyRuntimeError::new_err(e.what().to_string());
    let store_ref = store_from_python(store.as_ptr() as usize).map_err(err)?;
    let cfg = GroupConfig {
        rank: usize::try_from(rank).map_err(|_| PyRuntimeError::new_err(format!("rustc10d: invalid rank {rank}")))?,
        size: usize::try_from(size).map_err(|_| PyRuntimeError::new_err(format!("rustc10d: invalid size {size}")))?,
        timeout: Duration::from_millis(timeout_ms.max(0) as u64),
        store_host: Some(store_host(&store_ref)),
        transport: TransportMode::from_env().map_err(|e| PyRuntimeError::new_err(e.message))?,
    };
    // Rendezvous can take a while: let other Python threads run meanwhile.
    let (engine, transport) = py
        .detach(|| {
            let mesh: Arc<dyn Transport> = Arc::new(connect(&*store_ref, &cfg)?);
            Ok::<_, crate::error::Error>((Engine::new(mesh.clone(), cfg.timeout)?, Arc::downgrade(&mesh)))
        })
        .map_err(|e| PyRuntimeError::new_err(e.message))?;
    let mut groups = GROUPS.lock().unwrap();
    groups.retain(|_, g| g.stats.strong_count() > 0);
    groups.insert(group_name, Watched { stats: Arc::downgrade(&engine.stats()), transport });
    drop(groups);
    let ptr = backend_to_python(Box::new(Group(engine)), rank, size).map_err(err)?;
    Ok(unsafe { Bound::from_owned_ptr(py, ptr as *mut pyo3::ffi::PyObject) }.unbind())
}

/// {op: {count, failed, bytes, seconds, max_seconds}} of a live group.
#[pyfunction]
fn stats(py: Python<'_>, group_name: &str) -> PyResult<Py<PyDict>> {
    let s = watched(group_name, |g| g.stats.upgrade())?;
    let out = PyDict::new(py);
    for (op, s) in s.snapshot() {
        let d = PyDict::new(py);
        d.set_item("count", s.count)?;
        d.set_item("failed", s.failed)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("seconds", s.total.as_secs_f64())?;
        d.set_item("max_seconds", s.max.as_secs_f64())?;
        out.set_item(op, d)?;
    }
    Ok(out.unbind())
}

/// {peer rank: "shm" | "tcp"} for the peers this rank has connected with.
#[pyfunction]
fn links(py: Python<'_>, group_name: &str) -> PyResult<Py<PyDict>> {
    let t = watched(group_name, |g| g.transport.upgrade())?;
    let out = PyDict::new(py);
    for peer in (0..t.size()).filter(|&p| p != t.rank()) {
        if let Some(kind) = t.link_kind(peer) {
            out.set_item(peer, kind)?;
        }
    }
    Ok(out.unbind())
}

fn init_logging() {
    let level = match std::env::var(ENV_LOG).unwrap_or_default().to_ascii_lowercase().as_str() {
        "error" => tracing::Level::ERROR,
        "info" => tracing::Level::INFO,
        "debug" => tracing::Level::DEBUG,
        "trace" => tracing::Level::TRACE,
        _ => tracing::Level::WARN,
    };
    let _ = tracing_subscriber::fmt().with_max_level(level).with_writer(std::io::stderr).try_init();
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add_function(wrap_pyfunction!(create_backend, m)?)?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(links, m)?)?;
    m.add("TORCH_VERSION", env!("RUSTC10D_TORCH_VERSION"))?;
    // Which of the torch APIs that differ across releases this build found (build.rs).
    let features = PyDict::new(m.py());
    for pair in env!("RUSTC10D_TORCH_FEATURES").split(',') {
        let (name, bit) = pair.split_once('=').expect("build.rs writes name=0|1");
        features.set_item(name, bit == "1")?;
    }
    m.add("TORCH_FEATURES", features)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
