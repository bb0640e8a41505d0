//! Memory that ranks on one host share: an anonymous memfd, sealed so that
//! no process can shrink it under another (which would make its reads
//! fault), and its mappings. Nothing is named in the filesystem; the memory
//! is gone once the last process that maps it or holds the descriptor exits.

use crate::error::{Error, Result};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// A new anonymous memfd of `len` bytes, sealed against resizing.
pub fn sealed_memfd(len: usize) -> Result<OwnedFd> {
    // SAFETY: the name is a NUL-terminated static C string; memfd_create copies it.
    let fd = unsafe { libc::memfd_create(c"rustc10d".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(os_error("memfd_create"));
    }
    // SAFETY: a descriptor memfd_create just returned (checked >= 0), owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate takes a descriptor we own and a length; no memory of ours.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(os_error("ftruncate"));
    }
    // A peer can neither shrink it under us (SIGBUS) nor change the seals.
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl(F_ADD_SEALS) takes a descriptor we own and an int; no memory of ours.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(os_error("sealing the segment"));
    }
    Ok(fd)
}

/// The size of a memfd a peer sent, once it is known to be sealed against shrinking.
pub fn sealed_len(fd: &OwnedFd, what: &str) -> Result<usize> {
    let raw = fd.as_raw_fd();
    // SAFETY: fcntl(F_GET_SEALS) on a borrowed, open descriptor; no memory of ours.
    let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(Error::io(format!("rustc10d: the {what} a peer sent is not sealed")));
    }
    // SAFETY: libc::stat is plain C data: all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one libc::stat into `st`, a live local; the descriptor is borrowed, open.
    if unsafe { libc::fstat(raw, &mut st) } != 0 {
        return Err(os_error("fstat"));
    }
    Ok(st.st_size as usize)
}

/// A shared, writable mapping; unmapped when dropped.
pub struct Mapping {
    pub base: *mut u8,
    pub len: usize,
}

// What lives inside is only touched through atomics and the protocols of its users.
// SAFETY: a Mapping is an address and a length: the mapping itself may be
// used and unmapped from any thread, and what lives inside is only
// touched through atomics or the protocols of its users (arena.rs,
// ring.rs), whose unsafe code says why.
unsafe impl Send for Mapping {}
// SAFETY: shared use only reads `base` and `len`; the memory behind them
// is touched as for Send.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map the first `len` bytes of `fd`.
    pub fn of(fd: RawFd, len: usize) -> Result<Mapping> {
        Mapping::map(fd, len, libc::MAP_SHARED)
    }

    /// Shared memory of `len` zeroed bytes that only this process maps
    /// (its threads stand in for ranks in tests).
    pub fn anonymous(len: usize) -> Result<Mapping> {
        Mapping::map(-1, len, libc::MAP_SHARED | libc::MAP_ANONYMOUS)
    }

    fn map(fd: RawFd, len: usize, flags: libc::c_int) -> Result<Mapping> {
        // SAFETY: a fresh mapping at an address the kernel picks (null hint), of
        // `len` bytes of `fd` (or anonymous memory, fd -1), touching nothing
        // that exists; MAP_FAILED is checked below.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0) };
        if base == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        Ok(Mapping { base: base.cast(), len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are a mapping `map` made, unmapped once, here;
        // its users borrow the Mapping (or hold an Arc of it) for as long as
        // they use pointers into it.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// The error of the OS call `what` that just failed, naming the open-file
/// limit where that is why (`fd_limit::describe`).
pub fn os_error(what: &str) -> Error {
    Error::io(format!(
        "rustc10d: {what} failed: {}",
        crate::transport::links::fd_limit::describe(&io::Error::last_os_error())
    ))
}
