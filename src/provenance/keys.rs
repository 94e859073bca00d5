//! The Ed25519 keys that sign receipts and audit checkpoints, and the public keys that verify them.
//!
//! The signing key is a PKCS#8 PEM file (`-----BEGIN PRIVATE KEY-----`, RFC 8410), as
//! `openssl genpkey -algorithm ed25519` writes it, so standard tools read it. A missing file is
//! made at start: 32 random bytes, written to a private temp file (mode 0600, created new) and
//! linked into place, so a crash leaves either no key or a whole one and two daemons starting at
//! once end up with the same key. A key file that group or others may read or write is refused.
//!
//! Public keys are PEM SubjectPublicKeyInfo (`-----BEGIN PUBLIC KEY-----`, `openssl pkey -pubout`).
//! A key's `keyid` is the lowercase hex SHA-256 of its raw 32-byte public key. A [`KeySet`] holds
//! the public keys a verifier trusts (several: a rotated key stays listed while its receipts
//! matter).
//!
//! Owns: reading, making and checking key files; keyids. Must not: decide what is signed.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
pub use ed25519_dalek::{SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};

/// The signing key's file name when `receipts.signing_key_file` is not set (under `state.dir`).
pub const DEFAULT_KEY_FILE_NAME: &str = "receipts-ed25519.pem";

/// Key files are a few hundred bytes; anything much larger is not one.
const MAX_KEY_FILE_BYTES: u64 = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("key file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "receipts signing key {path} has mode {mode:04o}: a signing key must not be readable or \
         writable by group or others (chmod 600 {path})"
    )]
    Mode { path: PathBuf, mode: u32 },
    #[error("key file {path}: {message}")]
    Format { path: PathBuf, message: String },
}

/// `keyid` of a public key: lowercase hex SHA-256 of its 32 bytes.
pub fn keyid(key: &VerifyingKey) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Whether the signing key was read or made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    Loaded,
    Generated,
}

/// Reads the signing key at `path`, or makes one there when no file exists. Refuses a file that
/// group or others may access, and one that is not an Ed25519 PKCS#8 PEM key.
pub fn load_or_generate(path: &Path) -> Result<(SigningKey, KeySource), KeyError> {
    match load_signing_key(path) {
        Err(KeyError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
        other => return other.map(|k| (k, KeySource::Loaded)),
    }
    // The operating system's generator itself, for a key that lives long.
    let mut seed = zeroize::Zeroizing::new([0u8; 32]);
    rand::TryRngCore::try_fill_bytes(&mut rand::rngs::OsRng, &mut *seed).map_err(|e| {
        KeyError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(format!("no random bytes for a new key: {e}")),
        }
    })?;
    let key = SigningKey::from_bytes(&seed);
    match write_new(path, &key) {
        Ok(()) => Ok((key, KeySource::Generated)),
        // Another process made it first: use theirs.
        Err(KeyError::Io { source, .. }) if source.kind() == std::io::ErrorKind::AlreadyExists => {
            load_signing_key(path).map(|k| (k, KeySource::Loaded))
        }
        Err(e) => Err(e),
    }
}

/// Reads the signing key at `path` (see [`load_or_generate`] for what is refused).
pub fn load_signing_key(path: &Path) -> Result<SigningKey, KeyError> {
    let io = |source| KeyError::Io {
        path: path.to_path_buf(),
        source,
    };
    let f = File::open(path).map_err(io)?;
    let mode = f.metadata().map_err(io)?.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(KeyError::Mode {
            path: path.to_path_buf(),
            mode,
        });
    }
    let text = zeroize::Zeroizing::new(read_bounded(f).map_err(io)?);
    SigningKey::from_pkcs8_pem(&text).map_err(|e| KeyError::Format {
        path: path.to_path_buf(),
        message: format!("not an Ed25519 private key in PKCS#8 PEM ({e})"),
    })
}

