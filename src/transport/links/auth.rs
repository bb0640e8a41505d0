//! Proving membership of a group without showing its key. Every
//! connection opens with a challenge and response (the messages are in
//! frame.rs; dial.rs and accept.rs run them): each side draws a fresh random
//! nonce, and each proves that it knows the group's key by an HMAC-SHA256,
//! keyed by it, over both nonces, both ranks, the group's size, the
//! protocol version and which side it is. The key never crosses the wire;
//! a proof is good for one connection only (the other side's nonce is new
//! each time), and one side's proof cannot stand in for the other's.
//!
//! The group's key is derived from every rank's share, a fresh random value
//! each publishes at rendezvous, and from the job's secret where one is
//! given (secret.rs). Each rank derives it with its own share as it drew
//! it, so no one can make a group of this incarnation agree on a key that
//! another group (or an earlier incarnation) used; and without the secret,
//! the shares a Store reader sees are not enough to derive it.

use crate::error::{Error, Result};
use crate::transport::links::frame::PROTOCOL_VERSION;
use crate::transport::links::seal::SealKeys;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of each rank's share of the group's key (drawn by it, published through the Store).
pub const SHARE_LEN: usize = 16;
/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof (an HMAC-SHA256).
pub const PROOF_LEN: usize = 32;

/// Sets this protocol's proofs apart from any other use of an HMAC keyed by the group's key.
const DOMAIN: &[u8] = b"rustc10d handshake";
/// Sets the key's derivation apart from every other MAC keyed by the secret.
const KEY_DOMAIN: &[u8] = b"rustc10d group key";
/// Sets the keys that seal a connection's frames (seal.rs) apart from its proofs.
const SEAL_DOMAIN: &[u8] = b"rustc10d seal";

pub type Share = [u8; SHARE_LEN];
pub type Nonce = [u8; NONCE_LEN];
pub type Proof = [u8; PROOF_LEN];

/// Which end of a connection makes a proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The rank that opened the connection (it proves itself first).
    Dialler = 1,
    /// The rank that accepted it (it proves itself only to a dialler that has).
    Listener = 2,
}

/// What both proofs of one connection cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transcript {
    pub size: u32,
    pub dialler: u32,
    pub listener: u32,
    pub dialler_nonce: Nonce,
    pub listener_nonce: Nonce,
}

/// The key every member of one incarnation of a group proves itself with.
#[derive(Clone, PartialEq, Eq)]
pub struct GroupKey([u8; 32]);

impl GroupKey {
    /// The key of the group whose ranks drew `shares` (in rank order), with
    /// the job's `secret` (empty: none, and anyone who read the shares can
    /// derive it, as anyone who read the token could before).
    pub fn derive(secret: &[u8], shares: &[Share]) -> GroupKey {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes a key of any length");
        mac.update(KEY_DOMAIN);
        mac.update(&(shares.len() as u64).to_le_bytes());
        for share in shares {
            mac.update(share);
        }
        GroupKey(mac.finalize().into_bytes().into())
    }

    /// Its bytes, for tests that look for them on the wire.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for GroupKey {
    // The key stays out of logs and panic messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GroupKey(hidden)")
    }
}

/// This rank in its group, and the group's key: what it proves itself with.
pub struct Identity {
    pub rank: u32,
    pub size: u32,
    key: GroupKey,
    /// Whether TCP connections seal their frames once proved (RUSTC10D_ENCRYPT).
    pub seals: bool,
}

impl std::fmt::Debug for Identity {
    // The key stays out of logs and panic messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity").field("rank", &self.rank).field("size", &self.size).finish_non_exhaustive()
    }
}

impl Identity {
    pub fn new(rank: u32, size: u32, key: GroupKey) -> Identity {
        Identity { rank, size, key, seals: false }
    }

    /// The same, sealing its TCP connections' frames (`on`).
    pub fn sealing(self, on: bool) -> Identity {
        Identity { seals: on, ..self }
    }

    /// `side`'s proof for the connection `t`.
    pub fn prove(&self, side: Side, t: &Transcript) -> Proof {
        mac(&self.key, DOMAIN, side, t).finalize().into_bytes().into()
    }

