//! Where the ranks of a group run (`Transport::host_of`), for the algorithms
//! that keep bytes off the links between hosts: those links are slower than
//! memory, so what counts across hosts is how many bytes cross them.

use super::{pick, MAX_PHASES};
use crate::transport::group::arena::Arena;
use crate::transport::group::subgroup::Subgroup;
use crate::transport::Transport;
use std::sync::Arc;

/// The hosts of a group and the ranks on each.
pub struct Hosts {
    /// The ranks of each host in rank order; hosts numbered as `host_of` does.
    pub members: Vec<Vec<usize>>,
}

impl Hosts {
    pub fn of(t: &dyn Transport) -> Hosts {
        let mut members: Vec<Vec<usize>> = Vec::new();
        for rank in 0..t.size() {
            let host = t.host_of(rank);
            if members.len() <= host {
                members.resize(host + 1, Vec::new());
            }
            members[host].push(rank);
        }
        Hosts { members }
    }

    /// The hosts of a group that spans more than one (None, at the cost of
    /// a look at each rank, for a group on one host).
    pub fn apart(t: &dyn Transport) -> Option<Hosts> {
        (0..t.size()).any(|r| t.host_of(r) != 0).then(|| Hosts::of(t))
    }

    /// How many ranks each host holds, when every host holds as many, at
    /// least two, and there are few enough hosts for a phase of each:
    /// what the hierarchical algorithms need.
    pub fn per_host(&self) -> Option<usize> {
        let local = self.members[0].len();
        let uniform = self.members.iter().all(|m| m.len() == local);
        (uniform && local > 1 && (self.members.len() as u64) < MAX_PHASES - 2).then_some(local)
    }

    /// This rank's host and its place among that host's ranks.
    pub fn locate(&self, rank: usize) -> (usize, usize) {
        self.members
            .iter()
            .enumerate()
            .find_map(|(h, m)| m.iter().position(|&r| r == rank).map(|i| (h, i)))
            .expect("every rank is on a host")
    }

    /// The rank of host `host` that hears first from `root` in a tree, or
    /// that a tree towards `root` sums the host's part at: the root on its
    /// own host, the lowest rank elsewhere.
    pub fn head(&self, host: usize, root: usize) -> usize {
        if self.locate(root).0 == host {
            root
        } else {
            self.members[host][0]
        }
    }

    /// The `i`-th rank of every host, host by host (with `per_host`).
    pub fn counterparts(&self, i: usize) -> Vec<usize> {
        self.members.iter().map(|m| m[i]).collect()
    }

    /// Every rank, host after host: a ring in this order crosses each
    /// host's link once each way, however the ranks are numbered.
    pub fn ring(&self) -> Vec<usize> {
        self.members.concat()
    }

    /// Every rank, `root` first, then the others of its host, then the other
    /// hosts' ranks host by host: a chain in this order (or its reverse,
    /// towards the root) crosses H - 1 links between hosts, once each.
    pub fn chain(&self, root: usize) -> Vec<usize> {
        let (host, _) = self.locate(root);
        let mates = self.members[host].iter().filter(|&&r| r != root);
        let others = self.members.iter().enumerate().filter(|&(h, _)| h != host).flat_map(|(_, m)| m);
        std::iter::once(&root).chain(mates).chain(others).copied().collect()
    }

    /// `per_rank` (one buffer per group rank) in host order, as the ring view's ranks hold them.
    pub fn in_ring_order<'o>(&self, per_rank: &'o mut [&mut [u8]]) -> Vec<&'o mut [u8]> {
        pick(per_rank, &self.ring())
    }

    /// The shared arena of one host's ranks (`on_host`, the view of them),
    /// where they map one with room in a slot for a part of each of their
    /// blocks (as the arena's reduce-scatter needs): the hierarchical
    /// algorithms run their phases on the host there, a stage per slot's
    /// worth instead of L - 1 steps around a ring. The arena takes one round
    /// at a time, so an op's phases that overlap never both take it
    /// (`pipelined_through`).
    pub fn arena(on_host: &Subgroup) -> Option<Arc<Arena>> {
        on_host.arena().filter(|a| a.slot_bytes() / on_host.size() >= 16)
    }

    /// `arena`, for the phases on the host of an op of `bytes` that goes in
    /// pieces of at least `piece_bytes` where it is large enough: always in
    /// one piece, and in several where a host holds 3 ranks or more. With
    /// two, the ring on the host is one step, whose large message the mate
    /// reads straight from the sender's memory (one copy), where the arena
    /// copies in and out: measured at 2 hosts x 2 (10 Gbit/s, 1-16 MiB), the
    /// arena made all_reduce copy 4.75 bytes per byte instead of 2.75 and
    /// was up to 10% slower at 16 MiB. At 2 x 4 it copies 3.88 instead of 2.88
    /// but takes 1 stage for 3 steps, and all_reduce, all_gather and
    /// reduce_scatter of 1-16 MiB went 1.1-1.9x faster.
    pub fn arena_for(on_host: &Subgroup, one_piece: bool) -> Option<Arc<Arena>> {
        Hosts::arena(on_host).filter(|_| one_piece || on_host.size() >= 3)
    }

    /// The group seen in host order (`ring`): view rank k is group rank `ring()[k]`.
    pub fn ring_view<'a>(&self, group: &'a dyn Transport) -> Subgroup<'a> {
        Subgroup::new(group, self.ring())
    }
}
