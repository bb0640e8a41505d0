//! The private `rustc10d._native` module: builds a backend for the Python
//! creator function. The typed, documented API lives in python/rustc10d.

use crate::config::{self, Config, LogLevel};
use crate::error::{Error, ErrorKind};
use crate::ffi::{
    backend_to_python, store_from_python, store_host, unformed_backend_to_python, Group, GroupStore, Membership,
};
use crate::locks::{level, Mutex};
use crate::rendezvous::{self, Member};
use crate::stats::Stats;
use crate::transport::Transport;
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// What Python may ask of a live group, by group name (`rustc10d.stats()`,
/// `links()`), and what a new group needs to share its connections.
struct Watched {
    stats: Weak<Stats>,
    transport: Weak<dyn Transport>,
    cfg: Config,
}

static GROUPS: Mutex<level::WatchedGroups, BTreeMap<String, Watched>> = Mutex::new(BTreeMap::new());

fn watched<T>(group_name: &str, f: impl FnOnce(&Watched) -> Option<T>) -> PyResult<T> {
    let groups = GROUPS.lock().unwrap();
    groups
        .get(group_name)
        .and_then(f)
        .ok_or_else(|| PyRuntimeError::new_err(format!("rustc10d: no live rustc10d group named {group_name:?}")))
}

/// Let Python ask about `group` by its name (a group made by torch's split
/// comes here from the shim, not through `create_backend`).
pub(crate) fn watch(group_name: &str, group: &Group) {
    *group.name.lock().unwrap() = group_name.to_string();
    let mut groups = GROUPS.lock().unwrap();
    groups.retain(|_, g| g.stats.strong_count() > 0);
    let watched = Watched {
        stats: Arc::downgrade(&group.engine.stats()),
        transport: group.engine.transport(),
        cfg: group.cfg.clone(),
    };
    groups.insert(group_name.to_string(), watched);
}

/// The Python exception for an error at init, as torch raises its own: a bad
/// setting is a ValueError, a rendezvous that timed out a DistStoreError, a
/// peer that cannot be reached a DistNetworkError.
fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let dist = |name: &str| -> PyErr {
        let made = py
            .import("torch.distributed")
            .and_then(|m| m.getattr(name))
            .and_then(|cls| cls.call1((e.message.clone(),)))
            .map(PyErr::from_value);
        made.unwrap_or_else(|err| err)
    };
    match e.kind {
        ErrorKind::InvalidArgument => PyValueError::new_err(e.message),
        ErrorKind::Unsupported => PyNotImplementedError::new_err(e.message),
        ErrorKind::Timeout => dist("DistStoreError"),
        ErrorKind::PeerLost | ErrorKind::Io => dist("DistNetworkError"),
        ErrorKind::Aborted | ErrorKind::Mismatch | ErrorKind::Resource => dist("DistBackendError"),
    }
}

/// Group `name` of `members` (ranks of the live group named `owner`) as a
/// channel on `owner`'s connections, with `owner`'s settings; None where
/// that group is gone or has no connections to share: the new group then
/// opens its own, as every member does alike. A group that has connections
/// but cannot share them (shut down) is an error: falling back here alone
/// would leave this rank waiting in the Store for members that took the
/// channel, until the timeout.
fn channel_of(
    owner: &str,
    name: &str,
    members: &[usize],
    member: &Member,
) -> crate::error::Result<Option<(Arc<dyn Transport>, Config)>> {
    let owner_of = GROUPS.lock().unwrap().get(owner).and_then(|o| Some((o.transport.upgrade()?, o.cfg.clone())));
    let Some((transport, cfg)) = owner_of else { return Ok(None) };
    let Some(opened) = transport.open_channel(name, members, member.timeout) else { return Ok(None) };
    let channel = opened?;
    if channel.rank() != member.rank {
        return Err(Error::invalid(format!(
            "rustc10d: group {name:?}: torch gives this process rank {}, its ranks in group {owner:?} give {}",
            member.rank,
            channel.rank()
        )));
    }
    Ok(Some((channel, cfg)))
}

