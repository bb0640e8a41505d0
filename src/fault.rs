//! Fault injection without a rebuild, for testing what sits on top of us
//! (elastic restarts, a trainer's error handling):
//!
//! `RUSTC10D_FAULT="rank=1,op=allreduce,seq=3,action=fail; rank=0,op=send,action=stall,secs=5"`
//!
//! Rules are separated by `;`, fields by `,`. Fields: `rank` (default: every
//! rank), `op` (an `OpKind` name: allreduce, reduce, broadcast, allgather,
//! gather, scatter, reduce_scatter, alltoall, barrier, monitored_barrier,
//! allreduce_sparse, send, recv; or `any`, the default; a misspelled name is
//! an error, never a rule that silently never fires),
//! `seq` (the op's sequence number in its group, counted separately for
//! collectives and for sends and receives; default: any), `action` (`fail`:
//! the op fails with an error; `stall`: it waits `secs` seconds first; `drop`:
//! every connection of the group is cut as the op starts), `count` (how many
//! matching ops it hits, default 1).

use crate::locks::{level, Mutex};
use crate::ops::OpKind;
use std::time::Duration;

/// Where the rules come from, for the error an injected failure reports.
pub const ENV_FAULT: &str = "RUSTC10D_FAULT";

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action {
    Fail,
    Stall(Duration),
    Drop,
}

#[derive(Debug, Clone, PartialEq)]
struct Rule {
    rank: Option<usize>,
    op: Option<OpKind>,
    seq: Option<u64>,
    action: Action,
    remaining: u32,
}

#[derive(Debug, Default)]
pub struct Faults {
    rules: Mutex<level::FaultRules, Vec<Rule>>,
    /// Whether there are rules: every op asks, and almost always there are
    /// none, which it then learns without the lock's cache line.
    any: bool,
}

impl Faults {
    /// The rules of `spec`; a malformed one is an error (Config reports it at
    /// init), not a silent no-op.
    pub fn parse(spec: &str) -> Result<Faults, String> {
        let rules: Vec<Rule> =
            spec.split(';').filter(|r| !r.trim().is_empty()).map(parse_rule).collect::<Result<_, _>>()?;
        Ok(Faults { any: !rules.is_empty(), rules: Mutex::new(rules) })
    }

    /// The action for this op, if a rule hits it (consuming one of its counts).
    pub fn hit(&self, rank: usize, op: OpKind, seq: u64) -> Option<Action> {
        if !self.any {
            return None;
        }
        let mut rules = self.rules.lock().unwrap();
        let rule = rules.iter_mut().find(|r| {
            r.remaining > 0
                && r.rank.is_none_or(|x| x == rank)
                && r.op.is_none_or(|x| x == op)
                && r.seq.is_none_or(|x| x == seq)
        })?;
        rule.remaining -= 1;
        Some(rule.action)
    }
}

fn parse_rule(text: &str) -> Result<Rule, String> {
    let bad = |why: String| format!("{why} in rule {:?}", text.trim());
    let (mut rank, mut op, mut seq, mut action, mut secs, mut count) = (None, None, None, None, 1.0f64, 1u32);
    for field in text.split(',').map(str::trim).filter(|f| !f.is_empty()) {
        let (k, v) = field.split_once('=').ok_or_else(|| bad(format!("{field:?} is not key=value")))?;
        let num = |v: &str| v.trim().parse::<u64>().map_err(|_| bad(format!("{k}={v} is not a number")));
        match k.trim() {
            "rank" => rank = Some(num(v)? as usize),
            "op" if v.trim() == "any" => op = None,
            "op" => op = Some(OpKind::parse(v.trim()).map_err(bad)?),
            "seq" => seq = Some(num(v)?),
            "count" => count = num(v)? as u32,
            "secs" => secs = v.trim().parse().map_err(|_| bad(format!("secs={v} is not a number")))?,
            "action" => action = Some(v.trim().to_string()),
            other => return Err(bad(format!("unknown field {other:?}"))),
        }
    }
    let action = match action.as_deref() {
        Some("fail") => Action::Fail,
        Some("stall") => Action::Stall(Duration::from_secs_f64(secs)),
        Some("drop") => Action::Drop,
        Some(a) => return Err(bad(format!("unknown action {a:?} (fail, stall or drop)"))),
        None => return Err(bad("no action".into())),
    };
    Ok(Rule { rank, op, seq, action, remaining: count })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_match_and_count_down() {
        let f = Faults::parse("rank=1,op=allreduce,seq=3,action=fail; op=send,action=stall,secs=0.5,count=2").unwrap();
        assert_eq!(f.hit(0, OpKind::AllReduce, 3), None);
        assert_eq!(f.hit(1, OpKind::AllReduce, 2), None);
        assert_eq!(f.hit(1, OpKind::AllReduce, 3), Some(Action::Fail));
        assert_eq!(f.hit(1, OpKind::AllReduce, 3), None, "count 1 is used up");
        assert_eq!(f.hit(4, OpKind::Send, 9), Some(Action::Stall(Duration::from_millis(500))));
        assert_eq!(f.hit(0, OpKind::Send, 0), Some(Action::Stall(Duration::from_millis(500))));
        assert_eq!(f.hit(0, OpKind::Send, 1), None);
    }

    #[test]
    fn malformed_rules_are_errors() {
        for bad in ["rank=x,action=fail", "op=allreduce", "action=explode", "rank=1;foo", "color=red,action=fail"] {
            let err = Faults::parse(bad).unwrap_err();
            assert!(err.contains("in rule"), "{bad}: {err}");
        }
        let err = Faults::parse("op=allreduse,action=fail").unwrap_err();
        assert!(err.contains("unknown op \"allreduse\""), "{err}");
        assert!(Faults::parse("").unwrap().hit(0, OpKind::AllReduce, 0).is_none());
    }
}
