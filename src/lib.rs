//! rustc10d: a torch.distributed (c10d) backend in Rust.
//!
//! Layers, bottom up: `transport` moves bytes between ranks; `algorithms` are
//! collectives written against it (`ops` says what a call is); `engine`
//! orders ops and completes them; `rendezvous` brings a group up through a
//! Store; `membership` says who is in a group torch re-forms (reconfigure);
//! `config` holds every setting. The torch shim (C++, `cpp/`) and the
//! Python module sit on top, behind the `extension` feature.

// Every unsafe block and impl says, in a `// SAFETY:` comment, which
// invariant makes it sound; an unsafe fn's body is no unsafe block: each
// unsafe operation in it has one of its own. (The modules that touch shared
// memory, the CUDA driver and the kernels also say so themselves.)
#![deny(clippy::undocumented_unsafe_blocks)]
#![deny(unsafe_op_in_unsafe_fn)]

// The algorithms hold no unsafe code: they take the op's memory as slices
// (`engine::lend`), the arena's slots by stage (`transport::group::arena`),
// and lend them to transfers by borrow (`transport::Transfers`).
#[forbid(unsafe_code)]
pub mod algorithms;
pub mod alloc;
pub mod config;
pub mod cuda;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod fault;
pub mod locks;
pub mod membership;
pub mod ops;
pub mod panics;
pub mod reduce;
pub mod rendezvous;
pub mod secret;
pub mod stats;
pub mod status;
pub mod transport;

#[cfg(feature = "extension")]
mod ffi;
#[cfg(feature = "extension")]
mod python;
