//! Wire format: a fixed 40-byte frame header before every payload, and the
//! handshake that opens every connection (a hello, a challenge, a proof each
//! way: see auth.rs). Pure encode/decode, no I/O.

use crate::error::{Error, Result};
use crate::transport::links::auth::{Nonce, NONCE_LEN};

/// Bumped whenever ranks of two versions could not understand each other
/// (v2: ranks publish their host and shared-memory socket; v3: and the
/// settings every rank must share; v4: messages sent as their address; v5:
/// groups on several hosts run hierarchical algorithms, which ranks of v4
/// would not join; v6: a rank that timed out asks its peer what it waits for;
/// v7: groups on one host run their collectives and call checks in a shared
/// arena, handed out with the shared-memory connections to rank 0; v8: the
/// token no longer crosses the wire: ranks prove they know it by a challenge
/// and response; v9: a frame names the group it belongs to, so that groups
/// share one process's connections; v10: a rank that destroys a group says
/// so, which a rank of v9 would take for giving up on its connections; v11:
/// the key is derived from every rank's share (and the secret), no token
/// and no process id or address goes through the Store; v12: TCP frames
/// may be sealed, RUSTC10D_ENCRYPT, a setting v11 ranks do not know).
pub const PROTOCOL_VERSION: u32 = 12;
const FRAME_MAGIC: u32 = 0x5243_3130; // "RC10"
const HELLO_MAGIC: u32 = 0x5243_4832; // "RCH2"
const CHALLENGE_MAGIC: u32 = 0x5243_4e32; // "RCN2"
const REFUSAL_MAGIC: u32 = 0x5243_5246; // "RCRF"
pub const HEADER_LEN: usize = 40;
pub const HELLO_LEN: usize = 20 + NONCE_LEN;
pub const CHALLENGE_LEN: usize = 4 + NONCE_LEN;

/// Which matching space a message belongs to.
pub const KIND_COLLECTIVE: u8 = 1;
pub const KIND_P2P: u8 = 2;
/// The sender gives up on a group; the payload says why (UTF-8, at most
/// ABORT_MAX bytes). With sub `ABORT_CHANNEL` it gives up on that group's
/// channel alone (the connections stay, for the other groups), and the
/// channel field is the first collective whose messages it may not all have
/// sent (`Key::group_abort`); with sub `LEAVE_CHANNEL` it leaves that group
/// (destroyed it), having also sent every point-to-point message of it
/// before this frame (`Key::group_leave`); otherwise (group 0) on the
/// connections.
pub const KIND_ABORT: u8 = 3;
pub const ABORT_CHANNEL: u64 = 1;
pub const LEAVE_CHANNEL: u64 = 2;
pub const ABORT_MAX: u64 = 4096;
/// "What are you waiting for?" (no payload), from a rank that timed out
/// waiting for the receiver; answered with a message of `KIND_ANSWER`.
pub const KIND_ASK: u8 = 4;
pub const KIND_ANSWER: u8 = 5;
/// An answer's length: UTF-8, NUL-padded (see waits.rs).
pub const ANSWER_LEN: usize = 512;

/// Flag of a header whose message follows as its address (`Remote`), not its bytes.
const FLAG_REMOTE: u8 = 1;
/// What follows the header of a message sent as its address.
pub const REMOTE_LEN: usize = 16;

/// A message sent as its address in the sender's memory (shared-memory
/// peers only): the receiver reads it there, then acknowledges `id` (and
/// every earlier one) through the ring (`ring.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remote {
    pub addr: u64,
    pub id: u64,
}

impl Remote {
    pub fn encode(&self) -> [u8; REMOTE_LEN] {
        let mut b = [0u8; REMOTE_LEN];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; REMOTE_LEN]) -> Remote {
        Remote {
            addr: u64::from_le_bytes(b[0..8].try_into().unwrap()),
            id: u64::from_le_bytes(b[8..16].try_into().unwrap()),
        }
    }
}

