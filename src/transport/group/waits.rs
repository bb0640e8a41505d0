//! What this rank is waiting for, so that a peer that timed out waiting for
//! it can ask and say so: on a network cut in two, a rank that waited for a
//! rank still joined would otherwise name only that one, not the rank
//! behind it that is really gone. Each blocking wait of an op is noted
//! while it lasts, and what the rank said when its last wait timed out or
//! failed (a peer's abort, say, which names the rank behind) is kept. A
//! peer's question is answered from here in `ANSWER_LEN` bytes
//! (`Key::answer`); the answering rank first asks, in turn, the rank it
//! waits for, up to `MAX_DEPTH` ranks down a chain of waits.

use std::time::{Duration, Instant};

/// How long each rank down a chain gets to answer.
pub const ASK_GRACE: Duration = Duration::from_millis(100);
/// How far down a chain of waits a question goes.
pub const MAX_DEPTH: u64 = 3;

/// How long a rank asked at `depth` (0: the rank that timed out asks)
/// waits for its answer: long enough for the ranks further down to answer.
pub fn grace_at(depth: u64) -> Duration {
    ASK_GRACE * (MAX_DEPTH + 1 - depth.min(MAX_DEPTH)) as u32
}

/// One blocking wait of an op: `what` ("allreduce #4 on rank 1") was
/// waiting for data from (or a send to, or an arrival in the shared arena
/// of) `peer`, a rank of the whole group.
#[derive(Debug, Clone)]
pub struct Wait {
    pub what: String,
    pub peer: usize,
    pub on: WaitOn,
    pub since: Instant,
}

/// What a wait waits for from its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOn {
    Data,
    Send,
    /// Its arrival at a stage of the shared arena (arena.rs).
    Arena,
}

#[derive(Default)]
pub struct Waits {
    next: u64,
    now: Vec<(u64, Wait)>,
    gave_up: Option<String>,
}

impl Waits {
    pub fn begin(&mut self, wait: Wait) -> u64 {
        self.next += 1;
        self.now.push((self.next, wait));
        self.next
    }

    /// The wait ended; `said`: it timed out or failed, and this is what the rank said.
    pub fn end(&mut self, id: u64, said: Option<String>) {
        if let Some(i) = self.now.iter().position(|(n, _)| *n == id) {
            self.now.swap_remove(i);
        }
        if said.is_some() {
            self.gave_up = said;
        }
    }

    /// The peer this rank waits for now (the longest-waiting wait's).
    pub fn waiting_for(&self) -> Option<usize> {
        self.now.iter().min_by_key(|(_, w)| w.since).map(|(_, w)| w.peer)
    }

    /// "allreduce #4 on rank 1 was waiting for data from rank 5 (…) for
    /// 4.9 s", one per wait now, or what the rank said when its last wait
    /// timed out or failed; `describe` names a rank of the group.
    pub fn answer(&self, describe: impl Fn(usize) -> String) -> String {
        let now: Vec<String> = self
            .now
            .iter()
            .map(|(_, w)| {
                let secs = w.since.elapsed().as_secs_f64();
                let peer = describe(w.peer);
                match w.on {
                    WaitOn::Data => format!("{} was waiting for data from {peer} for {secs:.1} s", w.what),
                    WaitOn::Send => format!("{} was waiting for a send to {peer} for {secs:.1} s", w.what),
                    WaitOn::Arena => format!("{} was waiting in the shared arena for {peer} for {secs:.1} s", w.what),
                }
            })
            .collect();
        match (now.is_empty(), &self.gave_up) {
            (false, _) => now.join("; "),
            (true, Some(said)) => said.clone(),
            (true, None) => String::new(),
        }
    }
}

/// What a rank said, with what the rank it waited for said in turn, if anything.
pub fn in_turn(said: String, theirs: Option<String>) -> String {
    match theirs {
        Some(t) if !t.is_empty() => format!("{said}; in turn, {t}"),
        _ => said,
    }
}

