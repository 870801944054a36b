//! The Megatron `.idx` file, mapped and read in place ([`MegatronIdx`]): its header, checked, and
//! the sequence lengths, pointers and document indices it holds, borrowed from the mapping. The
//! layout is in [`super::megatron`]'s documentation; this module knows nothing of the dataset index
//! built over it (so the index and the format each name it, and not each other).

use std::path::{Path, PathBuf};

use super::{Dtype, FormatError, corrupt, io_err};

/// The largest `.idx` opened (a larger one is refused, not read until memory runs out).
pub const MAX_IDX_BYTES: u64 = 64 << 30;

/// The `.idx` magic.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// Megatron's dtype codes.
pub fn dtype_from_code(code: u8) -> Option<Dtype> {
    Some(match code {
        1 => Dtype::U8,
        2 => Dtype::I8,
        3 => Dtype::I16,
        4 => Dtype::I32,
        5 => Dtype::I64,
        6 => Dtype::F64,
        7 => Dtype::F32,
        8 => Dtype::U16,
        _ => return None,
    })
}

/// The code Megatron writes for `dtype`.
pub fn dtype_code(dtype: Dtype) -> Option<u8> {
    Some(match dtype {
        Dtype::U8 => 1,
        Dtype::I8 => 2,
        Dtype::I16 => 3,
        Dtype::I32 => 4,
        Dtype::I64 => 5,
        Dtype::F64 => 6,
        Dtype::F32 => 7,
        Dtype::U16 => 8,
        _ => return None,
    })
}

/// The bytes of a `.idx`: mapped (local files) or read (`ub://` files, tests, fuzzing).
#[derive(Debug)]
pub enum IdxBytes {
    /// A read-only mapping of the local file.
    Mapped(MappedFile),
    /// The file's bytes, read.
    Owned(Vec<u8>),
}

/// A local file mapped read-only (see `formats/sys.rs` for what a mapping promises).
#[derive(Debug)]
pub struct MappedFile(super::sys::ReadOnlyMap);

impl IdxBytes {
    /// Bytes in the file.
    fn len(&self) -> usize {
        match self {
            IdxBytes::Mapped(m) => m.0.len(),
            IdxBytes::Owned(v) => v.len(),
        }
    }

    /// Copies the bytes at `at` into `dst`; `false` when they are not all in the file. A mapping is
    /// read by copies, never borrowed: another process may rewrite the file (formats/sys.rs).
    fn read(&self, at: usize, dst: &mut [u8]) -> bool {
        match self {
            IdxBytes::Mapped(m) => m.0.read(at, dst),
            IdxBytes::Owned(v) => match at.checked_add(dst.len()).and_then(|e| v.get(at..e)) {
                Some(s) => {
                    dst.copy_from_slice(s);
                    true
                }
                None => false,
            },
        }
    }

    /// Bytes `at..at + len` as a vector (empty when not all in the file).
    fn to_vec(&self, at: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        if !self.read(at, &mut v) {
            v.clear();
        }
        v
    }
}

/// Offset of `sequence_lengths` (after the 34-byte header). Megatron's arrays follow each other
/// without padding, so the `i32` lengths sit at offsets ≡ 2 (mod 4) and the `i64` pointers and
/// document indices at offsets ≡ 2 (mod 4) too: they are never aligned for their type and are read
/// as little-endian bytes, not reinterpreted as `&[i32]` / `&[i64]`.
const LENGTHS_AT: usize = 34;

/// A `.idx` read in place: its header parsed and its arrays' bounds checked at open, the arrays read
/// element by element from the mapping (nothing is copied per sequence).
#[derive(Debug)]
pub struct MegatronIdx {
    path: PathBuf,
    bytes: IdxBytes,
    dtype: Dtype,
    sequences: usize,
    documents: usize,
    /// (device, inode, size, mtime seconds, mtime nanoseconds, ctime seconds, ctime nanoseconds)
    /// of the mapped file, from the descriptor that was mapped; `None` for bytes that were read.
    identity: Option<[u64; 7]>,
    /// What [`Self::check`] found, once it passed.
    checked: std::sync::OnceLock<Checked>,
}

