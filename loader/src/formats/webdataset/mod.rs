//! WebDataset `.tar` shards: a sample is the run of consecutive members sharing a key, each member
//! one part named by its extension (`000123.jpg`, `000123.cls` → key `000123`, parts `jpg` and `cls`).
//! Sample = one part (`dataset.column = "jpg"`), or several as one sample's parts
//! (`dataset.columns = ["jpg", "cls"]`); each part is a byte range of the tar, read and merged by the
//! planner like any other format's.
//!
//! The rules are the `webdataset` package's (`tar_file_iterator`, `base_plus_ext`, `group_by_keys`,
//! checked against it in `python/tests/test_webdataset.py`): regular files only; names whose first
//! path component is `__…__` skipped (metadata); key = the path up to the first dot of the file
//! name, extension = the rest, lowercased; a new sample starts where the key changes. A key without
//! one of the configured extensions, or with one twice, is an error naming it.
//!
//! Members are indexed once by one scan of the headers ([`tar`]) and the list kept beside a local
//! shard as `SHARD.tar.ubdirect-index` (like the Arrow stream index: used while the shard's size,
//! modification time and inode are unchanged, validated as untrusted input; a directory that cannot
//! be written costs a scan at the next start).

pub mod tar;

mod sidecar;
pub(crate) use sidecar::MAGIC as SIDECAR_MAGIC;

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::index::{DatasetIndex, SampleLoc, Shard};
use super::{FormatError, corrupt, io_err};
pub use tar::{Members, scan};

/// The key and extension of a member name, as `webdataset.tariterators.base_plus_ext` splits it
/// (`^((?:.*/|)[^.]+)[.]([^/]*)$`): `None` when the name has no extension (the member is skipped).
pub fn base_plus_ext(name: &[u8]) -> Option<(&[u8], &[u8])> {
    // Candidate starts of `[^.]+`: after each `/` (the last first: `.*` is greedy and does not
    // cross a newline), then the start of the name. From a start, `[^.]+` runs to the first `.`,
    // which must lie after the last `/` (`[^/]*$`). The first `.` at or after each start is kept as
    // the starts move left, so the whole search reads each byte once (it rescanned from every `/`:
    // a name of 4,095 slashes took 10 s a megabyte of tar).
    let newline = name.iter().position(|&b| b == b'\n').unwrap_or(name.len());
    let last_slash = name.iter().rposition(|&b| b == b'/');
    let slashes = name[..newline]
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, b)| **b == b'/')
        .map(|(i, _)| i + 1);
    let (mut next_dot, mut covered) = (None, name.len());
    for start in slashes.chain(std::iter::once(0)) {
        if let Some(d) = name[start..covered].iter().position(|&b| b == b'.') {
            next_dot = Some(start + d);
        }
        covered = start;
        if let Some(dot) = next_dot
            && dot > start
            && last_slash.is_none_or(|l| dot > l)
        {
            return Some((&name[..dot], &name[dot + 1..]));
        }
    }
    None
}

/// Whether `tar_file_iterator` skips a member of this name as metadata: `__…__` alone, or a first
/// path component `__…__` (its `skip_meta` pattern `__[^/]*__($|/)`).
pub fn is_meta(name: &[u8]) -> bool {
    let meta = |c: &[u8], min: usize| c.len() >= min && c.starts_with(b"__") && c.ends_with(b"__");
    match name.iter().position(|&b| b == b'/') {
        None => meta(name, 2),
        Some(i) => meta(&name[..i], 4),
    }
}

/// `ext` lowercased as Python's `str.lower()` does (bytes that are not UTF-8 kept as they are).
fn lowercase(ext: &[u8], out: &mut Vec<u8>) {
    out.clear();
    if ext.is_ascii() {
        out.extend(ext.iter().map(u8::to_ascii_lowercase));
        return;
    }
    for chunk in ext.utf8_chunks() {
        out.extend_from_slice(chunk.valid().to_lowercase().as_bytes());
        out.extend_from_slice(chunk.invalid());
    }
}

/// The sample being grouped: its key, first header and the extensions seen (one buffer, reused from
/// sample to sample: nothing allocated per member once it has grown).
#[derive(Default)]
struct Group<'a> {
    key: Option<&'a [u8]>,
    first: u64,
    exts: Vec<u8>,
    ends: Vec<usize>,
    found: Option<(u64, u64)>,
}

impl<'a> Group<'a> {
    fn exts(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(self.ends.iter()).map(|(s, &e)| &self.exts[s..e])
    }

    fn start(&mut self, key: &'a [u8], first: u64) {
        self.key = Some(key);
        self.first = first;
        self.exts.clear();
        self.ends.clear();
        self.found = None;
    }

    fn add(&mut self, ext: &[u8]) {
        self.exts.extend_from_slice(ext);
        self.ends.push(self.exts.len());
    }

