//! What a group owns over the connections it sends on: its transport (the
//! owner's `Mesh`, or a `Channel` on another's), what it waits for, the
//! views of some of its ranks, and the shared arena of its ranks on one host
//! (leased from the host's pool). Its messages are matched in the
//! connections' mailboxes (`links::mailbox`), which every group on them shares.

pub mod arena;
pub mod arena_pool;
pub(in crate::transport) mod channel;
pub mod mesh;
pub mod subgroup;
pub mod waits;