/// Reads a public key file: PEM SubjectPublicKeyInfo of an Ed25519 key.
pub fn read_public_key(path: &Path) -> Result<VerifyingKey, KeyError> {
    let io = |source| KeyError::Io {
        path: path.to_path_buf(),
        source,
    };
    let text = read_bounded(File::open(path).map_err(io)?).map_err(io)?;
    public_key_from_pem(&text).map_err(|message| KeyError::Format {
        path: path.to_path_buf(),
        message,
    })
}

/// An Ed25519 public key from PEM SubjectPublicKeyInfo text.
pub fn public_key_from_pem(text: &str) -> Result<VerifyingKey, String> {
    VerifyingKey::from_public_key_pem(text)
        .map_err(|e| format!("not an Ed25519 public key in PEM SubjectPublicKeyInfo ({e})"))
}

/// The PEM SubjectPublicKeyInfo of a public key (what [`read_public_key`] reads).
pub fn public_key_pem(key: &VerifyingKey) -> String {
    // Encoding 32 bytes into a fixed ASN.1 structure cannot fail.
    key.to_public_key_pem(ed25519_dalek::pkcs8::spki::der::pem::LineEnding::LF)
        .unwrap_or_default()
}

fn read_bounded(f: File) -> std::io::Result<String> {
    let mut text = String::new();
    f.take(MAX_KEY_FILE_BYTES).read_to_string(&mut text)?;
    Ok(text)
}

/// The PKCS#8 v1 PEM of `key` (the seed alone, no public key: what OpenSSL writes).
fn private_key_pem(key: &SigningKey) -> Result<zeroize::Zeroizing<String>, String> {
    ed25519_dalek::pkcs8::KeypairBytes {
        secret_key: key.to_bytes(),
        public_key: None,
    }
    .to_pkcs8_pem(ed25519_dalek::pkcs8::spki::der::pem::LineEnding::LF)
    .map_err(|e| e.to_string())
}

/// Writes `key` at `path`, which must not exist: a private temp file beside it, fsync'd, then
/// hard-linked into place (a link never replaces a file, unlike a rename), then the directory
/// fsync'd.
fn write_new(path: &Path, key: &SigningKey) -> Result<(), KeyError> {
    let io = |source| KeyError::Io {
        path: path.to_path_buf(),
        source,
    };
    let dir = match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(d) => d,
        None => Path::new("."),
    };
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io)?;
    }
    let pem = private_key_pem(key).map_err(|e| KeyError::Format {
        path: path.to_path_buf(),
        message: format!("cannot encode the key: {e}"),
    })?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        ".{name}.{}.{:016x}.tmp",
        std::process::id(),
        rand::random::<u64>()
    ));
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(pem.as_bytes())?;
            f.sync_all()
        })
        .and_then(|()| std::fs::hard_link(&tmp, path));
    let _ = std::fs::remove_file(&tmp);
    written.map_err(io)?;
    File::open(dir).and_then(|d| d.sync_all()).map_err(io)
}

/// The public keys a verifier trusts, by keyid.
#[derive(Debug, Clone, Default)]
pub struct KeySet {
    keys: BTreeMap<String, VerifyingKey>,
}

impl KeySet {
    pub fn new() -> KeySet {
        KeySet::default()
    }

    /// Adds a key; returns its keyid.
    pub fn insert(&mut self, key: VerifyingKey) -> String {
        let id = keyid(&key);
        self.keys.insert(id.clone(), key);
        id
    }

    /// Reads each public key file (see [`read_public_key`]).
    pub fn from_files<P: AsRef<Path>>(paths: &[P]) -> Result<KeySet, KeyError> {
        let mut set = KeySet::new();
        for p in paths {
            set.insert(read_public_key(p.as_ref())?);
        }
        Ok(set)
    }

    pub fn get(&self, keyid: &str) -> Option<&VerifyingKey> {
        self.keys.get(keyid)
    }

