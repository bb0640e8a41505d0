//! The life of one peer as this rank sees it, as a state machine that does
//! no I/O and reads no clock: connections are adopted, carry data, end; the
//! peer may tell why it gives up; this rank may give up on it. Each event
//! returns what the mesh must do. The orderings that broke before are unit
//! tests here: a reason that arrives before the data sent ahead of it on
//! another connection, a connection that arrives after this rank gave up, two
//! ranks dialling each other at once.

use crate::error::Error;

/// A connection, as the mesh numbers them.
pub type ConnId = u64;

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A connection passed its handshake (`lanes`: how many this rank sends
    /// on at most, for its kind).
    Adopted { conn: ConnId, lanes: usize },
    /// This rank now sends on up to `lanes` connections: open ones that it
    /// only read from so far become lanes (the mesh dials any still missing).
    Widen { lanes: usize },
    /// The peer said why it gives up, on `conn` (which it then closes).
    Reason { conn: ConnId, why: Error },
    /// `conn` ended: cleanly between frames (None), or with an error.
    Ended { conn: ConnId, error: Option<Error> },
    /// A write on `conn` failed. The peer may be saying why right now on
    /// another connection; the mesh waits a moment (`Action::Await`) first.
    WriteFailed { conn: ConnId, error: Error },
    /// The moment after a failed write passed without a reason.
    Awaited { error: Error },
    /// This rank gives up on the peer (its own failure, an abort, shutdown).
    GiveUp { why: Error },
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send on it (it is one of the peer's lanes, in order).
    Send(ConnId),
    /// Write this rank's reason to give up on it, before it is closed.
    TellWhy(ConnId),
    Close(ConnId),
    /// The peer is gone: fail its receives and sends, now and later.
    Lost(Error),
    /// Wait a moment for the peer's reason, then report `Awaited`.
    Await(Error),
}

#[derive(Debug, Default)]
pub struct Peer {
    /// "rank 3 (10.0.0.4:40123)", for the errors it makes.
    name: String,
    /// Connections not yet ended, in adoption order.
    open: Vec<ConnId>,
    /// Those this rank sends on.
    lanes: Vec<ConnId>,
    /// Why the peer gave up, once it said so.
    why: Option<Error>,
    lost: Option<Error>,
}

impl Peer {
    pub fn new(name: impl Into<String>) -> Peer {
        Peer { name: name.into(), ..Peer::default() }
    }

    pub fn lost(&self) -> Option<&Error> {
        self.lost.as_ref()
    }

    /// Whether the peer said why it gave up on the group: it had joined the
    /// group then (a rank gives up only in an op, once it has joined).
    pub fn said_why(&self) -> bool {
        self.why.is_some()
    }

    /// The connections this rank sends on, in order (p2p takes the first).
    pub fn lanes(&self) -> &[ConnId] {
        &self.lanes
    }

    pub fn is_linked(&self) -> bool {
        !self.open.is_empty()
    }

    /// What to do about `event`. `gave_up`: this rank has given up on the
    /// connections (shut down: a connection that arrives now gets told why,
    /// then closed).
    pub fn on(&mut self, event: Event, gave_up: bool) -> Vec<Action> {
        match event {
            Event::Adopted { conn, lanes } => {
                if self.lost.is_some() {
                    let tell = gave_up.then_some(Action::TellWhy(conn));
                    return tell.into_iter().chain([Action::Close(conn)]).collect();
                }
                self.open.push(conn);
                if self.lanes.len() < lanes {
                    self.lanes.push(conn);
                    return vec![Action::Send(conn)];
                }
                vec![]
            }
            Event::Widen { lanes } => {
                let idle: Vec<ConnId> = self.open.iter().filter(|c| !self.lanes.contains(c)).copied().collect();
                let more = lanes.saturating_sub(self.lanes.len());
                self.lanes.extend(idle.into_iter().take(more));
                vec![]
            }
            Event::Reason { conn, why } => {
                // Data the peer sent on its other connections before it gave
                // up still counts: the peer is gone once they are drained too.
                self.why.get_or_insert(why);
                self.ended(conn, None)
            }
            Event::Ended { conn, error } => self.ended(conn, error),
            // The connection's reader ends on its own; what it reads first still counts.
            Event::WriteFailed { conn: _, error } => {
                if self.lost.is_some() {
                    return vec![];
                }
                vec![Action::Await(Error::peer_lost(format!("lost connection to {}: {}", self.name, error.message)))]
            }
            Event::Awaited { error } => self.lose(self.why.clone().unwrap_or(error)),
            Event::GiveUp { why } => self.lose(why),
        }
    }

    fn ended(&mut self, conn: ConnId, error: Option<Error>) -> Vec<Action> {
        let was_open = self.open.contains(&conn);
        self.open.retain(|&c| c != conn);
        self.lanes.retain(|&c| c != conn);
        if self.lost.is_some() {
            return vec![];
        }
        match error {
            Some(e) => self.lose(self.why.clone().unwrap_or(e)),
            None if !self.open.is_empty() || !was_open => vec![],
            None => {
                let closed = || Error::peer_lost(format!("{} closed its connection", self.name));
                self.lose(self.why.clone().unwrap_or_else(closed))
            }
        }
    }

    fn lose(&mut self, why: Error) -> Vec<Action> {
        if self.lost.is_some() {
            return vec![];
        }
        self.lost = Some(why.clone());
        self.lanes.clear();
        let close = std::mem::take(&mut self.open).into_iter().map(Action::Close);
        close.chain([Action::Lost(why)]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost_with(actions: &[Action]) -> Option<String> {
        actions.iter().find_map(|a| match a {
            Action::Lost(e) => Some(e.message.clone()),
            _ => None,
        })
    }

    #[test]
    fn widening_takes_the_read_only_connections_first_and_keeps_the_first_lane() {
        let mut p = Peer::new("rank 1");
        p.on(Event::Adopted { conn: 1, lanes: 1 }, false);
        p.on(Event::Adopted { conn: 2, lanes: 1 }, false);
        p.on(Event::Widen { lanes: 4 }, false);
        assert_eq!(p.lanes(), &[1, 2], "conn 2 was only read from; two are still missing");
        assert_eq!(p.on(Event::Adopted { conn: 3, lanes: 4 }, false), vec![Action::Send(3)]);
        p.on(Event::Widen { lanes: 2 }, false);
        assert_eq!(p.lanes(), &[1, 2, 3], "never narrows: sends may be queued on each");
        p.on(Event::GiveUp { why: Error::aborted("x") }, false);
        p.on(Event::Widen { lanes: 8 }, false);
        assert!(p.lanes().is_empty(), "a lost peer gets no lanes");
    }

    #[test]
    fn the_first_connections_are_the_lanes_and_the_rest_are_read_only() {
        let mut p = Peer::new("rank 1");
        assert_eq!(p.on(Event::Adopted { conn: 1, lanes: 2 }, false), vec![Action::Send(1)]);
        assert_eq!(p.on(Event::Adopted { conn: 2, lanes: 2 }, false), vec![Action::Send(2)]);
        assert_eq!(p.on(Event::Adopted { conn: 3, lanes: 2 }, false), vec![]);
        assert_eq!(p.lanes(), &[1, 2]);
        assert!(p.is_linked());
    }

    /// Both ranks dial at once: each sends on its own connection and reads
    /// both; the peer is gone only when both have ended.
    #[test]
    fn two_ranks_dialling_each_other_at_once() {
        let mut p = Peer::new("rank 1");
        assert_eq!(p.on(Event::Adopted { conn: 7, lanes: 1 }, false), vec![Action::Send(7)]);
        assert_eq!(p.on(Event::Adopted { conn: 8, lanes: 1 }, false), vec![]);
        assert_eq!(p.on(Event::Ended { conn: 8, error: None }, false), vec![]);
        assert!(p.lost().is_none());
        let actions = p.on(Event::Ended { conn: 7, error: None }, false);
        assert_eq!(lost_with(&actions).as_deref(), Some("rank 1 closed its connection"));
    }

    /// The peer's reason, sent on one connection, overtakes data it sent just
    /// before on the other: the data must still be read, and the peer is lost
    /// with its reason once that connection ends too.
    #[test]
    fn a_reason_arriving_before_the_data_sent_ahead_of_it() {
        let mut p = Peer::default();
        p.on(Event::Adopted { conn: 1, lanes: 1 }, false);
        p.on(Event::Adopted { conn: 2, lanes: 1 }, false);
        let why = Error::peer_lost("rank 1 gave up on the group: timed out");
        assert_eq!(p.on(Event::Reason { conn: 2, why: why.clone() }, false), vec![]);
        assert!(p.lost().is_none(), "connection 1 may still hold data");
        let actions = p.on(Event::Ended { conn: 1, error: None }, false);
        assert_eq!(lost_with(&actions), Some(why.message));
    }

    /// A peer that said why it gave up had joined the group (a join only
    /// fails for a peer lost without a reason: `Core::unless_it_joined_and_gave_up`).
    #[test]
    fn only_a_peer_that_said_why_counts_as_having_given_up() {
        let mut closed = Peer::default();
        closed.on(Event::Adopted { conn: 1, lanes: 1 }, false);
        closed.on(Event::Ended { conn: 1, error: None }, false);
        assert!(closed.lost().is_some() && !closed.said_why(), "closed without a reason");
        let mut failed = Peer::default();
        failed.on(Event::Adopted { conn: 1, lanes: 1 }, false);
        failed.on(Event::Ended { conn: 1, error: Some(Error::io("reset")) }, false);
        assert!(failed.lost().is_some() && !failed.said_why(), "a broken connection");
        let mut gave_up = Peer::default();
        gave_up.on(Event::Adopted { conn: 1, lanes: 1 }, false);
        gave_up.on(Event::Reason { conn: 1, why: Error::peer_lost("rank 1 gave up: mismatch") }, false);
        assert!(gave_up.lost().is_some() && gave_up.said_why(), "it said why");
        let mut given_up_on = Peer::default();
        given_up_on.on(Event::GiveUp { why: Error::aborted("this rank gave up") }, true);
        assert!(!given_up_on.said_why(), "this rank's giving up says nothing of the peer");
    }

    /// A connection from the peer arrives after this rank gave up: the peer
    /// may read only that one so far, so it is told why, then closed.
    #[test]
    fn a_connection_arriving_after_giving_up() {
        let mut p = Peer::default();
        p.on(Event::Adopted { conn: 1, lanes: 1 }, false);
        let why = Error::aborted("rank 0 gave up");
        assert_eq!(p.on(Event::GiveUp { why: why.clone() }, true), vec![Action::Close(1), Action::Lost(why)]);
        assert_eq!(p.on(Event::Adopted { conn: 2, lanes: 1 }, true), vec![Action::TellWhy(2), Action::Close(2)]);
        assert_eq!(p.on(Event::Adopted { conn: 3, lanes: 1 }, false), vec![Action::Close(3)], "lost, not given up");
    }

    /// A write fails on a connection the peer closed: its reason, if it
    /// arrives in the moment the mesh waits, is what the failure reports.
    #[test]
    fn a_failed_write_reports_the_peers_reason_if_it_comes() {
        let mut p = Peer::default();
        p.on(Event::Adopted { conn: 1, lanes: 1 }, false);
        p.on(Event::Adopted { conn: 2, lanes: 1 }, false);
        let broken = Error::io("Broken pipe");
        let actions = p.on(Event::WriteFailed { conn: 1, error: broken.clone() }, false);
        assert!(matches!(&actions[..], [Action::Await(e)] if e.message == "lost connection to : Broken pipe"));
        let why = Error::peer_lost("rank 1 gave up: mismatch");
        p.on(Event::Reason { conn: 2, why: why.clone() }, false);
        let actions = p.on(Event::Awaited { error: Error::peer_lost("lost connection to : Broken pipe") }, false);
        assert_eq!(lost_with(&actions), Some(why.message), "the reason, not the broken pipe");
        assert_eq!(p.on(Event::Awaited { error: broken }, false), vec![], "lost once");
    }

    #[test]
    fn an_error_on_a_connection_loses_the_peer_at_once() {
        let mut p = Peer::default();
        p.on(Event::Adopted { conn: 1, lanes: 1 }, false);
        p.on(Event::Adopted { conn: 2, lanes: 1 }, false);
        let actions = p.on(Event::Ended { conn: 1, error: Some(Error::io("corrupt frame header")) }, false);
        assert_eq!(actions, vec![Action::Close(2), Action::Lost(Error::io("corrupt frame header"))]);
        assert_eq!(p.on(Event::Ended { conn: 2, error: None }, false), vec![]);
    }
}
