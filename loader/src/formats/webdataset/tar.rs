//! Tar headers as Python's `tarfile` reads them (the `webdataset` package iterates tars through it):
//! ustar (with its name prefix), GNU long names (`././@LongLink`, type `L`), pax extended (`x`, `X`)
//! and global (`g`) records for `path` and `size`. Every other entry type is skipped as `tarfile`
//! skips it. The parsing is apart from I/O: [`scan`] reads through [`At`], a byte range at a time,
//! so the same code indexes a slice (tests, fuzzing), a local file or a `ub://` shard.
//!
//! Stricter than `tarfile` where it would stop quietly: a bad checksum, a truncated header or a
//! member past the end of the file is a [`FormatError`] naming the offset, not the end of the tar.

use std::path::Path;

use crate::formats::{FormatError, corrupt};

/// A tar block.
pub const BLOCK: u64 = 512;
/// The longest member name indexed (`PATH_MAX`); longer is [`FormatError::Unsupported`].
pub const MAX_NAME: usize = 4096;
/// The largest GNU long name or pax record block read.
const MAX_EXTENDED: u64 = 1 << 20;

/// One regular-file member: where its header and its bytes are, and its name in [`Members`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Offset of its (first) header.
    pub header: u64,
    /// Offset of its bytes.
    pub offset: u64,
    /// Its size in bytes.
    pub size: u64,
    name_start: u32,
    name_len: u32,
}

/// The regular-file members of a tar in file order, names in one buffer (no allocation per member).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Members {
    names: Vec<u8>,
    entries: Vec<Entry>,
}

impl Members {
    /// The members, in file order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The name of `e` (a member of these).
    pub fn name(&self, e: &Entry) -> &[u8] {
        let s = e.name_start as usize;
        self.names.get(s..s + e.name_len as usize).unwrap_or(&[])
    }

    /// Empty, with room for `n` members and `names` bytes of names.
    pub(super) fn with_capacity(n: usize, names: usize) -> Self {
        Members {
            names: Vec::with_capacity(names),
            entries: Vec::with_capacity(n),
        }
    }

    /// All names, back to back.
    pub(super) fn names(&self) -> &[u8] {
        &self.names
    }

    /// Appends a member (`name` at most [`MAX_NAME`] bytes; callers check).
    pub(super) fn push(&mut self, name: &[u8], header: u64, offset: u64, size: u64) {
        let name = &name[..name.len().min(MAX_NAME)];
        self.entries.push(Entry {
            header,
            offset,
            size,
            name_start: self.names.len() as u32,
            name_len: name.len() as u32,
        });
        self.names.extend_from_slice(name);
    }
}

/// Random access to the bytes of a tar of a known size.
pub trait At {
    /// `len` bytes at `off` (the caller keeps `off + len` inside the file).
    fn at(&mut self, off: u64, len: usize) -> Result<&[u8], FormatError>;
}

/// A tar held in memory.
#[derive(Debug)]
pub struct Bytes<'a>(pub &'a [u8], pub &'a Path);

impl At for Bytes<'_> {
    fn at(&mut self, off: u64, len: usize) -> Result<&[u8], FormatError> {
        usize::try_from(off)
            .ok()
            .and_then(|o| self.0.get(o..o.checked_add(len)?))
            .ok_or_else(|| corrupt(self.1, format!("{len} bytes at offset {off}: past the end")))
    }
}

