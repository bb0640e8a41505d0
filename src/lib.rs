//! rustc10d: a torch.distributed (c10d) backend in Rust.
//!
//! Layers, bottom up: `transport` moves bytes between ranks; `algorithms` are
//! collectives written against it (`ops` says what a call is); `engine`
//! orders ops and completes them; `rendezvous` brings a group up through a
//! Store; `config` holds every setting. The torch shim (C++, `cpp/`) and the
//! Python module sit on top, behind the `extension` feature.

// An unsafe fn's body is no unsafe block: each unsafe operation in it
// has one of its own, and says why it keeps the contracts involved.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod algorithms;
pub mod config;
pub mod cuda;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod fault;
pub mod ops;
pub mod panics;
pub mod reduce;
pub mod rendezvous;
pub mod stats;
pub mod status;
pub mod transport;

#[cfg(feature = "extension")]
mod ffi;
#[cfg(feature = "extension")]
mod python;