/// What a passed [`MegatronIdx::check`] found, in the same pass: the `.bin` size it checked
/// against and digests of the two arrays (the dataset's fingerprint and the GPT cache's key, so
/// neither reads the arrays again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// The `.bin`'s size every sequence was checked against.
    pub bin_size: u64,
    /// CRC-32 of `sequence_lengths`' bytes.
    pub lengths_crc32: u32,
    /// CRC-32 of `sequence_pointers`' bytes.
    pub pointers_crc32: u32,
}

/// How many sequences the per-sequence check reads before releasing the mapping's pages.
const CHECK_WINDOW: usize = 1 << 20;

impl MegatronIdx {
    /// Maps the local `.idx` at `path` (which must be a regular file) and checks its header.
    pub fn map(path: &Path) -> Result<Self, FormatError> {
        // O_NONBLOCK + fstat: a FIFO or a device is refused, not waited on or mapped.
        let (f, size) = super::open_regular(path).map_err(io_err(path))?;
        if size > MAX_IDX_BYTES {
            return Err(corrupt(
                path,
                format!(
                    "{size} bytes: larger than the {MAX_IDX_BYTES}-byte limit for an index file"
                ),
            ));
        }
        let identity = super::file_identity(&f.metadata().map_err(io_err(path))?);
        let map = super::sys::ReadOnlyMap::map(&f, size).map_err(io_err(path))?;
        let mut idx = Self::parse(path, IdxBytes::Mapped(MappedFile(map)))?;
        idx.identity = Some(identity);
        Ok(idx)
    }

