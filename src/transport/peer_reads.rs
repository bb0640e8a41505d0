//! Letting the ranks of one host read each other's memory
//! (`process_vm_readv`: single copy). Linux allows it between processes of
//! one user unless Yama says otherwise: at `ptrace_scope` 1, Ubuntu's
//! default, only a process's ancestors may, and ranks started by torchrun
//! are siblings. A process may name who else may (`PR_SET_PTRACER`), but
//! only one process, so a rank that wants single copy allows every process
//! of its user (`PR_SET_PTRACER_ANY`), as Open MPI's and MPICH's
//! cross-memory attach do. Scopes 2 and 3 need CAP_SYS_PTRACE or forbid it
//! outright: nothing to do there. Either way each rank then reads every
//! peer's probe, and the group's vote decides.

use std::sync::OnceLock;

const SCOPE_FILE: &str = "/proc/sys/kernel/yama/ptrace_scope";

/// What this process did about Yama, once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerReads {
    /// No Yama, or scope 0: peers of the same user may read already.
    Allowed,
    /// Scope 1: this process now lets any process of its user read it.
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

/// Let this host's other ranks read this process's memory where Yama's
/// scope permits it (see the module comment). Done once per process.
pub fn allow_peer_reads() -> PeerReads {
    static DONE: OnceLock<PeerReads> = OnceLock::new();
    *DONE.get_or_init(|| {
        let scope = std::fs::read_to_string(SCOPE_FILE).ok();
        // SAFETY: prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) takes integers only
        // and changes which processes may ptrace this one; no memory of ours.
        let outcome = at_scope(scope.as_deref(), || unsafe {
            libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) == 0
        });
        tracing::debug!("rustc10d: Yama ptrace_scope {:?}: peer reads {outcome:?}", scope.as_deref().map(str::trim));
        outcome
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Whatever this machine's Yama says, asking is harmless and answers
    /// the same twice; where peers may read already, nothing is changed.
    #[test]
    fn allowing_is_done_once_and_matches_the_scope() {
        let first = allow_peer_reads();
        assert_eq!(allow_peer_reads(), first);
        let scope = std::fs::read_to_string(SCOPE_FILE).ok();
        match scope.as_deref().map(str::trim) {
            Some("1") => assert_ne!(first, PeerReads::Allowed),
            _ => assert_eq!(first, at_scope(scope.as_deref(), || unreachable!())),
        }
    }
}
