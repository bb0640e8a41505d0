//! The process's limit on open file descriptors. Each group holds a few per
//! peer (its connections and their shared memory) besides its listeners, so a
//! job of many groups outgrows the usual soft limit of 1,024 long before the
//! hard one: the first group of a process raises the soft limit to the hard
//! one (as Go's runtime does at start), and an error for running out names
//! the limit and how to raise it.

use crate::locks::{level, Mutex};
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::OnceLock;

/// The soft and hard limits, and the soft one before this process raised it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub soft: u64,
    pub hard: u64,
    pub was: u64,
}

fn get() -> io::Result<libc::rlimit> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`, a live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// The soft and hard limits now.
pub fn current() -> Option<(u64, u64)> {
    get().ok().map(|r| (r.rlim_cur, r.rlim_max))
}

/// A descriptor held in reserve for a listener that runs out (`with_spare`).
static SPARE: Mutex<level::SpareFd, Option<OwnedFd>> = Mutex::new(None);

/// Hold a spare descriptor, unless one is held already (each listener's
/// start calls it, so that the process has one while it listens).
pub fn keep_spare() {
    let mut spare = SPARE.lock().unwrap();
    if spare.is_none() {
        *spare = File::open("/dev/null").ok().map(OwnedFd::from);
    }
}

/// Run `f` with the spare descriptor closed, then hold one again: so that a
/// listener out of descriptors can still take the connection waiting for it,
/// to tell its dialler why it refuses it (as nginx and libev do). `f` must
/// close what it opens. None where there is no spare (it could not be opened
/// again after the last use: the process is still out).
pub fn with_spare<T>(f: impl FnOnce() -> T) -> Option<T> {
    let mut spare = SPARE.lock().unwrap();
    drop(spare.take()?);
    let t = f();
    *spare = File::open("/dev/null").ok().map(OwnedFd::from);
    Some(t)
}

/// Raise the soft limit to the hard one, once per process; the limits after.
/// A limit that cannot be read or raised is left as it is.
pub fn raise_soft_limit() -> Option<Limits> {
    static RAISED: OnceLock<Option<Limits>> = OnceLock::new();
    *RAISED.get_or_init(|| {
        let mut r = get().ok()?;
        let was = r.rlim_cur as u64;
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            // SAFETY: setrlimit reads one rlimit from `raised`, a live local.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                r = raised;
            } else {
                tracing::debug!("rustc10d: could not raise the open-file limit: {}", io::Error::last_os_error());
            }
        }
        Some(Limits { soft: r.rlim_cur as u64, hard: r.rlim_max as u64, was })
    })
}

/// What to add to the message of `e` if it says the process (EMFILE) or the
/// system (ENFILE) is out of file descriptors.
pub fn hint(e: &io::Error) -> Option<String> {
    match e.raw_os_error()? {
        libc::EMFILE => Some(out_of_descriptors("this process", current())),
        libc::ENFILE => Some("the system is out of file descriptors (fs.file-max)".to_string()),
        _ => None,
    }
}

/// That `who` has run out of descriptors at `limits` (soft, hard; None:
/// unknown), and how to raise them: for this process's errors, and for the
/// refusal a peer out of descriptors sends (frame.rs).
pub fn out_of_descriptors(who: &str, limits: Option<(u64, u64)>) -> String {
    let limit = limits.map_or_else(
        || "its limit".to_string(),
        |(soft, hard)| format!("its limit (RLIMIT_NOFILE: soft {soft}, hard {hard})"),
    );
    format!(
        "{who} has as many files open as {limit} allows; each rustc10d group holds about 3 per peer: raise the \
         limit (`ulimit -n`, or the hard one in /etc/security/limits.conf or the container's --ulimit nofile), \
         or make fewer groups"
    )
}

/// `e`'s message, with `hint` where it applies.
pub fn describe(e: &io::Error) -> String {
    match hint(e) {
        Some(h) => format!("{e}: {h}"),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_out_of_descriptors_names_the_limit() {
        let said = describe(&io::Error::from_raw_os_error(libc::EMFILE));
        assert!(said.contains("RLIMIT_NOFILE: soft "), "{said}");
        assert!(said.contains("ulimit -n"), "{said}");
        assert!(describe(&io::Error::from_raw_os_error(libc::ENFILE)).contains("fs.file-max"));
        assert_eq!(describe(&io::Error::from_raw_os_error(libc::ECONNREFUSED)), "Connection refused (os error 111)");
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one_once() {
        let first = raise_soft_limit().expect("limits readable");
        assert!(first.soft >= first.was);
        let now = get().unwrap();
        assert_eq!(now.rlim_cur as u64, first.soft);
        assert_eq!(raise_soft_limit(), Some(first), "once per process");
    }
}