    /// Checks the header of `.idx` bytes and that the arrays it announces fit (`path` names them in
    /// errors). Reads the header and the first and last document index, nothing per sequence.
    pub fn parse(path: &Path, bytes: IdxBytes) -> Result<Self, FormatError> {
        let head = bytes.to_vec(0, LENGTHS_AT.min(bytes.len()));
        let mut c = Cursor {
            path,
            buf: &head,
            len: bytes.len(),
            pos: 0,
        };
        if c.take(9, "magic")? != MAGIC {
            return Err(corrupt(
                path,
                "bad magic at offset 0: not a Megatron MMIDIDX index",
            ));
        }
        let version = c.u64("version")?;
        if version != 1 {
            return Err(FormatError::Unsupported {
                path: path.to_path_buf(),
                reason: format!("index version {version} (only 1 exists)"),
            });
        }
        let code = c.take(1, "dtype code")?[0];
        let dtype = dtype_from_code(code)
            .ok_or_else(|| corrupt(path, format!("unknown dtype code {code} at offset 17")))?;
        let sequences = c.count("sequence_count", 4 + 8)?;
        let documents = c.count("document_count", 8)?;
        debug_assert_eq!(c.pos, LENGTHS_AT);
        // `count` checked each array alone; together they must fit too.
        c.skip(sequences * 12, "sequence_lengths and sequence_pointers")?;
        c.skip(documents * 8, "document_indices")?;
        let idx = Self {
            path: path.to_path_buf(),
            bytes,
            dtype,
            sequences,
            documents,
            identity: None,
            checked: std::sync::OnceLock::new(),
        };
        if documents > 0 {
            let (first, last) = (idx.document(0), idx.document(documents - 1));
            if first != 0 {
                return Err(corrupt(
                    path,
                    format!("document_indices start at {first}, not 0"),
                ));
            }
            if last < 0 || last as u64 > sequences as u64 {
                return Err(corrupt(
                    path,
                    format!("document index {last} exceeds sequence_count {sequences}"),
                ));
            }
        }
        Ok(idx)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Sequences.
    pub fn sequences(&self) -> usize {
        self.sequences
    }

    /// Entries of `document_indices` (documents + 1 as Megatron writes them).
    pub fn documents(&self) -> usize {
        self.documents
    }

    /// (device, inode, size, mtime seconds and nanoseconds, ctime seconds and nanoseconds) of a
    /// mapped local file, read from the descriptor that was mapped (`None`: the bytes were read,
    /// not mapped).
    pub fn identity(&self) -> Option<[u64; 7]> {
        self.identity
    }

    /// What [`Self::check`] found, once it passed (`None` before).
    pub fn checked(&self) -> Option<Checked> {
        self.checked.get().copied()
    }

    /// CRC-32 of the `sequence_lengths` array's bytes (little-endian `i32`s), read in pieces (or
    /// as the check found it).
    pub fn lengths_crc32(&self) -> u32 {
        if let Some(c) = self.checked.get() {
            return c.lengths_crc32;
        }
        let mut h = crc32fast::Hasher::new();
        let mut buf = vec![0u8; 4 * CHECK_WINDOW.min(self.sequences)];
        let mut w = 0;
        while w < self.sequences {
            let n = CHECK_WINDOW.min(self.sequences - w);
            let b = &mut buf[..4 * n];
            if !self.bytes.read(LENGTHS_AT + 4 * w, b) {
                b.fill(0); // not reached: `parse` checked the array fits
            }
            h.update(b);
            w += n;
        }
        h.finalize()
    }

    /// Whether the bytes are a mapping of the file (not a copy).
    pub fn is_mapped(&self) -> bool {
        matches!(self.bytes, IdxBytes::Mapped(_))
    }

    #[inline]
    fn le<const N: usize>(&self, at: usize) -> [u8; N] {
        if let IdxBytes::Mapped(m) = &self.bytes {
            return m.0.small::<N>(at).unwrap_or([0u8; N]);
        }
        let mut b = [0u8; N];
        // In bounds by `parse` for every index below the counts; out of range reads zeroes.
        if !self.bytes.read(at, &mut b) {
            b = [0u8; N];
        }
        b
    }

    /// Elements of sequence `i` (`i < sequences()`).
    #[inline]
    pub fn length(&self, i: usize) -> i32 {
        i32::from_le_bytes(self.le(LENGTHS_AT + 4 * i))
    }

    /// Byte offset of sequence `i` in the `.bin` (`i < sequences()`).
    #[inline]
    pub fn pointer(&self, i: usize) -> i64 {
        i64::from_le_bytes(self.le(LENGTHS_AT + 4 * self.sequences + 8 * i))
    }

    /// Entry `i` of `document_indices` (`i < documents()`).
    #[inline]
    pub fn document(&self, i: usize) -> i64 {
        i64::from_le_bytes(self.le(LENGTHS_AT + 12 * self.sequences + 8 * i))
    }

    /// Lengths of sequences `first..first + out.len()` into `out`, read at once; `false` (and `out`
    /// untouched) when they are not all in the file.
    pub fn read_lengths(&self, first: usize, out: &mut [i32]) -> bool {
        let mut b = [0u8; 4 * 64];
        let mut done = 0;
        while done < out.len() {
            let n = (out.len() - done).min(64);
            if first + done + n > self.sequences
                || !self
                    .bytes
                    .read(LENGTHS_AT + 4 * (first + done), &mut b[..4 * n])
            {
                return false;
            }
            for (o, c) in out[done..done + n].iter_mut().zip(b.chunks_exact(4)) {
                *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            done += n;
        }
        true
    }

    /// The lengths, in order.
    pub fn lengths(&self) -> impl ExactSizeIterator<Item = i32> + '_ {
        (0..self.sequences).map(|i| self.length(i))
    }

    /// Checks every sequence against the `.bin` of `size` bytes: lengths and pointers not negative,
    /// in file order without overlap, inside the file, at most 4 GiB each. One pass over the two
    /// arrays; a mapping's pages are released behind it, so the scan does not stay resident.
    pub fn check(&self, bin_path: &Path, size: u64) -> Result<(), FormatError> {
        let es = self.dtype.size() as u64;
        let mut prev_end = 0u64;
        let (lens_at, ptrs_at) = (LENGTHS_AT, LENGTHS_AT + 4 * self.sequences);
        let window = CHECK_WINDOW.min(self.sequences);
        let (mut lens_buf, mut ptrs_buf) = (vec![0u8; 4 * window], vec![0u8; 8 * window]);
        let (mut lens_crc, mut ptrs_crc) = (crc32fast::Hasher::new(), crc32fast::Hasher::new());
        let mut w = 0;
        while w < self.sequences {
            let n = CHECK_WINDOW.min(self.sequences - w);
            let (lens, ptrs) = (&mut lens_buf[..4 * n], &mut ptrs_buf[..8 * n]);
            if !self.bytes.read(lens_at + 4 * w, lens) || !self.bytes.read(ptrs_at + 8 * w, ptrs) {
                return Err(corrupt(
                    &self.path,
                    format!("sequences {w}..{} lie past the end of the index", w + n),
                ));
            }
            let (lens, ptrs) = (&*lens, &*ptrs);
            lens_crc.update(lens);
            ptrs_crc.update(ptrs);
            for (k, (l, p)) in lens.chunks_exact(4).zip(ptrs.chunks_exact(8)).enumerate() {
                let len = i32::from_le_bytes([l[0], l[1], l[2], l[3]]);
                let ptr = i64::from_le_bytes([p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]]);
                let i = w + k;
                if len < 0 || ptr < 0 {
                    return Err(corrupt(
                        &self.path,
                        format!("sequence {i}: negative length {len} or pointer {ptr}"),
                    ));
                }
                let bytes = len as u64 * es;
                let end = (ptr as u64).saturating_add(bytes);
                if end > size {
                    return Err(corrupt(
                        &self.path,
                        format!(
                            "sequence {i} at {ptr}+{bytes} points past the end of {} ({size} bytes)",
                            bin_path.display()
                        ),
                    ));
                }
                if (ptr as u64) < prev_end || bytes > u32::MAX as u64 {
                    return Err(corrupt(
                        &self.path,
                        format!(
                            "sequence {i} at {ptr}+{bytes} overlaps the previous one or is too large"
                        ),
                    ));
                }
                prev_end = end;
            }
            if let IdxBytes::Mapped(m) = &self.bytes {
                m.0.release(lens_at + 4 * w..lens_at + 4 * (w + n));
                m.0.release(ptrs_at + 8 * w..ptrs_at + 8 * (w + n));
            }
            w += n;
        }
        let _ = self.checked.set(Checked {
            bin_size: size,
            lengths_crc32: lens_crc.finalize(),
            pointers_crc32: ptrs_crc.finalize(),
        });
        Ok(())
    }
}

