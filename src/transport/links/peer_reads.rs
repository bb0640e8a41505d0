//! Letting the ranks of one host read each other's memory
//! (`process_vm_readv`: single copy). Linux allows it between processes of
//! one user unless Yama says otherwise: at `ptrace_scope` 1, Ubuntu's
//! default, only a process's ancestors may, and ranks started by torchrun
//! are siblings. A process may name who else may (`PR_SET_PTRACER`), but
//! only one process, so a rank that wants single copy there allows every
//! process of its user (`PR_SET_PTRACER_ANY`), as Open MPI's and MPICH's
//! cross-memory attach do. That is more than reads: Yama's exception lets
//! such a process ptrace-attach, so it may read and write this process's
//! memory and registers. So it is done only while it is needed: while some
//! group of this process has single copy on and a peer on this host (each
//! such group holds a `PeerReadsGrant`), and undone (`PR_SET_PTRACER` 0)
//! when the last of them is destroyed; the `ptracer_any` setting turns it
//! off. Scopes 2 and 3 need CAP_SYS_PTRACE or forbid it outright: nothing
//! to do there. Either way each rank then tries every peer (`may_read`),
//! and the group's vote decides.

use crate::locks::{level, Mutex};
use crate::transport::links::conn::read_process;
use crate::transport::links::dial::unix_connect;
use crate::transport::links::fdpass::peer_cred;

const SCOPE_FILE: &str = "/proc/sys/kernel/yama/ptrace_scope";

/// What holds for peers' reads of this process while a grant is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerReads {
    /// No Yama, or scope 0: peers of the same user may read already.
    Allowed,
    /// Scope 1: this process lets any process of its user attach to it.
    Opened,
    /// Scope 1 and the prctl failed, or scope 2 or more: peers may not read
    /// (but with CAP_SYS_PTRACE, at scope 2).
    Refused,
}

/// What holds at a `ptrace_scope` (the file's contents, None without
/// Yama), once `set_ptracer_any` (which says whether it worked) is called
/// where that is what it takes.
pub fn at_scope(scope: Option<&str>, set_ptracer_any: impl FnOnce() -> bool) -> PeerReads {
    match scope.map(str::trim) {
        None | Some("0") => PeerReads::Allowed,
        Some("1") if set_ptracer_any() => PeerReads::Opened,
        Some(_) => PeerReads::Refused,
    }
}

/// Whether this process may read the memory of the peer that listens on
/// the abstract Unix socket `name` (its shared-memory endpoint), as the
/// single-copy vote asks. The kernel names the peer's process: connecting
/// gives its pid as this pid namespace sees it (SO_PEERCRED; 0 where it
/// cannot, from another namespace), so no pid goes through the Store. Then
/// ptrace's rules are asked by a read of the peer's page 0, which is never
/// mapped: they are checked before the address (mm/process_vm_access.c),
/// so a fault means they let this process in, EPERM or ESRCH that they do
/// not; and no address of the peer's goes through the Store either. The
/// connection closes at once, before a word is said; the peer's listener,
/// not yet serving, later drops it quietly. Every actual read is checked
/// again, per connection (conn.rs).
pub fn may_read(name: &str) -> bool {
    // At most a second: a listener whose backlog is full (it accepts only once the vote is over) is not waited for.
    let connected = unix_connect(name, std::time::Duration::from_secs(1));
    let Ok(cred) = connected.and_then(|s| peer_cred(&s)) else { return false };
    // SAFETY: geteuid has no preconditions and cannot fail.
    if cred.pid <= 0 || cred.uid != unsafe { libc::geteuid() } {
        return false;
    }
    match read_process(cred.pid, 0, &mut [0u8; 8]) {
        Ok(()) => true, // page 0 is mapped there (vm.mmap_min_addr 0): read all the same
        Err(e) => e.raw_os_error() == Some(libc::EFAULT),
    }
}

/// What the kernel is asked: Yama's scope, and who may attach to this process.
pub trait Yama: Sync {
    /// The contents of the scope file (None without Yama).
    fn scope(&self) -> Option<String>;
    /// Let any process of this user attach (true), or none beyond Yama's
    /// rule (false); whether the kernel took it.
    fn set_ptracer_any(&self, any: bool) -> bool;
}

/// This process's kernel.
pub struct Kernel;

impl Yama for Kernel {
    fn scope(&self) -> Option<String> {
        std::fs::read_to_string(SCOPE_FILE).ok()
    }

    fn set_ptracer_any(&self, any: bool) -> bool {
        let who = if any { libc::PR_SET_PTRACER_ANY } else { 0 };
        // SAFETY: PR_SET_PTRACER takes a pid (or PR_SET_PTRACER_ANY, or 0 for
        // none) and no pointers; it changes only who may attach to this process.
        unsafe { libc::prctl(libc::PR_SET_PTRACER, who, 0, 0, 0) == 0 }
    }
}

/// The groups of a process that let their peers read it, and what was done for them.
pub struct Grants {
    state: Mutex<level::PeerReadsHeld, Held>,
}

struct Held {
    /// Grants alive.
    count: usize,
    /// What the first of them found (and did), while any is alive.
    outcome: Option<PeerReads>,
}

impl Grants {
    pub const fn new() -> Grants {
        Grants { state: Mutex::new(Held { count: 0, outcome: None }) }
    }