/// What a message is matched on at the receiver, together with its sender.
/// Collectives use (sequence number, step); p2p uses (user tag, 0) and FIFO
/// order. `group` is the channel it travels in: 0 for the group that owns the
/// connections, another number for each group that shares them (channel.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    pub kind: u8,
    pub group: u64,
    pub channel: u64,
    pub sub: u64,
}

impl Key {
    pub fn collective(seq: u64, step: u64) -> Key {
        Key { kind: KIND_COLLECTIVE, group: 0, channel: seq, sub: step }
    }
    pub fn p2p(tag: i64) -> Key {
        Key { kind: KIND_P2P, group: 0, channel: tag as u64, sub: 0 }
    }
    pub fn abort() -> Key {
        Key { kind: KIND_ABORT, group: 0, channel: 0, sub: 0 }
    }

    /// Why this rank gives up on group `group`'s channel; its channel
    /// field: the first collective whose messages it may not all have sent.
    pub fn group_abort(group: u64, sent_below: u64) -> Key {
        Key { kind: KIND_ABORT, group, channel: sent_below, sub: ABORT_CHANNEL }
    }

    /// This rank leaves group `group` (it destroyed it) having sent every
    /// message of its collectives below `sent_below`, and of its
    /// point-to-point ops: a peer still takes those.
    pub fn group_leave(group: u64, sent_below: u64) -> Key {
        Key { kind: KIND_ABORT, group, channel: sent_below, sub: LEAVE_CHANNEL }
    }

    /// A question `depth` ranks down a chain of waits (see waits.rs).
    pub fn ask(depth: u64) -> Key {
        Key { kind: KIND_ASK, group: 0, channel: depth, sub: 0 }
    }
    pub fn answer() -> Key {
        Key { kind: KIND_ANSWER, group: 0, channel: 0, sub: 0 }
    }

    /// The same key in group `group`'s channel.
    pub fn in_group(self, group: u64) -> Key {
        Key { group, ..self }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub key: Key,
    /// The message's length (with `remote`, what the address holds).
    pub len: u64,
    /// The message follows as its address (`Remote`, REMOTE_LEN bytes).
    pub remote: bool,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4] = self.key.kind;
        b[5] = if self.remote { FLAG_REMOTE } else { 0 };
        b[8..16].copy_from_slice(&self.key.channel.to_le_bytes());
        b[16..24].copy_from_slice(&self.key.sub.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.key.group.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<FrameHeader> {
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap());
        if magic != FRAME_MAGIC {
            return Err(Error::io(format!("corrupt frame header (magic {magic:#x})")));
        }
        // Said apart from a wrong magic: a header that is right but for these
        // comes from a rank of another protocol, or one that lies.
        if b[5] & !FLAG_REMOTE != 0 || b[6..8] != [0, 0] {
            return Err(Error::io(format!(
                "corrupt frame header (reserved flags or bytes set: {:#04x} {:#04x} {:#04x})",
                b[5], b[6], b[7]
            )));
        }
        let kind = b[4];
        if !(KIND_COLLECTIVE..=KIND_ANSWER).contains(&kind) {
            return Err(Error::io(format!("corrupt frame header (kind {kind})")));
        }
        let remote = b[5] == FLAG_REMOTE;
        if remote && !matches!(kind, KIND_COLLECTIVE | KIND_P2P) {
            return Err(Error::io(format!("corrupt frame header (kind {kind} sent as an address)")));
        }
        Ok(FrameHeader {
            remote,
            key: Key {
                kind,
                group: u64::from_le_bytes(b[32..40].try_into().unwrap()),
                channel: u64::from_le_bytes(b[8..16].try_into().unwrap()),
                sub: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            },
            len: u64::from_le_bytes(b[24..32].try_into().unwrap()),
        })
    }
}