/// `PREFIX`, `PREFIX.bin` or `PREFIX.idx` → `PREFIX`.
pub fn prefix_of(p: &Path) -> PathBuf {
    let s = p.to_string_lossy();
    match s.strip_suffix(".bin").or_else(|| s.strip_suffix(".idx")) {
        Some(stem) => PathBuf::from(stem),
        None => p.to_path_buf(),
    }
}

pub(crate) fn with_ext(prefix: &Path, ext: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(ext);
    PathBuf::from(s)
}

/// Reads the header: `buf` holds the file's first bytes (up to the header's end), `len` is the
/// file's size, which the arrays after the header are checked against.
struct Cursor<'a> {
    path: &'a Path,
    buf: &'a [u8],
    len: usize,
    pos: usize,
}

impl Cursor<'_> {
    /// Moves past `n` bytes, which must be in the file.
    fn skip(&mut self, n: usize, what: &str) -> Result<std::ops::Range<usize>, FormatError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.len)
            .ok_or_else(|| {
                corrupt(
                    self.path,
                    format!(
                        "truncated: {what} needs {n} bytes at offset {}, file has {}",
                        self.pos, self.len
                    ),
                )
            })?;
        let r = self.pos..end;
        self.pos = end;
        Ok(r)
    }
    /// The next `n` header bytes (inside `buf`).
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], FormatError> {
        let r = self.skip(n, what)?;
        self.buf
            .get(r)
            .ok_or_else(|| corrupt(self.path, format!("{what}: past the header")))
    }
    fn u64(&mut self, what: &str) -> Result<u64, FormatError> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }
    fn count(&mut self, what: &str, elem: usize) -> Result<usize, FormatError> {
        let at = self.pos;
        let n = self.u64(what)?;
        let left = (self.len - self.pos) as u64;
        if n.checked_mul(elem as u64).is_none_or(|b| b > left) {
            return Err(corrupt(
                self.path,
                format!("{what} {n} at offset {at} exceeds the file ({left} bytes left)"),
            ));
        }
        Ok(n as usize)
    }
}