    /// A group's grant: the first opens this process to its user's
    /// processes where Yama's scope 1 calls for it.
    pub fn take(&'static self, yama: &'static dyn Yama) -> PeerReadsGrant {
        let mut held = self.state.lock().unwrap();
        held.count += 1;
        let outcome = *held.outcome.get_or_insert_with(|| {
            let scope = yama.scope();
            let outcome = at_scope(scope.as_deref(), || yama.set_ptracer_any(true));
            tracing::debug!(
                "rustc10d: Yama ptrace_scope {:?}: peer reads {outcome:?}",
                scope.as_deref().map(str::trim)
            );
            outcome
        });
        PeerReadsGrant { grants: self, yama, outcome }
    }

    fn release(&self, yama: &dyn Yama) {
        let mut held = self.state.lock().unwrap();
        held.count -= 1;
        if held.count == 0 && held.outcome.take() == Some(PeerReads::Opened) && !yama.set_ptracer_any(false) {
            tracing::warn!("rustc10d: could not undo PR_SET_PTRACER_ANY: processes of this user may still attach");
        }
    }

    /// Groups holding a grant now.
    pub fn holders(&self) -> usize {
        self.state.lock().unwrap().count
    }

    /// Whether this process is open to every process of its user now.
    pub fn opened(&self) -> bool {
        self.state.lock().unwrap().outcome == Some(PeerReads::Opened)
    }
}

impl Default for Grants {
    fn default() -> Self {
        Grants::new()
    }
}

/// This process's grants.
pub static GRANTS: Grants = Grants::new();

/// One group's permission for its peers on this host to read this
/// process's memory; the last one dropped undoes what the first did.
pub struct PeerReadsGrant {
    grants: &'static Grants,
    yama: &'static dyn Yama,
    outcome: PeerReads,
}

impl PeerReadsGrant {
    pub fn outcome(&self) -> PeerReads {
        self.outcome
    }
}

impl Drop for PeerReadsGrant {
    fn drop(&mut self) {
        self.grants.release(self.yama);
    }
}

/// Let this host's other ranks read this process's memory where Yama's
/// scope permits it, for as long as the grant lives (see the module comment).
pub fn let_peers_read() -> PeerReadsGrant {
    GRANTS.take(&Kernel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// This process may always read itself, and a name where no one listens
    /// is no peer to read; neither needs a word through the Store.
    #[test]
    fn may_read_asks_the_kernel_of_the_listening_process() {
        let (_endpoint, name) = crate::transport::links::endpoint::ShmEndpoint::bind(64 << 10).unwrap();
        assert!(may_read(&name), "this process reads itself");
        assert!(!may_read("rustc10d-no-such-endpoint"));
    }

    #[test]
    fn only_scope_one_calls_for_the_prctl() {
        let never = || -> bool { panic!("the prctl called where it is not needed") };
        assert_eq!(at_scope(None, never), PeerReads::Allowed);
        assert_eq!(at_scope(Some("0\n"), never), PeerReads::Allowed);
        assert_eq!(at_scope(Some("1\n"), || true), PeerReads::Opened);
        assert_eq!(at_scope(Some("1\n"), || false), PeerReads::Refused);
        assert_eq!(at_scope(Some("2\n"), never), PeerReads::Refused);
        assert_eq!(at_scope(Some("3"), never), PeerReads::Refused);
    }

    /// A kernel at a given scope that counts what it is asked.
    struct Fake {
        scope: Option<&'static str>,
        opened: AtomicUsize,
        closed: AtomicUsize,
    }

    impl Yama for Fake {
        fn scope(&self) -> Option<String> {
            self.scope.map(str::to_string)
        }
        fn set_ptracer_any(&self, any: bool) -> bool {
            if any { &self.opened } else { &self.closed }.fetch_add(1, Ordering::SeqCst);
            true
        }
    }

    fn fake(scope: Option<&'static str>) -> (&'static Grants, &'static Fake) {
        let kernel = Fake { scope, opened: AtomicUsize::new(0), closed: AtomicUsize::new(0) };
        (Box::leak(Box::new(Grants::new())), Box::leak(Box::new(kernel)))
    }

    #[test]
    fn the_first_grant_opens_and_the_last_one_dropped_closes() {
        let (grants, kernel) = fake(Some("1\n"));
        let calls = || (kernel.opened.load(Ordering::SeqCst), kernel.closed.load(Ordering::SeqCst));
        let a = grants.take(kernel);
        let b = grants.take(kernel);
        assert_eq!((a.outcome(), b.outcome()), (PeerReads::Opened, PeerReads::Opened));
        assert_eq!(calls(), (1, 0), "opened once");
        assert!(grants.opened() && grants.holders() == 2);
        drop(a);
        assert_eq!(calls(), (1, 0), "one group still needs it");
        drop(b);
        assert_eq!(calls(), (1, 1), "closed with the last");
        assert!(!grants.opened() && grants.holders() == 0);
        let c = grants.take(kernel);
        assert_eq!(calls(), (2, 1), "a later group opens it again");
        drop(c);
        assert_eq!(calls(), (2, 2));
    }

    #[test]
    fn where_yama_does_not_call_for_it_nothing_is_opened_or_closed() {
        for scope in [None, Some("0\n"), Some("2\n")] {
            let (grants, kernel) = fake(scope);
            let grant = grants.take(kernel);
            assert_ne!(grant.outcome(), PeerReads::Opened);
            assert!(!grants.opened());
            drop(grant);
            assert_eq!((kernel.opened.load(Ordering::SeqCst), kernel.closed.load(Ordering::SeqCst)), (0, 0));
        }
    }
}
