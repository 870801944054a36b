//! Seals on the index files ubdirect writes beside datasets (the GPT index cache, the samples
//! cache): a keyed BLAKE3 hash over the whole file, under a key only this user holds, written as the
//! file's last 32 bytes.
//!
//! A CRC proves a file whole, not that ubdirect wrote it: anyone who can write a dataset's
//! directory can write a cache file with a valid CRC, and checks of its structure cannot tell a
//! reversed shuffle or a table missing samples from the real one (docs/decisions.md, "Index files
//! sealed"). A seal can: it verifies only under the key the writer held. A start that verifies the
//! seal trusts the file as written (ubdirect checked what it wrote); a file with another seal, or
//! none, is not used (a recorded fallback) and is built again. Where no key can be had (a home
//! directory that cannot be written) files are written unsealed and read back with the full
//! structural checks instead (`index_key_unavailable`, recorded once).
//!
//! The key is 32 random bytes in the file `$UBDIRECT_INDEX_KEY`, else
//! `$XDG_CACHE_HOME/ubdirect/index.key`, else `~/.cache/ubdirect/index.key`, created with mode
//! 0600 on first use. It must be a regular file of this user, readable by no one else: a key file
//! anyone else could read or write would seal nothing. Nodes that share a dataset directory but not
//! a home directory should point `UBDIRECT_INDEX_KEY` at one key file, or each rebuilds the caches
//! the other sealed.
//!
//! The hash is two-level so that it runs on every core: each 4 MiB piece of the file is hashed
//! under the key, and the seal is the keyed hash of the length and the pieces' hashes.

use std::io::Write;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::OnceLock;

use super::mapped::{CacheBytes, par_ranges};

/// Bytes of a seal (the file's last).
pub const SEAL: usize = 32;
/// Bytes hashed per piece.
const PIECE: usize = 4 << 20;

/// The sealing key, or `None` where none can be had (said once, counted).
pub fn key() -> Option<[u8; 32]> {
    static KEY: OnceLock<Option<[u8; 32]>> = OnceLock::new();
    *KEY.get_or_init(|| {
        let r = key_path()
            .ok_or_else(|| "no UBDIRECT_INDEX_KEY, XDG_CACHE_HOME or HOME".to_string())
            .and_then(|p| load_or_create(&p).map_err(|e| format!("{}: {e}", p.display())));
        match r {
            Ok(k) => Some(k),
            Err(why) => {
                ubdirect_ub::fallback::record(
                    "index_key_unavailable",
                    format!(
                        "index files' sealing key: {why}; GPT and samples caches are written unsealed and checked in full at each start"
                    ),
                );
                None
            }
        }
    })
}

fn key_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("UBDIRECT_INDEX_KEY") {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("ubdirect").join("index.key"))
}

/// The key in `p`, made there first if there is none.
fn load_or_create(p: &std::path::Path) -> std::io::Result<[u8; 32]> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    for _ in 0..2 {
        match std::fs::symlink_metadata(p) {
            Ok(m) => {
                // SAFETY: geteuid has no preconditions and cannot fail.
                let me = unsafe { libc::geteuid() };
                if !m.file_type().is_file()
                    || m.uid() != me
                    || m.mode() & 0o077 != 0
                    || m.len() != 32
                {
                    return Err(std::io::Error::other(
                        "not a 32-byte regular file of this user readable by it alone (mode 0600)",
                    ));
                }
                let b = std::fs::read(p)?;
                return b
                    .try_into()
                    .map_err(|_| std::io::Error::other("changed while read"));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if let Some(d) = p.parent() {
                    std::fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o700)
                        .create(d)?;
                }
                let mut k = [0u8; 32];
                std::fs::File::open("/dev/urandom")
                    .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut k))?;
                match std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(p)
                {
                    Ok(mut f) => {
                        f.write_all(&k)?;
                        f.sync_all()?;
                        return Ok(k);
                    }
                    // Another process made it first: read that one.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other("made and removed while read"))
}

/// The seal of a stream of bytes, as a writer writes them.
#[derive(Debug)]
pub struct Sealer {
    key: [u8; 32],
    piece: blake3::Hasher,
    in_piece: usize,
    total: u64,
    digests: Vec<u8>,
}

impl Sealer {
    /// A seal under `key`.
    pub fn new(key: [u8; 32]) -> Self {
        Sealer {
            key,
            piece: blake3::Hasher::new_keyed(&key),
            in_piece: 0,
            total: 0,
            digests: Vec::new(),
        }
    }

    /// Adds bytes.
    pub fn update(&mut self, mut b: &[u8]) {
        while !b.is_empty() {
            let n = (PIECE - self.in_piece).min(b.len());
            self.piece.update(&b[..n]);
            self.in_piece += n;
            self.total += n as u64;
            b = &b[n..];
            if self.in_piece == PIECE {
                self.end_piece();
            }
        }
    }

    fn end_piece(&mut self) {
        let h = std::mem::replace(&mut self.piece, blake3::Hasher::new_keyed(&self.key));
        self.digests.extend_from_slice(h.finalize().as_bytes());
        self.in_piece = 0;
    }

