//! Tree broadcast, for small messages, where the ring's W-1 hops one after
//! the other would cost more than the bytes: the root sends to the other
//! ranks of its host and to one rank of every other host (its lowest), which
//! passes it on to the ranks of its own. Two hops at most, and each host's
//! link carries the message once. On one host the root sends to every rank.
//!
//! Bytes copied (`Cost`), for n bytes: the root n per rank it sends to,
//! through the rings; every other rank n received, and n more per rank it
//! passes the message on to.

use super::hosts::Hosts;
use super::{OpCtx, RawBuf};
use crate::error::Result;

pub fn tree_broadcast(ctx: &OpCtx, buf: RawBuf, root: usize, hosts: Option<&Hosts>) -> Result<()> {
    if ctx.transport.size() == 1 {
        return Ok(());
    }
    let (parent, children) = tree(ctx, root, hosts);
    let tr = &mut ctx.transfers();
    if let Some(parent) = parent {
        let id = unsafe { tr.recv(parent, ctx.key(0), buf.ptr, buf.len)? };
        tr.wait(id)?;
    }
    for child in children {
        unsafe { tr.send(child, ctx.key(0), buf.slice(0, buf.len))? };
    }
    tr.wait_all()
}

/// Whom this rank hears the message from (None: it is the root) and whom it
/// passes it on to (`tree_reduce` sends the other way): on one host the root
/// and every other rank; on several (`hosts`), the tree described above.
pub(super) fn tree(ctx: &OpCtx, root: usize, hosts: Option<&Hosts>) -> (Option<usize>, Vec<usize>) {
    let rank = ctx.transport.rank();
    match hosts {
        None if rank == root => (None, ctx.peers().collect()),
        None => (Some(root), Vec::new()),
        Some(hosts) => host_tree(hosts, rank, root),
    }
}

fn host_tree(hosts: &Hosts, rank: usize, root: usize) -> (Option<usize>, Vec<usize>) {
    let (root_host, _) = hosts.locate(root);
    let (host, _) = hosts.locate(rank);
    // The rank of host h that hears first: the root on its own, the lowest elsewhere.
    let head = |h: usize| if h == root_host { root } else { hosts.members[h][0] };
    let mates = || hosts.members[host].iter().copied().filter(|&r| r != rank);
    if rank == root {
        let heads = (0..hosts.members.len()).filter(|&h| h != host).map(head);
        (None, mates().chain(heads).collect())
    } else if rank == head(host) {
        (Some(root), mates().collect())
    } else {
        (Some(head(host)), Vec::new())
    }
}