    /// `(keyid, key)` in keyid order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &VerifyingKey)> {
        self.keys.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn keyids(&self) -> Vec<&str> {
        self.keys.keys().map(String::as_str).collect()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

impl FromIterator<VerifyingKey> for KeySet {
    fn from_iter<I: IntoIterator<Item = VerifyingKey>>(iter: I) -> KeySet {
        let mut set = KeySet::new();
        for k in iter {
            set.insert(k);
        }
        set
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn a_missing_key_is_made_0600_and_read_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/key.pem");
        let (k, src) = load_or_generate(&p).unwrap();
        assert_eq!(src, KeySource::Generated);
        assert_eq!(mode(&p), 0o600);
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.starts_with("-----BEGIN PRIVATE KEY-----\n"), "{text}");
        let (again, src) = load_or_generate(&p).unwrap();
        assert_eq!(src, KeySource::Loaded);
        assert_eq!(again.to_bytes(), k.to_bytes());
        // No temp file is left beside it.
        let names: Vec<_> = std::fs::read_dir(p.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["key.pem"]);
    }

    #[test]
    fn a_key_group_or_others_may_read_is_refused_naming_the_file_and_mode() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("key.pem");
        load_or_generate(&p).unwrap();
        for m in [0o640, 0o604, 0o620, 0o644] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(m)).unwrap();
            let e = load_or_generate(&p).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, KeyError::Mode { .. }), "{msg}");
            assert!(msg.contains(&p.display().to_string()), "{msg}");
            assert!(msg.contains(&format!("{m:04o}")), "{msg}");
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert_eq!(load_or_generate(&p).unwrap().1, KeySource::Loaded);
    }

    #[test]
    fn a_file_that_is_no_key_is_refused_and_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("key.pem");
        std::fs::write(&p, "not a key").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = load_or_generate(&p).unwrap_err();
        assert!(matches!(e, KeyError::Format { .. }), "{e}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "not a key");
    }

    #[test]
    fn keys_are_written_as_openssl_writes_them() {
        // `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout` (OpenSSL 3).
        let openssl_private = "-----BEGIN PRIVATE KEY-----\n\
            MC4CAQAwBQYDK2VwBCIEID2wp3AIDUbBKMzMoWAPRdtI4DR9QCmsJs646FP1wXyW\n\
            -----END PRIVATE KEY-----\n";
        let openssl_public = "-----BEGIN PUBLIC KEY-----\n\
            MCowBQYDK2VwAyEAYXwXqQ/I9wMGGEZENPsOqQVpmM5NvxK4tjJxvTV0skQ=\n\
            -----END PUBLIC KEY-----\n";
        let k = SigningKey::from_pkcs8_pem(openssl_private).unwrap();
        assert_eq!(private_key_pem(&k).unwrap().as_str(), openssl_private);
        assert_eq!(public_key_pem(&k.verifying_key()), openssl_public);
        assert_eq!(
            public_key_from_pem(openssl_public).unwrap(),
            k.verifying_key()
        );
    }

    #[test]
    fn keyid_is_the_hex_sha256_of_the_raw_public_key_and_pem_round_trips() {
        let k = SigningKey::from_bytes(&[7u8; 32]);
        let vk = k.verifying_key();
        assert_eq!(keyid(&vk), hex::encode(Sha256::digest(vk.to_bytes())));
        assert_eq!(keyid(&vk).len(), 64);
        let pem = public_key_pem(&vk);
        assert!(pem.starts_with("-----BEGIN PUBLIC KEY-----\n"), "{pem}");
        assert_eq!(public_key_from_pem(&pem).unwrap(), vk);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pub.pem");
        std::fs::write(&p, &pem).unwrap();
        let set = KeySet::from_files(&[&p]).unwrap();
        assert_eq!(set.keyids(), [keyid(&vk).as_str()]);
        assert!(
            public_key_from_pem("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
                .is_err()
        );
    }
}
