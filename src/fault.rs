//! Fault injection without a rebuild, for testing what sits on top of us
//! (elastic restarts, a trainer's error handling):
//!
//! `RUSTC10D_FAULT="rank=1,op=allreduce,seq=3,action=fail; rank=0,op=send,action=stall,secs=5"`
//!
//! Rules are separated by `;`, fields by `,`. Fields: `rank` (default: every
//! rank), `op` (allreduce, reduce, broadcast, allgather, gather, scatter,
//! reduce_scatter, alltoall, barrier, send, recv, or `any`; default any),
//! `seq` (the op's sequence number in its group, counted separately for
//! collectives and for sends and receives; default: any), `action` (`fail`:
//! the op fails with an error; `stall`: it waits `secs` seconds first; `drop`:
//! every connection of the group is cut as the op starts), `count` (how many
//! matching ops it hits, default 1).

use crate::error::{Error, Result};
use std::sync::Mutex;
use std::time::Duration;

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
    op: Option<String>,
    seq: Option<u64>,
    action: Action,
    remaining: u32,
}

#[derive(Debug, Default)]
pub struct Faults {
    rules: Mutex<Vec<Rule>>,
}

impl Faults {
    /// Read `RUSTC10D_FAULT`; a malformed value is an error at init, not a silent no-op.
    pub fn from_env() -> Result<Faults> {
        match std::env::var(ENV_FAULT) {
            Ok(spec) if !spec.trim().is_empty() => Faults::parse(&spec),
            _ => Ok(Faults::default()),
        }
    }

    pub fn parse(spec: &str) -> Result<Faults> {
        let rules = spec.split(';').filter(|r| !r.trim().is_empty()).map(parse_rule).collect::<Result<_>>()?;
        Ok(Faults { rules: Mutex::new(rules) })
    }

    /// The action for this op, if a rule hits it (consuming one of its counts).
    pub fn hit(&self, rank: usize, op: &str, seq: u64) -> Option<Action> {
        let mut rules = self.rules.lock().unwrap();
        let rule = rules.iter_mut().find(|r| {
            r.remaining > 0
                && r.rank.is_none_or(|x| x == rank)
                && r.op.as_deref().is_none_or(|x| x == op)
                && r.seq.is_none_or(|x| x == seq)
        })?;
        rule.remaining -= 1;
        Some(rule.action)
    }
}

fn parse_rule(text: &str) -> Result<Rule> {
    let bad = |why: String| Error::invalid(format!("rustc10d: {ENV_FAULT}: {why} in rule {:?}", text.trim()));
    let (mut rank, mut op, mut seq, mut action, mut secs, mut count) = (None, None, None, None, 1.0f64, 1u32);
    for field in text.split(',').map(str::trim).filter(|f| !f.is_empty()) {
        let (k, v) = field.split_once('=').ok_or_else(|| bad(format!("{field:?} is not key=value")))?;
        let num = |v: &str| v.trim().parse::<u64>().map_err(|_| bad(format!("{k}={v} is not a number")));
        match k.trim() {
            "rank" => rank = Some(num(v)? as usize),
            "op" => op = (v.trim() != "any").then(|| v.trim().to_string()),
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
        assert_eq!(f.hit(0, "allreduce", 3), None);
        assert_eq!(f.hit(1, "allreduce", 2), None);
        assert_eq!(f.hit(1, "allreduce", 3), Some(Action::Fail));
        assert_eq!(f.hit(1, "allreduce", 3), None, "count 1 is used up");
        assert_eq!(f.hit(4, "send", 9), Some(Action::Stall(Duration::from_millis(500))));
        assert_eq!(f.hit(0, "send", 0), Some(Action::Stall(Duration::from_millis(500))));
        assert_eq!(f.hit(0, "send", 1), None);
    }

    #[test]
    fn malformed_rules_are_errors() {
        for bad in ["rank=x,action=fail", "op=allreduce", "action=explode", "rank=1;foo", "color=red,action=fail"] {
            let err = Faults::parse(bad).unwrap_err();
            assert!(err.message.contains(ENV_FAULT), "{bad}: {}", err.message);
        }
        assert!(Faults::parse("").unwrap().hit(0, "allreduce", 0).is_none());
    }
}