/// First bytes on every connection, from the rank that opens it: who it is,
/// whom it means to reach, and its nonce. It proves nothing by itself: the
/// listener answers a hello that fits with a `Challenge`, then the dialler
/// proves it knows the group's token (auth.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub version: u32,
    pub from: u32,
    pub to: u32,
    pub size: u32,
    pub nonce: Nonce,
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.version.to_le_bytes());
        b[8..12].copy_from_slice(&self.from.to_le_bytes());
        b[12..16].copy_from_slice(&self.to.to_le_bytes());
        b[16..20].copy_from_slice(&self.size.to_le_bytes());
        b[20..].copy_from_slice(&self.nonce);
        b
    }

    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello> {
        if u32::from_le_bytes(b[0..4].try_into().unwrap()) != HELLO_MAGIC {
            return Err(Error::io("not a rustc10d hello"));
        }
        Ok(Hello {
            version: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            from: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            to: u32::from_le_bytes(b[12..16].try_into().unwrap()),
            size: u32::from_le_bytes(b[16..20].try_into().unwrap()),
            nonce: b[20..].try_into().unwrap(),
        })
    }

    /// Whether a dialler's hello fits the group of `size` ranks where this
    /// rank is `rank` (a hello that fits still has to be proved).
    pub fn fits(&self, rank: u32, size: u32) -> Result<()> {
        if self.version != PROTOCOL_VERSION {
            return Err(Error::io(format!(
                "protocol version mismatch: peer speaks v{}, this rank v{PROTOCOL_VERSION}",
                self.version
            )));
        }
        if self.size != size || self.to != rank {
            return Err(Error::io(format!(
                "peer means rank {} of {} ranks, this is rank {rank} of {size}",
                self.to, self.size
            )));
        }
        if self.from >= size || self.from == rank {
            return Err(Error::io(format!("peer claims invalid rank {}", self.from)));
        }
        Ok(())
    }
}

/// The listener's answer to a hello that fits: its nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge {
    pub nonce: Nonce,
}

impl Challenge {
    pub fn encode(&self) -> [u8; CHALLENGE_LEN] {
        let mut b = [0u8; CHALLENGE_LEN];
        b[0..4].copy_from_slice(&CHALLENGE_MAGIC.to_le_bytes());
        b[4..].copy_from_slice(&self.nonce);
        b
    }

    pub fn decode(b: &[u8; CHALLENGE_LEN]) -> Result<Challenge> {
        match u32::from_le_bytes(b[0..4].try_into().unwrap()) {
            CHALLENGE_MAGIC => {}
            REFUSAL_MAGIC => return Err(Error::io(Refusal::describe(b))),
            _ => return Err(Error::io("not a rustc10d challenge")),
        }
        Ok(Challenge { nonce: b[4..].try_into().unwrap() })
    }
}

/// What a listener that cannot take a connection answers instead of a
/// challenge: why, so that the dialler fails at once, naming the reason,
/// instead of trying again until its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The listener's process is out of file descriptors: its limits.
    OutOfDescriptors { soft: u64, hard: u64 },
}

impl Refusal {
    const OUT_OF_DESCRIPTORS: u32 = 1;

    pub fn encode(&self) -> [u8; CHALLENGE_LEN] {
        let mut b = [0u8; CHALLENGE_LEN];
        b[0..4].copy_from_slice(&REFUSAL_MAGIC.to_le_bytes());
        match *self {
            Refusal::OutOfDescriptors { soft, hard } => {
                b[4..8].copy_from_slice(&Self::OUT_OF_DESCRIPTORS.to_le_bytes());
                b[8..16].copy_from_slice(&soft.to_le_bytes());
                b[16..24].copy_from_slice(&hard.to_le_bytes());
            }
        }
        b
    }

