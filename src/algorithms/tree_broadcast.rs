//! Tree broadcast, for small messages, where the ring's W-1 hops one after
//! the other would cost more than the bytes: the root sends to the other
//! ranks of its host and to one rank of every other host (its lowest), which
//! passes it on to the ranks of its own. Two hops at most, and each host's
//! link carries the message once. On one host the root sends to every rank.
//! Where a host's ranks share an arena (`Hosts::arena`), the hop on that
//! host is the arena's broadcast from the rank that heard first: one stage,
//! all of them reading at once.
//!
//! Bytes copied (`Cost`), for n bytes: the root n per rank it sends to,
//! through the rings; every other rank n received, and n more per rank it
//! passes the message on to (in an arena, n to its slot, and n out of it on
//! every other rank of the host).

use super::arena_broadcast::{arena_broadcast, Cast};
use super::call_check::Fingerprint;
use super::hosts::Hosts;
use super::OpCtx;
use crate::error::Result;
use crate::transport::group::arena::Arena;
use crate::transport::group::subgroup::Subgroup;
use crate::transport::Transport;
use std::sync::Arc;

/// `fp`: the call, for a host's arena to compare.
pub fn tree_broadcast(ctx: &OpCtx, buf: &mut [u8], root: usize, hosts: Option<&Hosts>, fp: &Fingerprint) -> Result<()> {
    if ctx.transport.size() == 1 {
        return Ok(());
    }
    let on_host = hosts.and_then(|h| HostHop::of(ctx, h, root));
    let (parent, children) = tree(ctx, root, hosts, on_host.is_some());
    if let Some(hop) = on_host.as_ref().filter(|hop| !hop.is_head()) {
        // It hears in its host's arena, and passes nothing on.
        return arena_broadcast(&ctx.phase(&hop.view, 1), &hop.arena, Cast::Into(buf), hop.head, fp);
    }
    ctx.with_transfers(|tr| {
        let buf: &[u8] = match parent {
            Some(parent) => {
                let lent = tr.recv(parent, ctx.key(0), buf)?;
                tr.give_back(lent)?
            }
            None => buf,
        };
        for child in children {
            tr.send(child, ctx.key(0), buf)?;
        }
        if let Some(hop) = &on_host {
            arena_broadcast(&ctx.phase(&hop.view, 1), &hop.arena, Cast::From(buf), hop.head, fp)?;
        }
        tr.wait_all()
    })
}

/// The hop on this rank's host through the host's arena: its ranks, the
/// arena, and where among them the rank that hears first is.
pub(super) struct HostHop<'a> {
    pub view: Subgroup<'a>,
    pub arena: Arc<Arena>,
    pub head: usize,
}

impl<'a> HostHop<'a> {
    /// For a tree rooted at `root`, on a host whose ranks share an arena.
    pub fn of(ctx: &OpCtx<'a>, hosts: &Hosts, root: usize) -> Option<HostHop<'a>> {
        let (host, _) = hosts.locate(ctx.transport.rank());
        let view = Subgroup::new(ctx.transport, hosts.members[host].clone());
        let arena = Hosts::arena(&view)?;
        let head = view.position(hosts.head(host, root)).expect("a host's head is on the host");
        Some(HostHop { view, arena, head })
    }

    /// Whether this rank is the one that hears first on its host.
    pub fn is_head(&self) -> bool {
        self.view.rank() == self.head
    }
}

/// Whom this rank hears the message from (None: it is the root, or it hears
/// it in its host's arena) and whom it passes it on to (`tree_reduce` sends
/// the other way): on one host the root and every other rank; on several
/// (`hosts`), the tree described above, without the hop on this rank's
/// host if that goes through the host's arena (`in_arena`).
pub(super) fn tree(ctx: &OpCtx, root: usize, hosts: Option<&Hosts>, in_arena: bool) -> (Option<usize>, Vec<usize>) {
    let rank = ctx.transport.rank();
    match hosts {
        None if rank == root => (None, ctx.peers().collect()),
        None => (Some(root), Vec::new()),
        Some(hosts) => host_tree(hosts, rank, root, in_arena),
    }
}

fn host_tree(hosts: &Hosts, rank: usize, root: usize, in_arena: bool) -> (Option<usize>, Vec<usize>) {
    let (host, _) = hosts.locate(rank);
    let head = hosts.head(host, root);
    let mates = || hosts.members[host].iter().copied().filter(|&r| r != rank && !in_arena);
    if rank == root {
        let heads = (0..hosts.members.len()).filter(|&h| h != host).map(|h| hosts.head(h, root));
        (None, mates().chain(heads).collect())
    } else if rank == head {
        (Some(root), mates().collect())
    } else {
        ((!in_arena).then_some(head), Vec::new())
    }
}