    /// The seal of every byte added.
    pub fn finish(mut self) -> [u8; SEAL] {
        if self.in_piece > 0 {
            self.end_piece();
        }
        seal_of_digests(&self.key, self.total, &self.digests)
    }
}

fn seal_of_digests(key: &[u8; 32], total: u64, digests: &[u8]) -> [u8; SEAL] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(b"ubdirect-seal-1");
    h.update(&total.to_le_bytes());
    h.update(digests);
    *h.finalize().as_bytes()
}

/// A writer that seals what passes through it; [`SealingWriter::finish`] appends the seal (32 zero
/// bytes when there is no key: an unsealed file).
#[derive(Debug)]
pub struct SealingWriter<W: Write> {
    inner: W,
    sealer: Option<Sealer>,
}

impl<W: Write> SealingWriter<W> {
    /// Seals under `key` (`None`: unsealed).
    pub fn new(inner: W, key: Option<[u8; 32]>) -> Self {
        SealingWriter {
            inner,
            sealer: key.map(Sealer::new),
        }
    }

    /// Writes the seal; the writer back.
    pub fn finish(mut self) -> std::io::Result<W> {
        let seal = self.sealer.take().map_or([0u8; SEAL], Sealer::finish);
        self.inner.write_all(&seal)?;
        Ok(self.inner)
    }
}

impl<W: Write> Write for SealingWriter<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(b)?;
        if let Some(s) = self.sealer.as_mut() {
            s.update(&b[..n]);
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// `b` followed by its seal under `key` (32 zero bytes without one): a small file written whole.
pub(crate) fn sealed(mut b: Vec<u8>, key: Option<&[u8; 32]>) -> Vec<u8> {
    let seal = key.map_or([0u8; SEAL], |k| {
        let mut s = Sealer::new(*k);
        s.update(&b);
        s.finish()
    });
    b.extend_from_slice(&seal);
    b
}

/// Whether the last [`SEAL`] bytes of the small file `b` seal the bytes before them under `key`.
pub(crate) fn verify_bytes(key: &[u8; 32], b: &[u8]) -> bool {
    let Some(end) = b.len().checked_sub(SEAL) else {
        return false;
    };
    let Ok(stored) = <[u8; SEAL]>::try_from(&b[end..]) else {
        return false;
    };
    let mut s = Sealer::new(*key);
    s.update(&b[..end]);
    constant_time_eq(&s.finish(), &stored)
}

/// Whether the last [`SEAL`] bytes of `b` seal the bytes before them under `key`: every piece
/// hashed on every core (read with `pread` when `b` is a file).
pub(crate) fn verify(key: &[u8; 32], b: &CacheBytes) -> bool {
    let Some(end) = b.len().checked_sub(SEAL) else {
        return false;
    };
    let mut stored = [0u8; SEAL];
    if !b.read(end, &mut stored) {
        return false;
    }
    match seal_of(key, b, 0..end) {
        Some(s) => constant_time_eq(&s, &stored),
        None => false,
    }
}

fn seal_of(key: &[u8; 32], b: &CacheBytes, range: Range<usize>) -> Option<[u8; SEAL]> {
    let pieces = (range.end - range.start).div_ceil(PIECE);
    let parts = par_ranges(pieces, |r| {
        let mut buf = vec![0u8; PIECE];
        let mut out = Vec::with_capacity(r.len() * 32);
        for k in r {
            let at = range.start + k * PIECE;
            let n = PIECE.min(range.end - at);
            if !b.read(at, &mut buf[..n]) {
                return Err(());
            }
            let mut h = blake3::Hasher::new_keyed(key);
            h.update(&buf[..n]);
            out.extend_from_slice(h.finalize().as_bytes());
        }
        Ok(out)
    })
    .ok()?;
    Some(seal_of_digests(
        key,
        (range.end - range.start) as u64,
        &parts.concat(),
    ))
}

fn constant_time_eq(a: &[u8; SEAL], b: &[u8; SEAL]) -> bool {
    a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_and_parallel_seals_agree_and_depend_on_key_and_bytes() {
        let key = [7u8; 32];
        for len in [0usize, 1, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE + 12345] {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut w = SealingWriter::new(Vec::new(), Some(key));
            for c in data.chunks(100_003) {
                w.write_all(c).unwrap_or_else(|e| panic!("{e}"));
            }
            let file = w.finish().unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(file.len(), len + SEAL);
            let b = CacheBytes::Owned(file.clone());
            assert!(verify(&key, &b), "{len}");
            assert!(!verify(&[8u8; 32], &b), "{len}: another key");
            if len > 0 {
                let mut f = file.clone();
                f[len / 2] ^= 1;
                assert!(
                    !verify(&key, &CacheBytes::Owned(f)),
                    "{len}: a flipped byte"
                );
            }
            let unsealed = SealingWriter::new(Vec::new(), None);
            let mut u = unsealed;
            u.write_all(&data).unwrap_or_else(|e| panic!("{e}"));
            assert!(!verify(
                &key,
                &CacheBytes::Owned(u.finish().unwrap_or_else(|e| panic!("{e}")))
            ));
        }
    }
}