/// The value of a numeric header field as `tarfile.nti` reads it: base-256 when the first byte is
/// 0x80 (positive) or 0xff (negative), else octal text up to the first NUL, blanks around it.
fn nti(s: &[u8]) -> Option<i128> {
    if let Some((&first, rest)) = s.split_first()
        && (first == 0x80 || first == 0xff)
    {
        let n = rest.iter().fold(0i128, |n, &b| (n << 8) | b as i128);
        return Some(if first == 0xff {
            n - (1i128 << (8 * rest.len()))
        } else {
            n
        });
    }
    let s = &s[..s.iter().position(|&b| b == 0).unwrap_or(s.len())];
    if !s.is_ascii() {
        return None;
    }
    // Python's str.strip(): ASCII whitespace and the separators 0x1c..0x1f.
    let blank = |b: &u8| b.is_ascii_whitespace() || b == &0x0b || (0x1c..=0x1f).contains(b);
    let start = s.iter().position(|b| !blank(b)).unwrap_or(s.len());
    let end = s.iter().rposition(|b| !blank(b)).map_or(start, |e| e + 1);
    let t = &s[start..end.max(start)];
    if t.is_empty() {
        return Some(0);
    }
    let (neg, t) = match t {
        [b'-', r @ ..] => (true, r),
        [b'+', r @ ..] => (false, r),
        _ => (false, t),
    };
    let (t, prefixed) = match t {
        [b'0', b'o' | b'O', r @ ..] => (r, true),
        _ => (t, false),
    };
    // Digits 0-7, single underscores between them (or after a `0o` prefix), as int(s, 8) takes.
    let mut n: i128 = 0;
    let mut digits = 0;
    let mut prev_us = !prefixed;
    for &b in t {
        match b {
            b'0'..=b'7' => {
                n = n.checked_mul(8)?.checked_add((b - b'0') as i128)?;
                digits += 1;
                prev_us = false;
            }
            b'_' if !prev_us => prev_us = true,
            _ => return None,
        }
    }
    (digits > 0 && !prev_us).then_some(if neg { -n } else { n })
}

/// The bytes up to the first NUL.
fn nts(s: &[u8]) -> &[u8] {
    &s[..s.iter().position(|&b| b == 0).unwrap_or(s.len())]
}

/// One header block, parsed.
struct Header {
    name: Vec<u8>,
    size: u64,
    kind: u8,
}

/// Entry types `tarfile` knows (regular, links, devices, directories, FIFOs, GNU and pax types):
/// the data of any other type is skipped as a regular file's.
const KNOWN: &[u8] = b"01234567LKSxgX\0";

/// The header at `at`, or `None` for an all-zero block (the end of the archive).
fn parse_header(b: &[u8], at: u64, p: &Path) -> Result<Option<Header>, FormatError> {
    if b.iter().all(|&x| x == 0) {
        return Ok(None);
    }
    let field = |r: std::ops::Range<usize>, what: &str| {
        nti(&b[r]).ok_or_else(|| corrupt(p, format!("tar header at offset {at}: bad {what} field")))
    };
    let chksum = field(148..156, "checksum")?;
    // The checksum field counts as 8 blanks (256); at most 512 × 255: i32 holds either sum.
    let (head, tail) = (&b[..148], &b[156..]);
    let unsigned = 256
        + head.iter().map(|&x| x as i32).sum::<i32>()
        + tail.iter().map(|&x| x as i32).sum::<i32>();
    let signed = 256
        + head.iter().map(|&x| x as i8 as i32).sum::<i32>()
        + tail.iter().map(|&x| x as i8 as i32).sum::<i32>();
    let (unsigned, signed) = (unsigned as i128, signed as i128);
    if chksum != unsigned && chksum != signed {
        return Err(corrupt(
            p,
            format!(
                "tar header at offset {at}: bad checksum (stored {chksum}, computed {unsigned}): not a tar, or a damaged one"
            ),
        ));
    }
    for (r, what) in [
        (100..108, "mode"),
        (108..116, "uid"),
        (116..124, "gid"),
        (136..148, "mtime"),
        (329..337, "devmajor"),
        (337..345, "devminor"),
    ] {
        field(r, what)?;
    }
    let size = u64::try_from(field(124..136, "size")?)
        .map_err(|_| corrupt(p, format!("tar header at offset {at}: negative size")))?;
    let mut kind = b[156];
    let mut name = nts(&b[..100]).to_vec();
    // Old V7 tars mark a directory with a trailing slash on a regular file.
    if kind == 0 && name.ends_with(b"/") {
        kind = b'5';
    }
    let prefix = nts(&b[345..500]);
    if !prefix.is_empty() && !matches!(kind, b'L' | b'K' | b'S') {
        let mut full = prefix.to_vec();
        full.push(b'/');
        full.extend_from_slice(&name);
        name = full;
    }
    Ok(Some(Header { name, size, kind }))
}