    /// Appends the sample's part to `out` (nothing before the first key).
    fn finish(&self, p: &Path, column: &str, out: &mut Vec<(u64, u32)>) -> Result<(), FormatError> {
        let Some(k) = self.key else { return Ok(()) };
        let Some((off, len)) = self.found else {
            let names: Vec<String> = self
                .exts()
                .map(|e| String::from_utf8_lossy(e).into())
                .collect();
            let why = format!(
                "sample {:?} (header at offset {}) has no part {column:?} (its parts: {names:?}); every sample needs each extension of dataset.columns (or dataset.column)",
                String::from_utf8_lossy(k),
                self.first
            );
            return Err(if out.is_empty() {
                FormatError::Config(format!("{}: {why}", p.display()))
            } else {
                corrupt(p, why)
            });
        };
        let len = u32::try_from(len).map_err(|_| FormatError::Unsupported {
            path: p.to_path_buf(),
            reason: format!(
                "part {column:?} of sample {:?}: {len} bytes (at most 4 GiB - 1)",
                String::from_utf8_lossy(k)
            ),
        })?;
        out.push((off, len));
        Ok(())
    }
}

/// The byte range of part `column` of every sample of a tar's members, in order.
pub fn samples_of(
    members: &Members,
    p: &Path,
    column: &str,
) -> Result<Vec<(u64, u32)>, FormatError> {
    let mut out: Vec<(u64, u32)> = Vec::new();
    let mut g = Group::default();
    let mut lower = Vec::new();
    for e in members.entries() {
        let name = members.name(e);
        if is_meta(name) {
            continue;
        }
        let Some((k, ext)) = base_plus_ext(name) else {
            continue;
        };
        if g.key != Some(k) {
            g.finish(p, column, &mut out)?;
            g.start(k, e.header);
        }
        lowercase(ext, &mut lower);
        // `group_by_keys` refuses a part twice (and a part named like its `__key__`/`__url__`).
        if g.exts().any(|x| x == lower) || lower == b"__key__" || lower == b"__url__" {
            return Err(corrupt(
                p,
                format!(
                    "member {:?} (header at offset {}): sample {:?} has a part {:?} already",
                    String::from_utf8_lossy(name),
                    e.header,
                    String::from_utf8_lossy(k),
                    String::from_utf8_lossy(&lower)
                ),
            ));
        }
        if lower == column.as_bytes() {
            g.found = Some((e.offset, e.size));
        }
        g.add(&lower);
    }
    g.finish(p, column, &mut out)?;
    Ok(out)
}

/// Reads a tar through a window of `WINDOW` bytes: headers and small members are read in large
/// sequential reads, large members are skipped.
struct Window<'a, R> {
    r: &'a mut R,
    p: &'a Path,
    size: u64,
    base: u64,
    buf: Vec<u8>,
}

const WINDOW: u64 = 256 << 10;

impl<R: Read + Seek> tar::At for Window<'_, R> {
    fn at(&mut self, off: u64, len: usize) -> Result<&[u8], FormatError> {
        let end = off.saturating_add(len as u64);
        if off < self.base || end > self.base + self.buf.len() as u64 {
            let want = (len as u64).max(WINDOW.min(self.size.saturating_sub(off)));
            self.r.seek(SeekFrom::Start(off)).map_err(io_err(self.p))?;
            self.buf.clear();
            (&mut *self.r)
                .take(want)
                .read_to_end(&mut self.buf)
                .map_err(io_err(self.p))?;
            self.base = off;
            if (self.buf.len() as u64) < len as u64 {
                return Err(corrupt(
                    self.p,
                    format!("truncated: {len} bytes at offset {off}, the file ended"),
                ));
            }
        }
        let s = (off - self.base) as usize;
        Ok(&self.buf[s..s + len])
    }
}

/// The members of one shard: from its sidecar when it is this very file's, else by a scan (then
/// kept in a sidecar where the directory is writable).
pub fn members<R: Read + Seek>(r: &mut R, p: &Path, size: u64) -> Result<Members, FormatError> {
    if let Some(m) = sidecar::load(p, size) {
        return Ok(m);
    }
    let m = scan_reader(r, p, size)?;
    sidecar::store(p, size, &m);
    Ok(m)
}

/// The members of a tar of `size` bytes read through `r`, by one scan (no sidecar).
pub fn scan_reader<R: Read + Seek>(r: &mut R, p: &Path, size: u64) -> Result<Members, FormatError> {
    super::check_memory(p, "the tar scan window", WINDOW)?;
    if size >= 6 {
        r.seek(SeekFrom::Start(0)).map_err(io_err(p))?;
        let mut magic = [0u8; 6];
        r.read_exact(&mut magic).map_err(io_err(p))?;
        if let Some(kind) = compressed(&magic) {
            return Err(FormatError::Unsupported {
                path: p.to_path_buf(),
                reason: format!(
                    "a {kind}-compressed tar: parts are read as byte ranges of an uncompressed tar (decompress the shard)"
                ),
            });
        }
    }
    let mut w = Window {
        r,
        p,
        size,
        base: 0,
        buf: Vec::new(),
    };
    scan(&mut w, p, size)
}