/// Rendezvous through `store` and return a `torch.distributed.Backend`.
/// `options`: the settings of rustc10d.Options that were given, as text.
/// `share`: the name of the live group whose connections this one shares,
/// where it can (see `channel_of`), and its rank of each of this group's
/// ranks; "": connections of its own.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn create_backend(
    py: Python<'_>,
    store: Bound<'_, PyAny>,
    rank: i32,
    size: i32,
    timeout_ms: i64,
    group_name: String,
    options: BTreeMap<String, String>,
    share: String,
    members: Vec<usize>,
    unformed: bool,
) -> PyResult<Py<PyAny>> {
    let err = |e: cxx::Exception| PyRuntimeError::new_err(e.what().to_string());
    // SAFETY: `store` is a live Python object (bound to `py`, so the GIL is
    // held) for the whole call; the shim casts it to a c10d::Store and
    // throws (an Err here) if it is not one.
    let store_ref = unsafe { store_from_python(store.as_ptr() as usize) }.map_err(err)?;
    let member = Member {
        rank: usize::try_from(rank).map_err(|_| PyValueError::new_err(format!("rustc10d: invalid rank {rank}")))?,
        size: usize::try_from(size).map_err(|_| PyValueError::new_err(format!("rustc10d: invalid size {size}")))?,
        timeout: Duration::from_millis(timeout_ms.max(0) as u64),
        store_host: Some(store_host(&store_ref)),
    };
    // enable_reconfigure: no rendezvous, no connection until the first reconfigure.
    if unformed {
        let cfg = Config::from_env(&options).map_err(|e| to_py(py, e))?;
        let membership = Membership::new(GroupStore::new(store_ref).map_err(|e| to_py(py, e))?, cfg, timeout_ms);
        let ptr = unformed_backend_to_python(Box::new(membership), rank, size).map_err(err)?;
        // SAFETY: as below, a new reference to the backend's Python object; the GIL is held.
        return Ok(unsafe { Bound::from_owned_ptr(py, ptr as *mut pyo3::ffi::PyObject) }.unbind());
    }
    // Rendezvous can take a while: let other Python threads run meanwhile.
    let group = py
        .detach(|| {
            let shared = (!share.is_empty() && members.len() == member.size)
                .then(|| channel_of(&share, &group_name, &members, &member))
                .transpose()?
                .flatten();
            if let Some((channel, cfg)) = shared {
                return Group::over(channel, GroupStore::new(store_ref)?, cfg, member.timeout);
            }
            // A rank that cannot take part tells the others, so that they fail now too.
            let cfg = Config::from_env(&options)
                .inspect_err(|e| rendezvous::refuse(&*store_ref, &member, Config::secret_from_env().as_deref(), e))?;
            Group::join(GroupStore::new(store_ref)?, &member, cfg)
        })
        // A peer's loss during rendezvous comes as the transport says it
        // ("rank 3 ... closed its connection"): say whose group it was.
        .map_err(|e| {
            let e = if e.message.starts_with("rustc10d") {
                e
            } else {
                e.context(format_args!("rustc10d: rank {rank} could not join the process group"))
            };
            to_py(py, e)
        })?;
    watch(&group_name, &group);
    let ptr = backend_to_python(Box::new(group), rank, size).map_err(err)?;
    // SAFETY: the shim returns a new reference (py::object::release) to the
    // backend's Python object, which this takes over; the GIL is held.
    Ok(unsafe { Bound::from_owned_ptr(py, ptr as *mut pyo3::ffi::PyObject) }.unbind())
}

/// {op: {count, failed, bytes, seconds, max_seconds, copied_bytes, wakeups, early_bytes}} of a live group.
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
        d.set_item("copied_bytes", s.copied_bytes)?;
        d.set_item("wakeups", s.wakeups)?;
        d.set_item("early_bytes", s.early_bytes)?;
        out.set_item(op.name(), d)?;
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

/// {peer rank: connections collectives send to it on} for the peers this rank has connected with.
#[pyfunction]
fn connections(py: Python<'_>, group_name: &str) -> PyResult<Py<PyDict>> {
    let t = watched(group_name, |g| g.transport.upgrade())?;
    let out = PyDict::new(py);
    for peer in (0..t.size()).filter(|&p| p != t.rank()) {
        match t.lanes(peer) {
            0 => {}
            n => out.set_item(peer, n)?,
        }
    }
    Ok(out.unbind())
}

/// Whether every peer's count in `connections` is final: with nsocks=auto,
/// once this rank has measured enough large sends to it (for tests).
#[pyfunction]
fn connections_settled(group_name: &str) -> PyResult<bool> {
    let t = watched(group_name, |g| g.transport.upgrade())?;
    Ok((0..t.size()).filter(|&p| p != t.rank()).all(|p| t.lanes_settled(p)))
}

/// {closed, numbers, given_up, names}: what the process keeps about the
/// groups a live group's connections carried (tests of bounded growth).
#[pyfunction]
fn retained(py: Python<'_>, group_name: &str) -> PyResult<Py<PyDict>> {
    let r = watched(group_name, |g| g.transport.upgrade())?.retained();
    let out = PyDict::new(py);
    for (name, n) in [("closed", r.closed), ("numbers", r.numbers), ("given_up", r.given_up), ("names", r.names)] {
        out.set_item(name, n)?;
    }
    out.set_item("early_bytes", r.early_bytes)?;
    Ok(out.unbind())
}

/// stderr logging, once per process, at RUSTC10D_LOG's level (a bad value
/// logs at the default level here, and fails init_process_group with Config's error).
fn init_logging() {
    let level = std::env::var("RUSTC10D_LOG").ok().and_then(|v| config::log_level(&v).ok());
    let level = match level.unwrap_or(Config::default().log) {
        LogLevel::Error => tracing::Level::ERROR,
        LogLevel::Warn => tracing::Level::WARN,
        LogLevel::Info => tracing::Level::INFO,
        LogLevel::Debug => tracing::Level::DEBUG,
        LogLevel::Trace => tracing::Level::TRACE,
    };
    let _ = tracing_subscriber::fmt().with_max_level(level).with_writer(std::io::stderr).try_init();
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add_function(wrap_pyfunction!(create_backend, m)?)?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(links, m)?)?;
    m.add_function(wrap_pyfunction!(connections, m)?)?;
    m.add_function(wrap_pyfunction!(connections_settled, m)?)?;
    m.add_function(wrap_pyfunction!(retained, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
