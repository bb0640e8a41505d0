//! A connection with a peer as the mesh sees it: a two-way byte stream of
//! frames, over TCP or through shared memory.

use super::shm::ShmConn;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
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
            Conn::Tcp(s) => s.write_vectored(bufs),
            Conn::Shm(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