fn compressed(magic: &[u8; 6]) -> Option<&'static str> {
    match magic {
        [0x1f, 0x8b, ..] => Some("gzip"),
        [b'B', b'Z', b'h', ..] => Some("bzip2"),
        [0xfd, b'7', b'z', b'X', b'Z', 0] => Some("xz"),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Some("zstd"),
        _ => None,
    }
}

/// Indexes part `column` of WebDataset shards read through seekable sources: (name, size, source).
pub fn open_readers<R: Read + Seek>(
    shards: &mut [(PathBuf, u64, R)],
    column: &str,
) -> Result<DatasetIndex, FormatError> {
    open_readers_columns(shards, &[column.to_string()]).map(|(idx, _)| idx)
}

/// Indexes parts `columns` of WebDataset shards with one scan of each: the index of the first part,
/// and the other parts' locations, sample for sample.
pub fn open_readers_columns<R: Read + Seek>(
    shards: &mut [(PathBuf, u64, R)],
    columns: &[String],
) -> Result<(DatasetIndex, Vec<Vec<SampleLoc>>), FormatError> {
    let mut idx = DatasetIndex {
        format: "webdataset".into(),
        ..Default::default()
    };
    let mut others: Vec<Vec<SampleLoc>> = vec![Vec::new(); columns.len().saturating_sub(1)];
    for (si, (p, size, r)) in shards.iter_mut().enumerate() {
        let m = members(r, p, *size)?;
        for (ci, column) in columns.iter().enumerate() {
            let samples = samples_of(&m, p, column)?;
            let locs = samples.into_iter().map(|(offset, len)| SampleLoc {
                shard: si as u32,
                offset,
                len,
            });
            if ci == 0 {
                super::reserve_samples(&mut idx, p, locs.len() as u64)?;
                idx.samples.extend(locs);
            } else {
                let v = &mut others[ci - 1];
                super::reserve_index(v, p, locs.len() as u64)?;
                v.extend(locs);
            }
        }
        idx.shards.push(Shard {
            path: p.clone(),
            size: *size,
        });
    }
    // Every sample has every part (or samples_of refused): the columns are row for row.
    if others.iter().any(|o| o.len() != idx.samples.len()) {
        return Err(FormatError::Config(
            "dataset.columns: the parts' sample counts differ".into(),
        ));
    }
    Ok((idx, others))
}

/// The members a sidecar (`SHARD.tar.ubdirect-index`) lists for a shard of `size` bytes, if it is a
/// valid one (its identity fields and seal are not compared): for fuzzing the parser.
pub fn parse_sidecar(bytes: &[u8], size: u64) -> Option<Members> {
    let body = bytes.len().checked_sub(super::seal::SEAL)?;
    sidecar::parse(&bytes[..body], None, size)
}

/// Appends one ustar member (a GNU long name first when `name` is over 100 bytes) to `out`.
pub fn append_member(out: &mut Vec<u8>, name: &[u8], data: &[u8]) {
    if name.len() > 100 {
        append_header(out, b"././@LongLink", name.len() as u64 + 1, b'L');
        out.extend_from_slice(name);
        out.push(0);
        pad(out);
    }
    append_header(out, &name[..name.len().min(100)], data.len() as u64, b'0');
    out.extend_from_slice(data);
    pad(out);
}

fn pad(out: &mut Vec<u8>) {
    out.resize(out.len().div_ceil(512) * 512, 0);
}

fn append_header(out: &mut Vec<u8>, name: &[u8], size: u64, kind: u8) {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name);
    let octal = |h: &mut [u8; 512], at: usize, width: usize, v: u64| {
        let s = format!("{v:0w$o}\0", w = width - 1);
        h[at..at + width].copy_from_slice(&s.as_bytes()[s.len() - width..]);
    };
    octal(&mut h, 100, 8, 0o644);
    octal(&mut h, 108, 8, 0);
    octal(&mut h, 116, 8, 0);
    octal(&mut h, 124, 12, size);
    octal(&mut h, 136, 12, 0);
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].fill(b' ');
    let sum: u64 = h.iter().map(|&b| b as u64).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
    out.extend_from_slice(&h);
}

/// Writes a tar of `members` (name, bytes), in order, with the two zero blocks that end it.
pub fn write(path: &Path, members: &[(String, Vec<u8>)]) -> Result<(), FormatError> {
    let mut out = Vec::new();
    for (name, data) in members {
        append_member(&mut out, name.as_bytes(), data);
    }
    out.resize(out.len() + 1024, 0);
    ubdirect_ub::write_new(path, &out).map_err(io_err(path))
}

#[cfg(test)]
mod tests;