/// Whom a rank asked at `depth` by `asker` asks in turn: the rank it waits
/// for, unless that is the asker or the chain is as deep as it goes.
pub fn ask_next(waiting_for: Option<usize>, asker: usize, depth: u64) -> Option<usize> {
    // `depth` is the asker's word (any u64): compared, never added to.
    waiting_for.filter(|&q| q != asker && depth < MAX_DEPTH - 1)
}

/// The answer as it crosses: UTF-8, cut to `ANSWER_LEN` bytes (at a
/// character boundary) and padded with NULs.
pub fn encode_answer(text: &str) -> Vec<u8> {
    let mut end = text.len().min(crate::transport::links::frame::ANSWER_LEN);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut b = text.as_bytes()[..end].to_vec();
    b.resize(crate::transport::links::frame::ANSWER_LEN, 0);
    b
}

pub fn decode_answer(b: &[u8]) -> String {
    String::from_utf8_lossy(b).trim_end_matches('\0').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_what_waits_now_else_what_it_said_when_it_gave_up() {
        let mut w = Waits::default();
        assert_eq!(w.answer(|p| format!("rank {p}")), "");
        let wait = |peer| Wait { what: "allreduce #4 on rank 1".into(), peer, on: WaitOn::Data, since: Instant::now() };
        let a = w.begin(wait(5));
        let b = w.begin(Wait { on: WaitOn::Send, ..wait(2) });
        assert_eq!(w.waiting_for(), Some(5));
        let told = w.answer(|p| format!("rank {p}"));
        assert!(told.starts_with("allreduce #4 on rank 1 was waiting for data from rank 5 for 0.0 s; "), "{told}");
        assert!(told.ends_with("was waiting for a send to rank 2 for 0.0 s"), "{told}");
        w.end(b, None);
        let said = "allreduce #4 on rank 1 was waiting for data from rank 5 (and timed out)";
        w.end(a, Some(said.into()));
        assert_eq!(w.waiting_for(), None);
        assert_eq!(w.answer(|p| format!("rank {p}")), said);
        // A wait that ends well keeps what the last one that failed said.
        let c = w.begin(wait(3));
        w.end(c, None);
        assert_eq!(w.answer(|p| format!("rank {p}")), said);
        let d = w.begin(wait(3));
        w.end(d, Some("allreduce #5 on rank 1 failed with rank 3: rank 0 gave up".into()));
        assert_eq!(w.answer(|p| format!("rank {p}")), "allreduce #5 on rank 1 failed with rank 3: rank 0 gave up");
        assert!(grace_at(0) > grace_at(1) && grace_at(MAX_DEPTH) == ASK_GRACE);
        let long = "é".repeat(1000);
        let enc = encode_answer(&long);
        assert_eq!(enc.len(), crate::transport::links::frame::ANSWER_LEN);
        assert_eq!(decode_answer(&enc), "é".repeat(crate::transport::links::frame::ANSWER_LEN / 2));
    }

    // A question's depth and an answer's bytes are a peer's word: at any
    // depth, whom to ask next is decided without overflow (u64::MAX panicked
    // in `depth + 1`, killing the thread that was to answer), never beyond
    // MAX_DEPTH; any bytes decode to some text; text without NULs that fits
    // crosses unchanged.
    proptest::proptest! {
        #[test]
        fn questions_at_any_depth_and_answers_of_any_bytes(depth in proptest::prop_oneof![0u64..5, proptest::prelude::any::<u64>()],
                                                         waiting in proptest::option::of(0usize..4), asker in 0usize..4,
                                                         bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
                                                         text in "[^\\x00]{0,100}") {
            let next = ask_next(waiting, asker, depth);
            proptest::prop_assert_eq!(next.is_some(), waiting.is_some_and(|q| q != asker) && u128::from(depth) + 1 < u128::from(MAX_DEPTH));
            let _ = grace_at(depth);
            let _ = decode_answer(&bytes);
            if text.len() <= crate::transport::links::frame::ANSWER_LEN {
                proptest::prop_assert_eq!(decode_answer(&encode_answer(&text)), text);
            }
        }
    }
}
