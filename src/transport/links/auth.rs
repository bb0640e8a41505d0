//! Proving membership of a group without showing its token. Every
//! connection opens with a challenge and response (the messages are in
//! frame.rs; dial.rs and accept.rs run them): each side draws a fresh random
//! nonce, and each proves that it knows the group's token by an HMAC-SHA256,
//! keyed by the token, over both nonces, both ranks, the group's size, the
//! protocol version and which side it is. The token never crosses the wire;
//! a proof is good for one connection only (the other side's nonce is new
//! each time), and one side's proof cannot stand in for the other's.

use crate::error::{Error, Result};
use crate::transport::frame::PROTOCOL_VERSION;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of the group's token (drawn by rank 0, shared through the Store).
pub const TOKEN_LEN: usize = 16;
/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof (an HMAC-SHA256).
pub const PROOF_LEN: usize = 32;

/// Sets this protocol's proofs apart from any other use of an HMAC keyed by the token.
const DOMAIN: &[u8] = b"rustc10d handshake";

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

/// This rank in its group, and the group's token: what it proves itself with.
pub struct Identity {
    pub rank: u32,
    pub size: u32,
    token: [u8; TOKEN_LEN],
}

impl std::fmt::Debug for Identity {
    // The token stays out of logs and panic messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity").field("rank", &self.rank).field("size", &self.size).finish_non_exhaustive()
    }
}

impl Identity {
    pub fn new(rank: u32, size: u32, token: [u8; TOKEN_LEN]) -> Identity {
        Identity { rank, size, token }
    }

    /// `side`'s proof for the connection `t`.
    pub fn prove(&self, side: Side, t: &Transcript) -> Proof {
        mac(&self.token, side, t).finalize().into_bytes().into()
    }

    /// Whether `proof` is `side`'s for `t`, compared in constant time (an
    /// attacker learns nothing from how long a wrong guess takes to fail).
    pub fn check(&self, side: Side, t: &Transcript, proof: &Proof) -> Result<()> {
        mac(&self.token, side, t)
            .verify_slice(proof)
            .map_err(|_| Error::io("the peer could not prove it belongs to this group (wrong token, or a replay)"))
    }
}

fn mac(token: &[u8; TOKEN_LEN], side: Side, t: &Transcript) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(token).expect("HMAC takes a key of any length");
    mac.update(DOMAIN);
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

    /// The proof's input, pinned: computed independently with Python's hmac module as
    /// hmac.new(bytes(range(16)), b"rustc10d handshake" + bytes([1]) + struct.pack("<4I",
    /// 10, 4, 1, 3) + b"\x11" * 32 + b"\x22" * 32, "sha256"). A change here changes the
    /// protocol, and PROTOCOL_VERSION with it.
    #[test]
    fn the_proof_covers_what_the_protocol_says() {
        assert_eq!(PROTOCOL_VERSION, 10, "the expected value below is for v10");
        let me = Identity::new(1, 4, std::array::from_fn(|i| i as u8));
        assert_eq!(
            hex(&me.prove(Side::Dialler, &transcript())),
            "fb79d641dd11c1a24416990ece0c86d94f46f70920e7ac03be98ddd083ef12e7"
        );
    }

    #[test]
    fn a_proof_holds_only_for_its_side_its_connection_and_its_token() {
        let me = Identity::new(3, 4, [7; TOKEN_LEN]);
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
        let stranger = Identity::new(3, 4, [8; TOKEN_LEN]);
        assert!(stranger.check(Side::Dialler, &t, &proof).is_err(), "another group's token");
        for bit in 0..PROOF_LEN * 8 {
            let mut flipped = proof;
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(me.check(Side::Dialler, &t, &flipped).is_err());
        }
    }

    #[test]
    fn nonces_are_fresh_and_the_token_stays_out_of_debug_output() {
        assert_ne!(nonce().unwrap(), nonce().unwrap());
        let me = Identity::new(0, 2, [0xAB; TOKEN_LEN]);
        let shown = format!("{me:?}");
        assert!(!shown.to_lowercase().contains("ab, ") && !shown.contains("171"), "{shown}");
    }
}
