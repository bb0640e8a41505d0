//! What a process shares with its peer processes, whatever groups it is
//! in: the connections (TCP, shared-memory rings) and how they are opened,
//! proved and served (the reactor, readers and writers), the wire format,
//! each peer's state and mailbox (the matching of every group's messages
//! from that peer with their receives), the open-file limit and the OS
//! primitives under them. One set per process, owned by the group that
//! opened it (`Core`).

pub(in crate::transport) mod accept;
pub mod auth;
pub mod conn;
pub(in crate::transport) mod core_io;
pub(in crate::transport) mod dial;
pub mod endpoint;
pub mod fd_limit;
pub mod fdpass;
pub mod frame;
pub(in crate::transport) mod link;
pub mod mailbox;
pub(in crate::transport) mod mesh_core;
pub mod peer;
pub mod peer_reads;
pub mod reactor;
pub(in crate::transport) mod reader;
pub(in crate::transport) mod readers;
pub mod ring;
pub mod seal;
pub mod shared_mem;
pub mod striping;
pub(in crate::transport) mod writer;