/// What an extended header says about the member after it.
enum Override {
    /// A GNU long name.
    Name(Vec<u8>),
    /// A pax header's `path`, if any, and `size`, if any (with the global records before it: a
    /// global path is shared, not copied — a 1 MiB global path and 3,000 `x` headers after it held
    /// 3 GB).
    Pax(Option<std::sync::Arc<[u8]>>, Option<u64>),
    /// Nothing for the name or size (a GNU long link name, a global header).
    Nothing,
}

/// Global pax records in force: `path` (held once, shared by the headers that inherit it).
#[derive(Default, Clone)]
struct Globals {
    path: Option<std::sync::Arc<[u8]>>,
}

/// The pax records of `buf` (an `x`, `X` or `g` header's data at `at`): `path` and `size`, as
/// `tarfile` reads `"%d %s=%s\n"` records (up to the first that does not parse).
fn pax_records(
    buf: &[u8],
    at: u64,
    p: &Path,
) -> Result<(Option<Vec<u8>>, Option<u64>), FormatError> {
    let bad = |why: String| corrupt(p, format!("pax header at offset {at}: {why}"));
    let (mut path, mut size) = (None, None);
    let mut pos = 0usize;
    loop {
        let rest = &buf[pos..];
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 || rest.get(digits) != Some(&b' ') {
            break;
        }
        let kw_start = digits + 1;
        let Some(eq) = rest[kw_start..].iter().position(|&b| b == b'=') else {
            break;
        };
        if eq == 0 {
            break;
        }
        let eq = kw_start + eq;
        let length: usize = std::str::from_utf8(&rest[..digits])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("record length out of range".into()))?;
        if length == 0 || length > rest.len() || length < eq + 2 {
            return Err(bad(format!(
                "record of length {length} at {pos} does not hold its keyword and value"
            )));
        }
        let (kw, value) = (&rest[kw_start..eq], &rest[eq + 1..length - 1]);
        match kw {
            b"path" => {
                let end = value.iter().rposition(|&b| b != b'/').map_or(0, |e| e + 1);
                path = Some(value[..end].to_vec());
            }
            b"size" => {
                let v = std::str::from_utf8(value).unwrap_or("").trim();
                let v = v.strip_prefix('+').unwrap_or(v);
                let n = (!v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                    .then(|| v.parse::<u64>().ok())
                    .flatten()
                    .ok_or_else(|| {
                        bad(format!(
                            "size {:?} is not a size",
                            String::from_utf8_lossy(value)
                        ))
                    })?;
                size = Some(n);
            }
            k if k.starts_with(b"GNU.sparse.") => {
                return Err(FormatError::Unsupported {
                    path: p.to_path_buf(),
                    reason: format!("pax header at offset {at}: a GNU sparse file"),
                });
            }
            _ => {}
        }
        pos += length;
    }
    Ok((path, size))
}

fn round_up(n: u64) -> Option<u64> {
    n.checked_add(BLOCK - 1).map(|x| x / BLOCK * BLOCK)
}

/// The data of an extended header (`L`, `K`, `x`, `X`, `g`) at `at`, whole blocks as `tarfile`
/// reads them (cut at the end of the file).
fn extended<'a, A: At>(
    src: &'a mut A,
    h: &Header,
    at: u64,
    size: u64,
    p: &Path,
) -> Result<&'a [u8], FormatError> {
    if h.size > MAX_EXTENDED {
        return Err(FormatError::Unsupported {
            path: p.to_path_buf(),
            reason: format!(
                "tar header at offset {at}: an extended header of {} bytes (at most {MAX_EXTENDED})",
                h.size
            ),
        });
    }
    let data = at + BLOCK;
    if data + h.size > size {
        return Err(corrupt(
            p,
            format!(
                "tar header at offset {at}: {} bytes of extended header past the end of the file ({size} bytes)",
                h.size
            ),
        ));
    }
    let len = round_up(h.size).unwrap_or(h.size).min(size - data);
    src.at(data, len as usize)
}