    /// The keys that seal the frames of connection `t` (seal.rs), for its
    /// `side`, where this group seals them: one per direction, each new with
    /// the connection's nonces, never derivable from the proofs on the wire.
    pub fn seal_keys(&self, side: Side, t: &Transcript) -> Option<SealKeys> {
        let key = |from: Side| mac(&self.key, SEAL_DOMAIN, from, t).finalize().into_bytes().into();
        let other = match side {
            Side::Dialler => Side::Listener,
            Side::Listener => Side::Dialler,
        };
        self.seals.then(|| SealKeys { send: key(side), open: key(other) })
    }

    /// Whether `proof` is `side`'s for `t`, compared in constant time (an
    /// attacker learns nothing from how long a wrong guess takes to fail).
    pub fn check(&self, side: Side, t: &Transcript, proof: &Proof) -> Result<()> {
        mac(&self.key, DOMAIN, side, t).verify_slice(proof).map_err(|_| {
            Error::io(
                "the peer could not prove it belongs to this group (another group's key, a replay, or a \
                 process without the job's secret)",
            )
        })
    }
}

fn mac(key: &GroupKey, domain: &[u8], side: Side, t: &Transcript) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&key.0).expect("HMAC takes a key of any length");
    mac.update(domain);
    mac.update(&[side as u8]);
    // Fixed-width fields, so that no two transcripts encode alike.
    for word in [PROTOCOL_VERSION, t.size, t.dialler, t.listener] {
        mac.update(&word.to_le_bytes());
    }
    mac.update(&t.dialler_nonce);
    mac.update(&t.listener_nonce);
    mac
}

/// A fresh nonce from the kernel's random source.
pub fn nonce() -> Result<Nonce> {
    let mut n = [0u8; NONCE_LEN];
    fill_random(&mut n)?;
    Ok(n)
}

