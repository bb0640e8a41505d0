//! What a backend keeps to re-form its group with other processes (torch's
//! `get_reconfigure_handle` and `reconfigure`), and the forming itself.

use super::group::member;
use super::{Formed, Group, GroupStore};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::membership::{place, Handle};
use crate::rendezvous::Store;
use crate::transport::links::auth::fill_random;
use std::sync::atomic::{AtomicI64, Ordering};

/// A backend's identity across configurations and what a new one needs:
/// its settings, its Store, its timeout. The shim holds one for as long as
/// the backend lives, formed or not (`init_process_group(...,
/// enable_reconfigure=True)` makes a backend with no group until its first
/// reconfigure).
pub struct Membership {
    process: u64,
    uuid: AtomicI64,
    cfg: Config,
    store: GroupStore,
    timeout_ms: AtomicI64,
}

impl Membership {
    pub fn new(store: GroupStore, cfg: Config, timeout_ms: i64) -> Membership {
        let mut process = [0u8; 8];
        // A clash of 64 random bits among one group's handles is out of reach;
        // without getrandom, the process id and the time tell processes apart.
        if fill_random(&mut process).is_err() {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            process = ((std::process::id() as u64) << 32 ^ nanos.as_nanos() as u64).to_le_bytes();
        }
        Membership {
            process: u64::from_le_bytes(process),
            uuid: AtomicI64::new(-1),
            cfg,
            store,
            timeout_ms: AtomicI64::new(timeout_ms),
        }
    }

    /// This backend's handle while it has rank `rank`.
    fn handle(&self, rank: i32) -> Handle {
        Handle { rank: rank.into(), uuid: self.uuid.load(Ordering::SeqCst), process: self.process }
    }

    pub(crate) fn reconfigure_handle(&self, rank: i32) -> String {
        self.handle(rank).to_string()
    }

    pub(crate) fn cuda_allowed(&self) -> bool {
        self.cfg.cuda
    }

    /// Config::cuda_wait is `stream`: CUDA ops complete in stream order.
    pub(crate) fn stream_ordered(&self) -> bool {
        self.cfg.cuda_wait == crate::config::CudaWait::Stream
    }

    pub(crate) fn test_staging(&self) -> bool {
        self.cfg.test_staging
    }

    pub(crate) fn timeout_ms(&self) -> i64 {
        self.timeout_ms.load(Ordering::SeqCst)
    }

    pub(crate) fn set_timeout(&self, timeout_ms: i64) {
        self.timeout_ms.store(timeout_ms, Ordering::SeqCst);
    }

    /// Whether `handles` place this backend, at rank `rank` now, somewhere.
    #[allow(clippy::ptr_arg)] // the bridge passes a rust::Vec
    pub(crate) fn check_handles(&self, rank: i32, handles: &Vec<String>, ordered: bool) -> Result<()> {
        let check = || place(&self.handle(rank), handles, ordered).map(|_| ());
        crate::panics::contain(format_args!("reconfigure's handles on rank {rank}"), check).and_then(|r| r)
    }

    /// The group of the processes whose handles are `handles`, this one at
    /// rank `rank` now: every member finds its place in them alike, then
    /// they meet through the Store under a namespace of `uuid`'s own, with
    /// connections of their own and this backend's settings. `timeout_ms`
    /// below 0: the backend's timeout. Nothing changes here on a failure.
    pub(crate) fn reconfigure(
        &self,
        rank: i32,
        uuid: i64,
        handles: Vec<String>,
        ordered: bool,
        timeout_ms: i64,
        group_name: &str,
    ) -> Box<Formed> {
        let formed = || -> Result<Box<Group>> {
            let place = place(&self.handle(rank), &handles, ordered)?;
            let join_ms = if timeout_ms < 0 { self.timeout_ms() } else { timeout_ms };
            let store = self.store.within(&format!("rustc10d/reconfigure/{uuid}"));
            // Every member counts itself in: a count past the size is a uuid some
            // earlier configuration met under (here or elsewhere), whose keys would
            // mislead this one.
            if store.add("members", 1)? > place.size as i64 {
                return Err(Error::invalid(format!(
                    "rustc10d: reconfigure uuid {uuid} was already used: pass a new one"
                )));
            }
            let member = member(place.rank, place.size, join_ms, &store);
            let group = Group::join(store, &member, self.cfg.clone())
                .map_err(|e| e.context(format_args!("rustc10d: reconfigure {uuid} failed on rank {rank}")))?;
            // The timeout given is the reconfigure's; the group's ops keep the backend's, as in Gloo.
            group.set_timeout(self.timeout_ms());
            crate::python::watch(group_name, &group);
            self.uuid.store(uuid, Ordering::SeqCst);
            Ok(Box::new(group))
        };
        let formed = crate::panics::contain(format_args!("reconfigure {uuid} on rank {rank}"), formed).and_then(|r| r);
        Box::new(Formed(formed))
    }
}

impl Group {
    /// What the shim keeps to re-form this group later.
    pub(crate) fn membership(&self) -> Box<Membership> {
        Box::new(Membership::new(self.store.again(), self.cfg.clone(), self.timeout_ms()))
    }
}