/// The state of a scan between headers.
struct Scan<'a> {
    p: &'a Path,
    size: u64,
    out: Members,
    globals: Globals,
    /// Extended headers read since the last member, in file order.
    pending: Vec<Override>,
    /// The first header of the member being read.
    first: u64,
}

impl Scan<'_> {
    fn end_of_archive(&self) -> FormatError {
        corrupt(
            self.p,
            format!(
                "extended header at offset {} is followed by the end of the archive",
                self.first
            ),
        )
    }

    /// An extended header (`L`, `K`, `x`, `X`, `g`) at `pos`: what it says about the next member.
    fn extended<A: At>(&mut self, src: &mut A, h: &Header, pos: u64) -> Result<(), FormatError> {
        let (p, size) = (self.p, self.size);
        let buf = extended(src, h, pos, size, p)?;
        let o = match h.kind {
            b'L' => Override::Name(nts(buf).to_vec()),
            b'x' | b'X' => {
                let (path, sz) = pax_records(buf, pos, p)?;
                let path = path.map(std::sync::Arc::from);
                Override::Pax(path.or_else(|| self.globals.path.clone()), sz)
            }
            b'g' => {
                let (path, sz) = pax_records(buf, pos, p)?;
                if sz.is_some() {
                    return Err(FormatError::Unsupported {
                        path: p.to_path_buf(),
                        reason: format!(
                            "pax global header at offset {pos} sets a size for every member"
                        ),
                    });
                }
                if let Some(path) = path {
                    self.globals.path = Some(path.into());
                }
                Override::Nothing
            }
            _ => Override::Nothing,
        };
        self.pending.push(o);
        Ok(())
    }

    /// A member's header at `pos` (any type but extended headers and sparse files): recorded when
    /// it is a regular file. Returns where the next header is.
    fn member(&mut self, h: Header, pos: u64) -> Result<u64, FormatError> {
        let (p, size, first) = (self.p, self.size, self.first);
        let data = pos + BLOCK;
        // Which name wins, found without copying any (a global path of 1 MiB is not copied for
        // each entry); the extended header read first is applied last (tarfile's recursion).
        enum Src {
            Header,
            Shared(std::sync::Arc<[u8]>),
            Long(Vec<u8>),
        }
        let mut msize = h.size;
        let mut src = match &self.globals.path {
            Some(g) => Src::Shared(g.clone()),
            None => Src::Header,
        };
        for o in self.pending.drain(..).rev() {
            match o {
                Override::Name(n) => src = Src::Long(n),
                Override::Pax(path, sz) => {
                    if let Some(n) = path {
                        src = Src::Shared(n);
                    }
                    if let Some(s) = sz {
                        msize = s;
                    }
                }
                Override::Nothing => {}
            }
        }
        let name: &[u8] = match &src {
            Src::Header => &h.name,
            Src::Shared(n) => n,
            Src::Long(n) => n,
        };
        let regular = matches!(h.kind, b'0' | 0 | b'7');
        if regular {
            if data.checked_add(msize).is_none_or(|e| e > size) {
                return Err(corrupt(
                    p,
                    format!(
                        "member {:?} (header at offset {first}): {msize} bytes at offset {data} past the end of the file ({size} bytes)",
                        String::from_utf8_lossy(&name[..name.len().min(256)])
                    ),
                ));
            }
            if name.len() > MAX_NAME || self.out.names.len() + name.len() > u32::MAX as usize {
                return Err(FormatError::Unsupported {
                    path: p.to_path_buf(),
                    reason: format!(
                        "member at offset {first}: a name of {} bytes (at most {MAX_NAME}, and 4 GiB of names in a shard)",
                        name.len()
                    ),
                });
            }
            let entries = &mut self.out.entries;
            if entries.len() == entries.capacity() {
                // Grown by doubling, each step checked against memory (not once per member).
                let more = entries.len().max(1024) as u64;
                crate::formats::reserve_index(entries, p, more)?;
            }
            self.out.push(name, first, data, msize);
        }
        // tarfile skips the data of regular files and unknown types only; an unknown type's data
        // past the end of the file is its "unexpected end of data" (it ended the scan quietly).
        if !regular && !KNOWN.contains(&h.kind) && data.checked_add(msize).is_none_or(|e| e > size)
        {
            return Err(corrupt(
                p,
                format!(
                    "entry of type {:?} (header at offset {first}): {msize} bytes at offset {data} past the end of the file ({size} bytes)",
                    h.kind as char
                ),
            ));
        }
        Ok(if regular || !KNOWN.contains(&h.kind) {
            data.saturating_add(round_up(msize).unwrap_or(u64::MAX))
        } else {
            data
        })
    }
}

