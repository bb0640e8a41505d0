//! Who is in a group that torch re-forms (`dist._reconfigure`): every process
//! hands out a reconfigure handle, the caller gathers them out of band and
//! passes the same list (or set) to every member, and each member finds its
//! new rank in it. Nothing here talks to anyone: this is the handle's text
//! and the rules that turn a list of handles into a rank and a size.
//!
//! A handle reads `rustc10d:<rank>:<uuid>:<process>`: the rank the process
//! has now, the uuid of the configuration it is in (-1 before the first),
//! and a random number drawn once per backend object, which tells apart two
//! processes that claim the same rank (a survivor and a replacement). The
//! uuid in it makes a handle from an earlier configuration a stranger.

use crate::error::{Error, Result};
use std::fmt;

const PREFIX: &str = "rustc10d";

/// One process's reconfigure handle, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Handle {
    // Field order is the order of a set of handles: by rank now, so that
    // survivors keep their order and a newcomer takes the place it claims.
    pub rank: i64,
    pub uuid: i64,
    pub process: u64,
}

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PREFIX}:{}:{}:{:016x}", self.rank, self.uuid, self.process)
    }
}

impl Handle {
    pub fn parse(text: &str) -> Result<Handle> {
        let bad = || Error::invalid(format!("rustc10d: {text:?} is not a rustc10d reconfigure handle"));
        let mut parts = text.split(':');
        if parts.next() != Some(PREFIX) {
            return Err(bad());
        }
        let mut next = || parts.next().ok_or_else(bad);
        let rank = next()?.parse().map_err(|_| bad())?;
        let uuid = next()?.parse().map_err(|_| bad())?;
        let process = u64::from_str_radix(next()?, 16).map_err(|_| bad())?;
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(Handle { rank, uuid, process })
    }
}

/// This process's place in the group that `handles` describe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub rank: usize,
    pub size: usize,
}

/// Where `mine` stands among `handles`: by position where the caller gave a
/// list (`ordered`), else in the order of `Handle` (rank, then uuid, then
/// process), which every member computes alike from the same set. Refuses
/// an empty list, a handle that is not ours, one given twice, and a list
/// without this process.
pub fn place(mine: &Handle, handles: &[String], ordered: bool) -> Result<Place> {
    if handles.is_empty() {
        return Err(Error::invalid("rustc10d: reconfigure needs at least one handle"));
    }
    let mut parsed = handles.iter().map(|h| Handle::parse(h)).collect::<Result<Vec<_>>>()?;
    if !ordered {
        parsed.sort();
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(twice) = parsed.iter().find(|h| !seen.insert(**h)) {
        return Err(Error::invalid(format!("rustc10d: reconfigure was given handle {twice} twice")));
    }
    let rank = parsed.iter().position(|h| h == mine).ok_or_else(|| {
        Error::invalid(format!(
            "rustc10d: this process's reconfigure handle {mine} is not among the {} given; a handle from \
             before the last reconfigure is stale: ask get_reconfigure_handle again",
            parsed.len()
        ))
    })?;
    Ok(Place { rank, size: parsed.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(rank: i64, uuid: i64, process: u64) -> Handle {
        Handle { rank, uuid, process }
    }

    fn texts(hs: &[Handle]) -> Vec<String> {
        hs.iter().map(|h| h.to_string()).collect()
    }

    #[test]
    fn a_handle_reads_back_as_written() {
        let x = h(12, -1, 0xdead_beef_0000_0001);
        assert_eq!(x.to_string(), "rustc10d:12:-1:deadbeef00000001");
        assert_eq!(Handle::parse(&x.to_string()).unwrap(), x);
    }

    #[test]
    fn what_is_not_a_handle_is_refused() {
        for bad in
            ["", "gloo:0:-1:0:localhost:1", "rustc10d:0:-1", "rustc10d:a:-1:1", "rustc10d:0:-1:1:2", "rustc10d:0:1:zz"]
        {
            let e = Handle::parse(bad).unwrap_err();
            assert!(e.message.contains("is not a rustc10d reconfigure handle"), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn a_list_places_by_position() {
        let hs = [h(0, -1, 5), h(1, -1, 6), h(2, -1, 7)];
        let list = texts(&[hs[2], hs[0], hs[1]]);
        assert_eq!(place(&hs[0], &list, true).unwrap(), Place { rank: 1, size: 3 });
        assert_eq!(place(&hs[2], &list, true).unwrap(), Place { rank: 0, size: 3 });
    }

    #[test]
    fn a_set_places_by_rank_numerically_and_a_newcomer_after_the_survivor_of_its_rank() {
        // Text order would put rank 10 before rank 2.
        let survivors = [h(2, 4, 9), h(10, 4, 1), h(0, 4, 3)];
        let newcomer = h(2, -1, 0);
        let mut all = survivors.to_vec();
        all.push(newcomer);
        let set = texts(&all);
        assert_eq!(place(&survivors[2], &set, false).unwrap().rank, 0);
        assert_eq!(place(&newcomer, &set, false).unwrap().rank, 1);
        assert_eq!(place(&survivors[0], &set, false).unwrap().rank, 2);
        assert_eq!(place(&survivors[1], &set, false).unwrap(), Place { rank: 3, size: 4 });
    }

    #[test]
    fn bad_lists_are_refused_with_a_reason() {
        let me = h(0, 3, 1);
        let other = h(1, 3, 2);
        let cases: [(Vec<String>, &str); 4] = [
            (vec![], "at least one handle"),
            (texts(&[me, other, other]), "twice"),
            (texts(&[other]), "not among the 1 given"),
            (texts(&[h(0, 2, 1), other]), "stale"),
        ];
        for (list, says) in cases {
            let e = place(&me, &list, true).unwrap_err();
            assert!(e.message.contains(says), "{list:?}: {}", e.message);
        }
    }
}
