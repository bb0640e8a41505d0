//! The job's shared secret: a root of trust the user chooses, given out of
//! band (`RUSTC10D_SECRET`, or `RUSTC10D_SECRET_FILE` naming a file only its
//! owner may read), instead of the Store, which torch's TCPStore serves to
//! anyone who can reach its port, unauthenticated.
//!
//! It protects two things (docs/security.md has the threat model):
//! - the group's key (`auth::GroupKey`), derived from it and from every
//!   rank's fresh share: a process that reads the Store but lacks the secret
//!   cannot prove membership to any rank, so it cannot join, inject, abort or
//!   relay; and
//! - the rendezvous' values (`Sealed`): each carries a tag of the secret over
//!   its key and value, so a value written by anyone else (an address that
//!   redirects a rank, a refusal, a vote) fails init naming the key, rather
//!   than being believed.
//!
//! Without it both work as before the secret existed, and the Store is the
//! root of trust, as it is for Gloo and NCCL.

use crate::error::{Error, Result};
use crate::rendezvous::Store;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::time::Duration;

/// The shortest secret taken: a shorter one could be guessed offline from
/// a recorded handshake (its nonces and proof).
pub const MIN_SECRET_BYTES: usize = 16;

/// Bytes of a value's tag (an HMAC-SHA256).
const TAG_LEN: usize = 32;

/// Sets the Store's tags apart from every other MAC keyed by the secret.
const STORE_DOMAIN: &[u8] = b"rustc10d store value";

pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    // The secret stays out of logs, error texts and panic messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(hidden)")
    }
}

impl Secret {
    /// The secret given as text (RUSTC10D_SECRET); the error never shows it.
    pub fn new(text: &str) -> std::result::Result<Secret, String> {
        if text.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "a secret of {} bytes is too short to resist guessing: give at least {MIN_SECRET_BYTES} \
                 (e.g. `openssl rand -hex 32`)",
                text.len()
            ));
        }
        Ok(Secret(text.as_bytes().to_vec()))
    }

    /// The secret in a file (RUSTC10D_SECRET_FILE), which no one but its
    /// owner may read or write, as ssh demands of a private key; the
    /// whitespace around it is not part of it.
    pub fn from_file(path: &str) -> std::result::Result<Secret, String> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).map_err(|e| format!("cannot read it: {e}"))?;
        if meta.mode() & 0o077 != 0 {
            return Err(format!(
                "other users may read or write it (mode {:o}): `chmod 600 {path}`, as for an ssh key",
                meta.mode() & 0o777
            ));
        }
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
        let text = std::str::from_utf8(&bytes).map_err(|_| "it is not text".to_string())?;
        Secret::new(text.trim())
    }

    /// The key of every MAC made with the secret (auth's group key and the Store's tags).
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// The MAC of `value` under `key`: its finalized bytes are the value's tag.
    fn tag(&self, key: &str, value: &[u8]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(STORE_DOMAIN);
        // Lengths first, so that no two (key, value) pairs encode alike.
        mac.update(&(key.len() as u64).to_le_bytes());
        mac.update(key.as_bytes());
        mac.update(&(value.len() as u64).to_le_bytes());
        mac.update(value);
        mac
    }
}

/// The Store as the rendezvous uses it: with a secret, each value set gets
/// its tag appended, and each value read must carry the right one; without,
/// the Store itself. `add` counters carry no tag (a Store writer can skew
/// them, as it can delete keys: that stops init, at its timeout, and
/// nothing more).
pub struct Sealed<'a> {
    pub store: &'a dyn Store,
    pub secret: Option<&'a Secret>,
}

impl Store for Sealed<'_> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.secret {
            None => self.store.set(key, value),
            Some(secret) => self.store.set(key, &[value, &secret.tag(key, value).finalize().into_bytes()[..]].concat()),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut sealed = self.store.get(key, timeout)?;
        let Some(secret) = self.secret else { return Ok(sealed) };
        let forged = || {
            Error::invalid(format!(
                "rustc10d: the Store's value under {key} was not written with this rank's secret: the ranks \
                 were given different secrets (RUSTC10D_SECRET or RUSTC10D_SECRET_FILE), or a process without \
                 it wrote there (see docs/security.md)"
            ))
        };
        let Some(at) = sealed.len().checked_sub(TAG_LEN) else { return Err(forged()) };
        // Compared in constant time, as the handshake's proofs are.
        secret.tag(key, &sealed[..at]).verify_slice(&sealed[at..]).map_err(|_| forged())?;
        sealed.truncate(at);
        Ok(sealed)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.store.add(key, delta)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.store.delete(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::MemStore;

    fn secret(s: &str) -> Secret {
        Secret::new(s).unwrap()
    }

    #[test]
    fn a_short_secret_is_refused_without_showing_it() {
        let err = Secret::new("hunter2").unwrap_err();
        assert!(err.contains("7 bytes is too short") && !err.contains("hunter2"), "{err}");
        assert_eq!(format!("{:?}", secret("correct horse battery staple")), "Secret(hidden)");
    }

    #[test]
    fn a_secret_file_must_be_its_owners_alone() {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("rustc10d-secret-{}", std::process::id()));
        std::fs::write(&path, "  0123456789abcdef0123\n").unwrap();
        let p = path.to_str().unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Secret::from_file(p).unwrap_err();
        assert!(err.contains("mode 644") && err.contains("chmod 600"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(Secret::from_file(p).unwrap().bytes(), b"0123456789abcdef0123", "trimmed");
        std::fs::remove_file(&path).unwrap();
        assert!(Secret::from_file(p).unwrap_err().contains("cannot read it"));
    }

    #[test]
    fn sealed_values_round_trip_and_anything_else_is_refused() {
        let store = MemStore::default();
        let (ours, theirs) = (secret("the job's own secret"), secret("another job's secret"));
        let sealed = Sealed { store: &store, secret: Some(&ours) };
        let t = Duration::from_millis(10);
        sealed.set("rustc10d/0/addr/1", b"v11 somewhere").unwrap();
        assert_eq!(sealed.get("rustc10d/0/addr/1", t).unwrap(), b"v11 somewhere");
        // The raw Store holds the value and its tag.
        assert_eq!(store.get("rustc10d/0/addr/1", t).unwrap().len(), b"v11 somewhere".len() + TAG_LEN);
        // Another secret's tag, a bare value, a value moved to another key, a flipped bit.
        Sealed { store: &store, secret: Some(&theirs) }.set("k/other", b"v11 elsewhere").unwrap();
        store.set("k/bare", b"v11 elsewhere, untagged, long enough to hold a tag").unwrap();
        store.set("k/short", b"v11").unwrap();
        store.set("k/moved", &store.get("rustc10d/0/addr/1", t).unwrap()).unwrap();
        let mut flipped = store.get("rustc10d/0/addr/1", t).unwrap();
        flipped[0] ^= 1;
        store.set("k/flipped", &flipped).unwrap();
        for key in ["k/other", "k/bare", "k/short", "k/moved", "k/flipped"] {
            let err = sealed.get(key, t).unwrap_err();
            assert!(err.message.contains(&format!("under {key} was not written with this rank's secret")), "{err:?}");
        }
        // Without a secret the Store is read as it is.
        assert_eq!(Sealed { store: &store, secret: None }.get("k/short", t).unwrap(), b"v11");
    }
}
