//! The private `rustc10d._native` module: builds a backend for the Python
//! creator function. The typed, documented API lives in python/rustc10d.

use crate::engine::Engine;
use crate::ffi::{backend_to_python, store_from_python, store_host, Group};
use crate::rendezvous::{connect, GroupConfig};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::sync::Arc;
use std::time::Duration;

/// Logging level for the engine's `tracing` output on stderr (error, warn, info, debug, trace).
pub const ENV_LOG: &str = "RUSTC10D_LOG";

/// Rendezvous through `store` and return a `torch.distributed.Backend`.
#[pyfunction]
fn create_backend(py: Python<'_>, store: Bound<'_, PyAny>, rank: i32, size: i32, timeout_ms: i64) -> PyResult<Py<PyAny>> {
    let err = |e: cxx::Exception| PyRuntimeError::new_err(e.what().to_string());
    let store_ref = store_from_python(store.as_ptr() as usize).map_err(err)?;
    let cfg = GroupConfig {
        rank: usize::try_from(rank).map_err(|_| PyRuntimeError::new_err(format!("rustc10d: invalid rank {rank}")))?,
        size: usize::try_from(size).map_err(|_| PyRuntimeError::new_err(format!("rustc10d: invalid size {size}")))?,
        timeout: Duration::from_millis(timeout_ms.max(1) as u64),
        store_host: Some(store_host(&store_ref)),
    };
    // Rendezvous can take a while: let other Python threads run meanwhile.
    let engine = py
        .detach(|| connect(&*store_ref, &cfg).map(|mesh| Engine::new(Arc::new(mesh), cfg.timeout)))
        .map_err(|e| PyRuntimeError::new_err(e.message))?;
    let ptr = backend_to_python(Box::new(Group(engine)), rank, size, timeout_ms).map_err(err)?;
    Ok(unsafe { Bound::from_owned_ptr(py, ptr as *mut pyo3::ffi::PyObject) }.unbind())
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
    m.add("TORCH_VERSION", env!("RUSTC10D_TORCH_VERSION"))?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
