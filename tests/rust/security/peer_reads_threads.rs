//! When a rank lets the processes of its user attach to it (Yama's
//! PR_SET_PTRACER_ANY, for single copy; src/transport/links/peer_reads.rs): only
//! while a group with single copy has a peer on its host, and no longer once
//! the last such group is destroyed. The count of groups that hold it is the
//! process's, so this file is a test binary of its own.

#[path = "../support/threads/mod.rs"]
mod threads;

use rustc10d::transport::links::peer_reads::GRANTS;
use threads::*;

const SCOPE_FILE: &str = "/proc/sys/kernel/yama/ptrace_scope";

fn yama_scope() -> Option<String> {
    std::fs::read_to_string(SCOPE_FILE).ok().map(|s| s.trim().to_string())
}

fn config(transport: TransportMode) -> Config {
    Config { transport, ..Config::default() }
}

/// Every rank of a W-rank group is a thread of this process: each holds the
/// permission (or not) for its group.
#[test]
fn only_groups_with_a_same_host_peer_and_single_copy_hold_the_ptracer() {
    let timeout = Duration::from_secs(10);
    let at_scope_one = yama_scope().as_deref() == Some("1");
    let without = [
        ("TCP only: no peer on this host", 2, config(TransportMode::Tcp)),
        ("single copy off", 2, Config { single_copy_bytes: 0, ..config(TransportMode::Shm) }),
        ("ptracer_any off", 2, Config { ptracer_any: false, ..config(TransportMode::Shm) }),
        ("a group of one", 1, config(TransportMode::Shm)),
    ];
    for (what, world, cfg) in without {
        let engines = group_with(world, timeout, cfg);
        assert_eq!(GRANTS.holders(), 0, "{what}");
        assert!(!GRANTS.opened(), "{what}");
        drop(engines);
    }
    let first = group_with(2, timeout, config(TransportMode::Shm));
    assert_eq!(GRANTS.holders(), 2, "each rank of a group with a peer on its host and single copy");
    assert_eq!(GRANTS.opened(), at_scope_one, "opened exactly where Yama's scope 1 calls for it");
    let second = group_with(3, timeout, config(TransportMode::Auto));
    assert_eq!(GRANTS.holders(), 5);
    drop(first);
    assert_eq!(GRANTS.holders(), 3, "the second group still needs it");
    assert_eq!(GRANTS.opened(), at_scope_one);
    drop(second);
    assert_eq!(GRANTS.holders(), 0, "released with the last group");
    assert!(!GRANTS.opened(), "and undone");
}

const ROLE: &str = "RUSTC10D_TEST_PTRACER_ROLE";
const READ_PID: &str = "RUSTC10D_TEST_READ_PID";
const READ_ADDR: &str = "RUSTC10D_TEST_READ_ADDR";

/// What the reader looks for in the victim's memory.
static WORD: u64 = 0x5052_5452_4143_4552; // "PTRACER"

/// With Yama at scope 1, a process of the same user (not an ancestor) can
/// read a rank's memory while its group lives and no longer after the group
/// is destroyed. Elsewhere Yama does not stand in the way and this says why
/// it is skipped. The ranks run in a process of their own (uid 65534 when
/// this runs as root, whose CAP_SYS_PTRACE Yama would let through).
#[test]
fn a_process_of_the_same_user_cannot_read_a_rank_after_its_last_group() {
    let scope = yama_scope();
    if scope.as_deref() != Some("1") {
        eprintln!("skipped: Yama's ptrace_scope is {scope:?} here, not 1, so no ptracer exception is ever set");
        return;
    }
    let mut victim = role_command("victim_role", "victim");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        use std::os::unix::process::CommandExt;
        victim.uid(65534).gid(65534);
    }
    let out = match victim.output() {
        Ok(out) => out,
        // A test binary under a directory only root may enter (a private temporary clone, say).
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return eprintln!("skipped: uid 65534 cannot run this test binary: {e}");
        }
        Err(e) => panic!("start the ranks' process: {e}"),
    };
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("read while the group lived, refused after"),
        "{said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success());
}

fn role_command(test: &str, role: &str) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture", "--test-threads=1"]).env(ROLE, role);
    c
}

/// Not a test by itself: the ranks' process of the test above.
#[test]
fn victim_role() {
    if std::env::var(ROLE).as_deref() != Ok("victim") {
        return;
    }
    let reads = || {
        let out = role_command("reader_role", "reader")
            .env(READ_PID, std::process::id().to_string())
            .env(READ_ADDR, (&WORD as *const u64 as u64).to_string())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).contains("read the word")
    };
    assert!(!reads(), "at scope 1 a child may not read its parent before any group");
    let engines = group_with(2, Duration::from_secs(10), Config { transport: TransportMode::Shm, ..Config::default() });
    assert!(GRANTS.opened());
    assert!(reads(), "while the group lives, a process of the same user reads");
    drop(engines);
    assert!(!GRANTS.opened());
    assert!(!reads(), "after the last group, no longer");
    println!("read while the group lived, refused after");
}

/// Not a test by itself: reads the victim's word (the victim is its parent, not a descendant).
#[test]
fn reader_role() {
    if std::env::var(ROLE).as_deref() != Ok("reader") {
        return;
    }
    let pid: i32 = std::env::var(READ_PID).unwrap().parse().unwrap();
    let addr: u64 = std::env::var(READ_ADDR).unwrap().parse().unwrap();
    let mut word = [0u8; 8];
    match rustc10d::transport::links::conn::read_process(pid, addr, &mut word) {
        Ok(()) if u64::from_ne_bytes(word) == WORD => println!("read the word"),
        other => println!("refused: {other:?}"),
    }
}
