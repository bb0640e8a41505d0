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

/// What a `ptrace_scope` (the file's contents, None without Yama) calls for:
/// whether to call `PR_SET_PTRACER_ANY`, or what holds without it.
pub fn for_scope(scope: Option<&str>) -> Result<(), PeerReads> {
    match scope.map(str::trim) {
        None | Some("0") => Err(PeerReads::Allowed),
        Some("1") => Ok(()),
        Some(_) => Err(PeerReads::Refused),
    }
}

/// Let this host's other ranks read this process's memory where Yama's
/// scope permits it (see the module comment). Done once per process.
pub fn allow_peer_reads() -> PeerReads {
    static DONE: OnceLock<PeerReads> = OnceLock::new();
    *DONE.get_or_init(|| {
        let scope = std::fs::read_to_string(SCOPE_FILE).ok();
        let outcome = match for_scope(scope.as_deref()) {
            Err(holds) => holds,
            Ok(()) => {
                let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
                if r == 0 {
                    PeerReads::Opened
                } else {
                    PeerReads::Refused
                }
            }
        };
        tracing::debug!("rustc10d: Yama ptrace_scope {:?}: peer reads {outcome:?}", scope.as_deref().map(str::trim));
        outcome
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_scope_one_calls_for_the_prctl() {
        assert_eq!(for_scope(None), Err(PeerReads::Allowed));
        assert_eq!(for_scope(Some("0\n")), Err(PeerReads::Allowed));
        assert_eq!(for_scope(Some("1\n")), Ok(()));
        assert_eq!(for_scope(Some("2\n")), Err(PeerReads::Refused));
        assert_eq!(for_scope(Some("3")), Err(PeerReads::Refused));
    }

    /// Whatever this machine's Yama says, asking is harmless and answers
    /// the same twice; where peers may read already, nothing is changed.
    #[test]
    fn allowing_is_done_once_and_matches_the_scope() {
        let first = allow_peer_reads();
        assert_eq!(allow_peer_reads(), first);
        let scope = std::fs::read_to_string(SCOPE_FILE).ok();
        match for_scope(scope.as_deref()) {
            Err(holds) => assert_eq!(first, holds),
            Ok(()) => assert_ne!(first, PeerReads::Allowed),
        }
    }
}
