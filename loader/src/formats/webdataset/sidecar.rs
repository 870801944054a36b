//! The member list of a local shard, kept beside it as `SHARD.tar.ubdirect-index` and used while the
//! shard's identity ([`crate::formats::file_identity`]: device, inode, size, mtime, ctime) is
//! unchanged. Untrusted input: sealed under this user's key ([`crate::formats::seal`]) and, with a
//! key, used only when the seal verifies (a forged list — no members, or members drawn across
//! headers — is refused); without one, every member must lie inside the shard, after a header of
//! its own, in file order; anything else is ignored (and the shard scanned again).
//!
//! Layout (little-endian): magic `UBDWDS02`; the identity (7 × u64); member count (u32); bytes of
//! names (u32); per member the offset of its first header, of its bytes, and its size (u64 each)
//! and name length (u32); the names back to back; CRC-32 of all before it; the seal (32 bytes,
//! zeros when unsealed).

use std::path::Path;

use super::tar::{BLOCK, MAX_NAME, Members};

pub(crate) const MAGIC: &[u8; 8] = b"UBDWDS02";
const HEAD: u64 = 8 + 56 + 8;
const EACH: u64 = 28;
/// The CRC-32 and the seal at the end.
const TAIL: u64 = 4 + seal::SEAL as u64;

use crate::formats::seal;

use crate::formats::arrow::sidecar_identity as identity;
pub(super) use crate::formats::arrow::sidecar_path as path;

/// The most members a shard of `size` bytes holds (each has a header block of its own).
fn most_members(size: u64) -> u64 {
    size / BLOCK
}

/// The largest sidecar of a shard of `size` bytes.
fn most_bytes(size: u64) -> u64 {
    (HEAD + TAIL).saturating_add(most_members(size).saturating_mul(EACH + MAX_NAME as u64))
}

/// The members of `p` (`size` bytes), if a sidecar for this very file exists and is valid.
pub(super) fn load(p: &Path, size: u64) -> Option<Members> {
    use std::io::Read;
    let id = identity(p, size)?;
    // A regular file (a FIFO is refused, not waited on), its size checked before reading.
    let sp = path(p);
    let (f, len) = crate::formats::open_regular(&sp).ok()?;
    let refused = || {
        ubdirect_ub::fallback::record(
            "tar_sidecar_invalid",
            format!(
                "{}: not this shard's member list (or not sealed by this user); scanning it again",
                sp.display()
            ),
        );
        None
    };
    if !(HEAD + TAIL..=most_bytes(size)).contains(&len) {
        return refused();
    }
    crate::formats::check_memory(p, "the tar index sidecar", len).ok()?;
    let mut b = Vec::with_capacity(len as usize);
    f.take(len).read_to_end(&mut b).ok()?;
    if let Some(k) = seal::key()
        && !seal::verify_bytes(&k, &b)
    {
        return refused();
    }
    match parse(&b[..b.len() - seal::SEAL], Some(id), size) {
        Some(m) => Some(m),
        None => refused(),
    }
}

/// The members the sidecar bytes `b` (without the seal) list for a shard of `size` bytes whose
/// identity is `id` (`None`: not compared), if they are a valid sidecar of such a shard.
pub(super) fn parse(b: &[u8], id: Option<[u64; 7]>, size: u64) -> Option<Members> {
    let len = (b.len() as u64).checked_sub(4)?;
    if len < HEAD || len + TAIL > most_bytes(size) || &b[..8] != MAGIC {
        return None;
    }
    let (b, crc) = b.split_at(len as usize);
    if crc32fast::hash(b).to_le_bytes() != crc {
        return None;
    }
    let u64_at = |i: usize| Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?));
    let u32_at = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
    if let Some(id) = id
        && (0..7).any(|k| u64_at(8 + 8 * k) != Some(id[k]))
    {
        return None;
    }
    let n = u32_at(64)? as u64;
    let names_len = u32_at(68)? as u64;
    if n > most_members(size) || len != HEAD + n * EACH + names_len {
        return None;
    }
    let names = &b[(HEAD + n * EACH) as usize..];
    // Bounded by the checks above: the shard's size, and the sidecar's own.
    let mut m = Members::with_capacity(n as usize, names_len as usize);
    let (mut end, mut name_at) = (0u64, 0usize);
    for i in 0..n as usize {
        let e = HEAD as usize + i * EACH as usize;
        let (hdr, off, sz) = (u64_at(e)?, u64_at(e + 8)?, u64_at(e + 16)?);
        let nl = u32_at(e + 24)? as usize;
        // Its own headers before it, after the member before; inside the shard; named.
        let data_end = off.checked_add(sz)?;
        if hdr % BLOCK != 0
            || off % BLOCK != 0
            || hdr < end
            || off < hdr.checked_add(BLOCK)?
            || data_end > size
            || nl > MAX_NAME
        {
            return None;
        }
        let name = names.get(name_at..name_at + nl)?;
        m.push(name, hdr, off, sz);
        name_at += nl;
        end = data_end.div_ceil(BLOCK) * BLOCK;
    }
    (name_at == names.len()).then_some(m)
}

/// Writes the sidecar of `p`; a directory that is not writable only costs the next scan.
pub(super) fn store(p: &Path, size: u64, m: &Members) {
    let Some(id) = identity(p, size) else { return };
    let n = m.entries().len();
    let Ok(names_len) = u32::try_from(m.names().len()) else {
        return;
    };
    let mut b = Vec::with_capacity(HEAD as usize + n * EACH as usize + names_len as usize);
    b.extend_from_slice(MAGIC);
    for v in id {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&(n as u32).to_le_bytes());
    b.extend_from_slice(&names_len.to_le_bytes());
    for e in m.entries() {
        b.extend_from_slice(&e.header.to_le_bytes());
        b.extend_from_slice(&e.offset.to_le_bytes());
        b.extend_from_slice(&e.size.to_le_bytes());
        b.extend_from_slice(&(m.name(e).len() as u32).to_le_bytes());
    }
    for e in m.entries() {
        b.extend_from_slice(m.name(e));
    }
    let crc = crc32fast::hash(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    let b = seal::sealed(b, seal::key().as_ref());
    // Written whole, then renamed into place, never through a planted name: a reader never sees
    // half of one.
    let _ = ubdirect_ub::write_new(&path(p), &b);
}