/// The regular-file members of a tar of `size` bytes read through `src` (`p` names it in errors).
pub fn scan<A: At>(src: &mut A, p: &Path, size: u64) -> Result<Members, FormatError> {
    let mut st = Scan {
        p,
        size,
        out: Members::default(),
        globals: Globals::default(),
        pending: Vec::new(),
        first: 0,
    };
    let mut pos = 0u64;
    loop {
        if pos >= size {
            if !st.pending.is_empty() {
                return Err(st.end_of_archive());
            }
            break;
        }
        if size - pos < BLOCK {
            return Err(corrupt(
                p,
                format!(
                    "truncated tar header at offset {pos} ({} bytes left)",
                    size - pos
                ),
            ));
        }
        let Some(h) = parse_header(src.at(pos, BLOCK as usize)?, pos, p)? else {
            if !st.pending.is_empty() {
                return Err(st.end_of_archive());
            }
            break;
        };
        if st.pending.is_empty() {
            st.first = pos;
        }
        pos = match h.kind {
            b'L' | b'K' | b'x' | b'X' | b'g' => {
                st.extended(src, &h, pos)?;
                (pos + BLOCK).saturating_add(round_up(h.size).unwrap_or(u64::MAX))
            }
            b'S' => {
                return Err(FormatError::Unsupported {
                    path: p.to_path_buf(),
                    reason: format!("tar header at offset {pos}: a GNU sparse file"),
                });
            }
            _ => st.member(h, pos)?,
        };
    }
    Ok(st.out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_as_tarfile_reads_them() {
        assert_eq!(nti(b"0000644\0"), Some(0o644));
        assert_eq!(nti(b"  17 \0xx"), Some(0o17));
        assert_eq!(nti(b"\0\0\0\0"), Some(0));
        assert_eq!(nti(b"0o17\0"), Some(0o17));
        assert_eq!(nti(b"1_7\0"), Some(0o17));
        assert_eq!(nti(b"1__7\0"), None);
        assert_eq!(nti(b"8\0"), None);
        assert_eq!(nti(&[0x80, 0, 0, 1, 0]), Some(256));
        assert_eq!(nti(&[0xff, 0xff, 0xff]), Some(-1));
        assert_eq!(nti("é".as_bytes()), None);
    }

    #[test]
    fn pax_records_path_and_size() {
        let p = Path::new("t.tar");
        let (path, size) = pax_records(b"19 path=a/b.jpg///\n11 size=42\n\0\0", 0, p).unwrap();
        assert_eq!(path.as_deref(), Some(&b"a/b.jpg"[..]));
        assert_eq!(size, Some(42));
        assert!(pax_records(b"0 path=x\n", 0, p).is_err());
        assert!(pax_records(b"99 path=x\n", 0, p).is_err());
        assert!(pax_records(b"12 size=4x\n", 0, p).is_err());
    }
}