    /// Why the peer refused, from its answer (`b` starts with REFUSAL_MAGIC).
    fn describe(b: &[u8; CHALLENGE_LEN]) -> String {
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        match u32::from_le_bytes(b[4..8].try_into().unwrap()) {
            Self::OUT_OF_DESCRIPTORS => format!(
                "it cannot take the connection: {}",
                crate::transport::links::fd_limit::out_of_descriptors("its process", Some((word(8), word(16))))
            ),
            code => format!("it refused the connection (reason {code}, unknown to this rank)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_an_error_that_says_why() {
        let refusal = Refusal::OutOfDescriptors { soft: 128, hard: 4096 }.encode();
        let e = Challenge::decode(&refusal).unwrap_err();
        assert!(e.message.contains("RLIMIT_NOFILE: soft 128, hard 4096"), "{}", e.message);
        assert!(e.message.contains("ulimit -n"), "{}", e.message);
        let mut unknown = refusal;
        unknown[4] = 9;
        let e = Challenge::decode(&unknown).unwrap_err();
        assert!(e.message.contains("reason 9"), "{}", e.message);
    }

    #[test]
    fn header_roundtrip_and_corruption() {
        let h = FrameHeader { key: Key::collective(7, 3), len: 1 << 33, remote: false };
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        let p = FrameHeader { key: Key::p2p(-5), len: 0, remote: true };
        assert_eq!(FrameHeader::decode(&p.encode()).unwrap(), p);
        let a = FrameHeader { key: Key::abort(), len: 9, remote: false };
        assert_eq!(FrameHeader::decode(&a.encode()).unwrap(), a);
        let r = Remote { addr: 0x7f00_1234_5678, id: 77 };
        assert_eq!(Remote::decode(&r.encode()), r);
        assert!(
            FrameHeader::decode(&FrameHeader { remote: true, ..a }.encode()).is_err(),
            "only messages go as addresses"
        );
        let mut bad = h.encode();
        bad[5] = 2;
        assert!(FrameHeader::decode(&bad).is_err());
        let mut bad = h.encode();
        bad[0] ^= 1;
        assert!(FrameHeader::decode(&bad).is_err());
        let mut bad = h.encode();
        bad[4] = 9;
        assert!(FrameHeader::decode(&bad).is_err());
        bad[4] = 0;
        assert!(FrameHeader::decode(&bad).is_err());
    }

    #[test]
    fn hello_and_challenge_roundtrip_and_checks() {
        let hello = Hello { version: PROTOCOL_VERSION, from: 2, to: 0, size: 4, nonce: [9; NONCE_LEN] };
        assert_eq!(Hello::decode(&hello.encode()).unwrap(), hello);
        assert!(hello.fits(0, 4).is_ok());
        assert!(hello.fits(1, 4).is_err(), "meant for another rank");
        assert!(hello.fits(0, 5).is_err(), "another group's size");
        assert!(Hello { version: 7, ..hello }.fits(0, 4).is_err());
        assert!(Hello { from: 4, ..hello }.fits(0, 4).is_err());
        assert!(Hello { from: 0, ..hello }.fits(0, 4).is_err(), "a peer cannot be me");
        assert!(Hello::decode(&[0u8; HELLO_LEN]).is_err());
        let challenge = Challenge { nonce: [3; NONCE_LEN] };
        assert_eq!(Challenge::decode(&challenge.encode()).unwrap(), challenge);
        assert!(Challenge::decode(&[0u8; CHALLENGE_LEN]).is_err());
        let mut as_challenge = [0u8; CHALLENGE_LEN];
        as_challenge.copy_from_slice(&hello.encode()[..CHALLENGE_LEN]);
        assert!(Challenge::decode(&as_challenge).is_err(), "a hello is not a challenge");
    }

    // The decoders face the network: any bytes must give Ok or Err, never a panic,
    // and whatever encodes must decode to itself.
    proptest::proptest! {
        #[test]
        fn decoders_take_any_bytes(b in proptest::collection::vec(proptest::prelude::any::<u8>(), HELLO_LEN)) {
            let _ = FrameHeader::decode(b[..HEADER_LEN].try_into().unwrap());
            let _ = Hello::decode(b[..].try_into().unwrap());
            let _ = Challenge::decode(b[..CHALLENGE_LEN].try_into().unwrap());
        }

        #[test]
        fn headers_roundtrip(p2p in proptest::prelude::any::<bool>(), channel in proptest::prelude::any::<u64>(),
                             sub in proptest::prelude::any::<u64>(), len in proptest::prelude::any::<u64>(),
                             remote in proptest::prelude::any::<bool>(), group in proptest::prelude::any::<u64>()) {
            let kind = if p2p { KIND_P2P } else { KIND_COLLECTIVE };
            let h = FrameHeader { key: Key { kind, group, channel, sub }, len, remote };
            proptest::prop_assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        }

        // Exactly the headers the protocol allows decode, and each to what
        // re-encodes to the same bytes: no bit of a header is ignored.
        // Headers near valid ones (the right magic, reserved bytes mostly
        // zero), where random bytes would almost never reach.
        #[test]
        fn a_header_decodes_exactly_when_the_protocol_allows_it(
            magic_ok in proptest::prelude::any::<bool>(), kind in 0u8..8, flags in proptest::prop_oneof![0u8..2, proptest::prelude::any::<u8>()],
            reserved in proptest::prop_oneof![proptest::strategy::Just([0u8; 2]), proptest::prelude::any::<[u8; 2]>()],
            words in proptest::prelude::any::<[u64; 4]>(), bad_magic in 1u32..,
        ) {
            let mut b = [0u8; HEADER_LEN];
            b[0..4].copy_from_slice(&(if magic_ok { FRAME_MAGIC } else { FRAME_MAGIC ^ bad_magic }).to_le_bytes());
            b[4] = kind;
            b[5] = flags;
            b[6..8].copy_from_slice(&reserved);
            for (i, w) in words.iter().enumerate() {
                b[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_le_bytes());
            }
            let allowed = magic_ok && reserved == [0, 0] && flags <= FLAG_REMOTE
                && (KIND_COLLECTIVE..=KIND_ANSWER).contains(&kind)
                && (flags == 0 || matches!(kind, KIND_COLLECTIVE | KIND_P2P));
            match FrameHeader::decode(&b) {
                Ok(h) => {
                    proptest::prop_assert!(allowed, "decoded a header the protocol does not allow: {:?}", b);
                    proptest::prop_assert_eq!(h.encode(), b);
                    proptest::prop_assert_eq!((h.key.channel, h.key.sub, h.len, h.key.group), (words[0], words[1], words[2], words[3]));
                }
                Err(e) => {
                    proptest::prop_assert!(!allowed, "refused an allowed header: {}", e.message);
                    proptest::prop_assert!(e.message.starts_with("corrupt frame header ("), "{}", e.message);
                }
            }
        }

        // Hellos, challenges and addresses: every value round-trips, and
        // whatever decodes re-encodes to the bytes it came from.
        #[test]
        fn hellos_challenges_and_addresses_roundtrip(
            version in proptest::prelude::any::<u32>(), from in proptest::prelude::any::<u32>(), to in proptest::prelude::any::<u32>(),
            size in proptest::prelude::any::<u32>(), nonce in proptest::prelude::any::<[u8; NONCE_LEN]>(),
            addr in proptest::prelude::any::<u64>(), id in proptest::prelude::any::<u64>(),
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), HELLO_LEN),
        ) {
            let hello = Hello { version, from, to, size, nonce };
            proptest::prop_assert_eq!(Hello::decode(&hello.encode()).unwrap(), hello);
            let challenge = Challenge { nonce };
            proptest::prop_assert_eq!(Challenge::decode(&challenge.encode()).unwrap(), challenge);
            let remote = Remote { addr, id };
            proptest::prop_assert_eq!(Remote::decode(&remote.encode()), remote);
            // With the right magic, any other bytes decode, to what they say.
            let mut b: [u8; HELLO_LEN] = raw[..].try_into().unwrap();
            b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
            proptest::prop_assert_eq!(Hello::decode(&b).unwrap().encode(), b);
            let mut c: [u8; CHALLENGE_LEN] = raw[..CHALLENGE_LEN].try_into().unwrap();
            c[0..4].copy_from_slice(&CHALLENGE_MAGIC.to_le_bytes());
            proptest::prop_assert_eq!(Challenge::decode(&c).unwrap().encode(), c);
            // Whatever a hello says, checking it against a group never panics.
            let _ = Hello::decode(&b).unwrap().fits(to, size);
        }
    }
}
