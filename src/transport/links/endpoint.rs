//! Where a peer is reached (`PeerAddr`, from the Store's records) and where
//! this rank listens for peers on its host (`ShmEndpoint`): what the
//! rendezvous hands the connections.

use crate::error::{Error, Result};
use crate::transport::links::auth::fill_random;
use std::net::SocketAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::UnixListener;

/// Where a peer listens.
#[derive(Debug, Clone)]
pub struct PeerAddr {
    pub tcp: SocketAddr,
    /// The abstract Unix socket name to reach it through shared memory, for
    /// a peer on this host; None: over TCP.
    pub shm: Option<String>,
}

/// This rank's end for shared-memory peers: a Unix socket in the abstract
/// namespace (nothing on disk), where peers hand over their segments.
pub struct ShmEndpoint {
    pub listener: UnixListener,
    pub ring_bytes: usize,
}

impl ShmEndpoint {
    /// Listen under a fresh random name; the name goes to peers via the Store.
    /// The segments this rank creates have rings of `ring_bytes`.
    pub fn bind(ring_bytes: usize) -> Result<(ShmEndpoint, String)> {
        let mut r = [0u8; 16];
        fill_random(&mut r)?;
        let name = format!("rustc10d-{}", r.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io(e.to_string()))?;
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| Error::io(format!("rustc10d: cannot listen on a Unix socket: {e}")))?;
        Ok((ShmEndpoint { listener, ring_bytes }, name))
    }
}
