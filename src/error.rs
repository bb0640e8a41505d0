//! The one error type of the core. Messages are complete sentences meant for
//! the Python user: they name the op, the rank and the peer where one is known.

/// What went wrong, so callers can tell bad input from a failed peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The caller passed something we cannot use (rank out of range, size mismatch).
    InvalidArgument,
    /// A valid request this backend does not implement (yet).
    Unsupported,
    /// A blocking step ran past its deadline.
    Timeout,
    /// A peer closed its connection or failed.
    PeerLost,
    /// Socket or system call failure.
    Io,
    /// The process group was shut down or is broken by an earlier failure.
    Aborted,
    /// Ranks called different collectives (op, dtype, size, root or reduce op).
    Mismatch,
    /// The system refused something the engine needs (a thread).
    Resource,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Timeout, message)
    }
    /// A deadline passed, worded as torch's backends word it ("Timed out",
    /// which tools and torch's own tests match on), then what was waited for.
    pub fn timed_out(after: std::time::Duration, what: impl std::fmt::Display) -> Self {
        Self::timeout(format!("rustc10d: Timed out after {} ms: {what}", after.as_millis()))
    }
    pub fn peer_lost(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PeerLost, message)
    }
    pub fn io(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Io, message)
    }
    pub fn aborted(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Aborted, message)
    }
    pub fn resource(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Resource, message)
    }

    /// Prefix the message with the context of the op that hit it.
    pub fn context(self, what: impl std::fmt::Display) -> Self {
        Error { kind: self.kind, message: format!("{what}: {}", self.message) }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