/// Fill `buf` from getrandom(2) (which may return less than asked, or be
/// interrupted by a signal).
pub fn fill_random(buf: &mut [u8]) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a live, writable slice of `rest.len()` bytes, all the kernel may write.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n > 0 {
            done += n as usize;
        } else if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        } else {
            return Err(Error::io(format!("rustc10d: getrandom failed: {}", std::io::Error::last_os_error())));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn transcript() -> Transcript {
        Transcript {
            size: 4,
            dialler: 1,
            listener: 3,
            dialler_nonce: [0x11; NONCE_LEN],
            listener_nonce: [0x22; NONCE_LEN],
        }
    }

    /// The crate computes HMAC-SHA256 (RFC 4231, test case 2).
    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex(&mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    /// The key's derivation and the proof's input, pinned: computed independently with
    /// Python's hmac module as key = hmac.new(b"0123456789abcdef", b"rustc10d group key" +
    /// struct.pack("<Q", 2) + b"\x01" * 16 + b"\x02" * 16, "sha256").digest(), then
    /// hmac.new(key, b"rustc10d handshake" + bytes([1]) + struct.pack("<4I", 11, 4, 1, 3) +
    /// b"\x11" * 32 + b"\x22" * 32, "sha256"), and the sealing keys likewise with b"rustc10d seal"
    /// and the side (1 for what the dialler seals, 2 for the listener). A change here changes
    /// the protocol, and PROTOCOL_VERSION with it.
    #[test]
    fn the_key_and_the_proof_cover_what_the_protocol_says() {
        assert_eq!(PROTOCOL_VERSION, 12, "the expected values below are for v12");
        let key = GroupKey::derive(b"0123456789abcdef", &[[0x01; SHARE_LEN], [0x02; SHARE_LEN]]);
        assert_eq!(hex(key.bytes()), "eec845f397b2567017806ec63a2e0f80d0863845a75591d7fdc843db9486903d");
        let me = Identity::new(1, 4, key);
        assert_eq!(
            hex(&me.prove(Side::Dialler, &transcript())),
            "cfe2d82118a05d097676bdf4e017206a27336c7d9eae5f6735c018e76a75cd41"
        );
        let keys = me.sealing(true).seal_keys(Side::Dialler, &transcript()).unwrap();
        assert_eq!(hex(&keys.send), "f6004c4d2b3b1412879cb834c06b9f65ba28052f22bbed65278d9d3acef89271");
        assert_eq!(hex(&keys.open), "14720b9cf51250acf835c5c2d1d5c970d3401d71ac619cc0abc193be0e0c03d2");
    }

    /// Every share, its place, and the secret change the key.
    #[test]
    fn the_key_depends_on_every_share_and_the_secret() {
        let shares = [[1; SHARE_LEN], [2; SHARE_LEN], [3; SHARE_LEN]];
        let key = GroupKey::derive(b"", &shares);
        assert_eq!(key, GroupKey::derive(b"", &shares), "deterministic");
        for rank in 0..3 {
            let mut other = shares;
            other[rank][0] ^= 1;
            assert_ne!(key, GroupKey::derive(b"", &other), "rank {rank}'s share");
        }
        assert_ne!(key, GroupKey::derive(b"", &[shares[1], shares[0], shares[2]]), "the order");
        assert_ne!(key, GroupKey::derive(b"", &shares[..2]), "the count");
        assert_ne!(key, GroupKey::derive(b"a job's secret, 16+", &shares), "the secret");
    }

    /// A connection's two sides agree on its keys: what one seals with, the
    /// other opens with; each direction, each connection and each group has
    /// its own, none of them a proof that crosses the wire; none without the setting.
    #[test]
    fn sealing_keys_pair_up_per_direction_and_connection() {
        let key = GroupKey::derive(b"", &[[7; SHARE_LEN]; 4]);
        let (dialler, listener) =
            (Identity::new(1, 4, key.clone()).sealing(true), Identity::new(3, 4, key).sealing(true));
        let t = transcript();
        let (d, l) = (dialler.seal_keys(Side::Dialler, &t).unwrap(), listener.seal_keys(Side::Listener, &t).unwrap());
        assert_eq!((d.send, d.open), (l.open, l.send));
        assert_ne!(d.send, d.open);
        for proof in [dialler.prove(Side::Dialler, &t), dialler.prove(Side::Listener, &t)] {
            assert!(proof != d.send && proof != d.open);
        }
        let other = dialler.seal_keys(Side::Dialler, &Transcript { listener_nonce: [0x23; NONCE_LEN], ..t }).unwrap();
        assert!(other.send != d.send && other.open != d.open, "another connection");
        let stranger = Identity::new(1, 4, GroupKey::derive(b"", &[[8; SHARE_LEN]; 4])).sealing(true);
        assert_ne!(stranger.seal_keys(Side::Dialler, &t).unwrap().send, d.send, "another group");
        assert!(Identity::new(1, 4, GroupKey::derive(b"", &[[7; SHARE_LEN]; 4]))
            .seal_keys(Side::Dialler, &t)
            .is_none());
    }

    #[test]
    fn a_proof_holds_only_for_its_side_its_connection_and_its_key() {
        let me = Identity::new(3, 4, GroupKey::derive(b"", &[[7; SHARE_LEN]; 4]));
        let t = transcript();
        let proof = me.prove(Side::Dialler, &t);
        me.check(Side::Dialler, &t, &proof).unwrap();
        assert!(me.check(Side::Listener, &t, &proof).is_err(), "a dialler's proof is not a listener's");
        let others = [
            Transcript { size: 5, ..t },
            Transcript { dialler: 2, ..t },
            Transcript { listener: 0, ..t },
            Transcript { dialler_nonce: [0x12; NONCE_LEN], ..t },
            Transcript { listener_nonce: [0x23; NONCE_LEN], ..t },
        ];
        for other in others {
            assert!(me.check(Side::Dialler, &other, &proof).is_err(), "replayed for {other:?}");
        }
        let stranger = Identity::new(3, 4, GroupKey::derive(b"", &[[8; SHARE_LEN]; 4]));
        assert!(stranger.check(Side::Dialler, &t, &proof).is_err(), "another group's key");
        for bit in 0..PROOF_LEN * 8 {
            let mut flipped = proof;
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(me.check(Side::Dialler, &t, &flipped).is_err());
        }
    }

    #[test]
    fn nonces_are_fresh_and_the_key_stays_out_of_debug_output() {
        assert_ne!(nonce().unwrap(), nonce().unwrap());
        let key = GroupKey::derive(b"", &[[0xAB; SHARE_LEN]; 2]);
        assert_eq!(format!("{key:?}"), "GroupKey(hidden)");
        assert_eq!(format!("{:?}", Identity::new(0, 2, key)), "Identity { rank: 0, size: 2, .. }");
    }
}
