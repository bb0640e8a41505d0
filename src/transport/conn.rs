//! A connection with a peer as the mesh sees it: a two-way byte stream of
//! frames, over TCP or through shared memory.

use super::shm::ShmConn;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

pub enum Conn {
    Tcp(TcpStream),
    Shm(Arc<ShmConn>),
}

impl Conn {
    /// Another handle on the same connection (one reads, one writes, one closes).
    pub fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
            Conn::Shm(s) => Conn::Shm(s.clone()),
        })
    }

    /// End the connection both ways; blocked reads and writes return.
    pub fn shutdown(&self) {
        match self {
            Conn::Tcp(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            Conn::Shm(s) => s.shutdown(),
        }
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) {
        match self {
            Conn::Tcp(s) => {
                let _ = s.set_write_timeout(t);
            }
            Conn::Shm(s) => s.set_write_timeout(t),
        }
    }

    pub fn is_shm(&self) -> bool {
        matches!(self, Conn::Shm(_))
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Shm(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => tcp_write_vectored(s, bufs),
            Conn::Shm(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Write what the socket takes now, and when it takes nothing, poll until it
/// can take more (for at most the socket's write timeout, like a blocking
/// write). Measured on loopback, a blocking writev of a large message was
/// about 25 % slower than this: it sleeps and wakes on each bit of buffer
/// space the receiver frees, where poll wakes once a third of it is free.
fn tcp_write_vectored(s: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    let fd = s.as_raw_fd();
    loop {
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = bufs.as_ptr() as *mut libc::iovec; // IoSlice is an iovec on unix
        msg.msg_iovlen = bufs.len() as _;
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        match err.kind() {
            io::ErrorKind::WouldBlock => wait_writable(s)?,
            io::ErrorKind::Interrupted => {}
            _ => return Err(err),
        }
    }
}

fn wait_writable(s: &TcpStream) -> io::Result<()> {
    let timeout_ms = match s.write_timeout()? {
        Some(t) => t.as_millis().clamp(1, i32::MAX as u128) as i32,
        None => -1,
    };
    let mut pfd = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
    match unsafe { libc::poll(&mut pfd, 1, timeout_ms) } {
        0 => Err(io::Error::new(io::ErrorKind::WouldBlock, "write timed out")),
        n if n < 0 => {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                Ok(())
            } else {
                Err(err)
            }
        }
        _ => Ok(()), // writable, or an error the next sendmsg reports
    }
}
