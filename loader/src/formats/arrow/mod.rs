//! Arrow IPC files — the random-access "file" format and the "stream" format Hugging Face `datasets`
//! writes (its cache and `save_to_disk` files) — through arrow-rs' flatbuffers. Sample = one row of one
//! chosen column; its bytes are read straight from the record batch bodies.
//!
//! The index is built at open time from the record batch blocks — listed by the footer of a file, or
//! found by one scan over the messages of a stream (each message's header says how long its body is,
//! so bodies are skipped, not read) — and each batch's metadata (field nodes and buffer locations);
//! for variable-length columns the offsets buffer is read too. Values are never decoded. Supported
//! column types: `Binary`, `LargeBinary`, `Utf8`, `LargeUtf8`, `FixedSizeBinary(w)`,
//! `FixedSizeList(primitive, n)`, `List(primitive)` and `LargeList(primitive)` (a row's values, e.g.
//! token ids). Compressed bodies are refused.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_schema::{DataType, Field, UnionMode};

mod batches;

use super::index::{DatasetIndex, SampleLoc, Shard};
use super::{FormatError, corrupt, file_size, io_err};
pub(crate) use batches::file_batches;
use batches::index_file;
pub(crate) use sidecar::MAGIC as SIDECAR_MAGIC;

fn unsupported(path: &Path, reason: impl Into<String>) -> FormatError {
    FormatError::Unsupported {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn read_at<R: Read + Seek>(
    f: &mut R,
    path: &Path,
    off: u64,
    len: usize,
    what: &str,
) -> Result<Vec<u8>, FormatError> {
    f.seek(SeekFrom::Start(off)).map_err(io_err(path))?;
    // Checked against memory, and grown only as the bytes arrive: a length from the file (or a
    // size a remote server claims) pins nothing it does not deliver.
    super::check_memory(path, what, len as u64)?;
    let mut b = Vec::new();
    (&mut *f)
        .take(len as u64)
        .read_to_end(&mut b)
        .map_err(io_err(path))?;
    if b.len() != len {
        return Err(corrupt(
            path,
            format!("truncated: {what} of {len} bytes at offset {off}"),
        ));
    }
    Ok(b)
}

/// The largest footer read: the schema and 24 bytes per record batch.
const MAX_FOOTER: u64 = 64 << 20;

/// One record batch message: (offset, metadata length with its prefix and padding, body length).
type Block = (i64, i32, i64);

/// What a scan of a stream finds: the schema, where its message's metadata lies (offset, length),
/// and the record batch blocks.
type Scanned = (arrow_schema::Schema, (u64, u32), Vec<Block>);

/// The schema and record batch blocks of an IPC stream (from `start`: 0, or 8 past a file's magic),
/// by one scan over the messages.
fn scan_stream<R: Read + Seek>(
    f: &mut R,
    p: &Path,
    size: u64,
    start: u64,
) -> Result<Scanned, FormatError> {
    let mut pos = start;
    let mut schema = None;
    let mut schema_at = (0u64, 0u32);
    let mut blocks = Vec::new();
    while pos + 4 <= size {
        let head = read_at(f, p, pos, 4, "message length")?;
        let (prefix, len) = if head == [0xFF; 4] {
            if pos + 8 > size {
                break;
            }
            let l = read_at(f, p, pos + 4, 4, "message length")?;
            (8u64, i32::from_le_bytes([l[0], l[1], l[2], l[3]]))
        } else {
            (
                4u64,
                i32::from_le_bytes([head[0], head[1], head[2], head[3]]),
            )
        };
        if len == 0 {
            break; // end of stream
        }
        if len < 0 || pos + prefix + len as u64 > size {
            return Err(corrupt(
                p,
                format!("message at offset {pos}: metadata length {len} outside the file"),
            ));
        }
        let meta = read_at(f, p, pos + prefix, len as usize, "message metadata")?;
        let msg = arrow_ipc::root_as_message(&meta)
            .map_err(|e| corrupt(p, format!("message at offset {pos}: {e}")))?;
        let body = msg.bodyLength();
        let end = (pos + prefix + len as u64).checked_add(body.max(0) as u64);
        if body < 0 || end.is_none_or(|e| e > size) {
            return Err(corrupt(
                p,
                format!("message at offset {pos}: body of {body} bytes outside the file"),
            ));
        }
        if let Some(sc) = msg.header_as_schema() {
            if schema.is_none() {
                schema_at = (pos + prefix, len as u32);
                schema = Some(
                    arrow_ipc::convert::try_fb_to_schema(sc)
                        .map_err(|e| corrupt(p, format!("schema at offset {pos}: {e}")))?,
                );
            }
        } else if msg.header_as_record_batch().is_some() {
            let mlen = i32::try_from(prefix + len as u64)
                .map_err(|_| corrupt(p, format!("message at offset {pos}: metadata too long")))?;
            blocks.push((pos as i64, mlen, body));
        }
        pos = end.unwrap_or(size);
    }
    let schema = schema.ok_or_else(|| corrupt(p, "no schema message: not an Arrow IPC stream"))?;
    Ok((schema, schema_at, blocks))
}

/// The schema message whose metadata lies at `at` (offset, length).
fn schema_at<R: Read + Seek>(
    f: &mut R,
    p: &Path,
    at: (u64, u32),
) -> Result<arrow_schema::Schema, FormatError> {
    let meta = read_at(f, p, at.0, at.1 as usize, "schema message")?;
    let msg = arrow_ipc::root_as_message(&meta)
        .map_err(|e| corrupt(p, format!("schema message at offset {}: {e}", at.0)))?;
    let sc = msg
        .header_as_schema()
        .ok_or_else(|| corrupt(p, format!("message at offset {} is not a schema", at.0)))?;
    arrow_ipc::convert::try_fb_to_schema(sc)
        .map_err(|e| corrupt(p, format!("schema at offset {}: {e}", at.0)))
}

/// Where a shard's index sidecar lives: `SHARD.ubdirect-index` beside it (Arrow streams, WebDataset
/// tars).
pub(crate) fn sidecar_path(p: &std::path::Path) -> std::path::PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".ubdirect-index");
    std::path::PathBuf::from(s)
}

/// The identity ([`crate::formats::file_identity`]: device, inode, size, mtime, ctime) of a local
/// file of `size` bytes: what a sidecar is keyed by.
pub(crate) fn sidecar_identity(p: &std::path::Path, size: u64) -> Option<[u64; 7]> {
    let m = std::fs::metadata(p).ok()?;
    (m.is_file() && m.len() == size).then(|| crate::formats::file_identity(&m))
}

/// The scan of a local stream, kept beside it as `FILE.ubdirect-index` (when the directory is
/// writable) and used while the file's identity is unchanged. Untrusted: sealed under this user's
/// key ([`crate::formats::seal`]) and, with a key, used only when the seal verifies; without one
/// (or in any case) its blocks must lie inside the file, in order.
///
/// Layout (little-endian): magic `UBDASX02`; the file's identity (7 × u64); the schema message's
/// offset (u64) and length (u32); block count (u32); per block offset (i64), metadata length (i32),
/// body length (i64); the seal (32 bytes, zeros when unsealed).
mod sidecar {
    use std::path::Path;

    use super::Block;
    use crate::formats::seal;

    pub(crate) const MAGIC: &[u8; 8] = b"UBDASX02";
    /// Bytes before the blocks.
    const HEAD: usize = 8 + 56 + 12 + 4;
    /// The most blocks a sidecar may list (its size is checked before it is read).
    const MAX_BLOCKS: u64 = 1 << 24;

    use super::sidecar_identity as identity;
    pub(super) use super::sidecar_path as path;

    /// The most blocks a file of `size` bytes can hold: each is at least 8 bytes of metadata,
    /// and blocks do not overlap.
    pub(super) fn most_blocks(size: u64) -> u64 {
        (size / 8).min(MAX_BLOCKS)
    }

    fn most_bytes(size: u64) -> u64 {
        (HEAD + seal::SEAL) as u64 + most_blocks(size) * 20
    }

    /// The scan of `p` (`size` bytes), if a sidecar for this very file exists. A sidecar is
    /// untrusted (anyone who can write the directory can write one): sealed by this user when there
    /// is a key, and in any case listing at most as many blocks as the file can hold, each inside the
    /// file, in file order and not overlapping; anything else is ignored and the file is scanned
    /// again.
    pub(super) fn load(p: &Path, size: u64) -> Option<((u64, u32), Vec<Block>)> {
        use std::io::Read;
        let id = identity(p, size)?;
        let sp = path(p);
        // A regular file (a FIFO is refused, not waited on), its size checked before reading.
        let (f, len) = crate::formats::open_regular(&sp).ok()?;
        if !((HEAD + seal::SEAL) as u64..=most_bytes(size)).contains(&len) {
            refused(&sp);
            return None;
        }
        let mut b = Vec::with_capacity(len as usize);
        f.take(len).read_to_end(&mut b).ok()?;
        let got = parse(&b, Some(id), size, seal::key().as_ref());
        if got.is_none() {
            refused(&sp);
        }
        got
    }

    /// A sidecar that exists and is not used (another file's, damaged, forged, unsealed where a
    /// seal is expected): counted, and the stream scanned again.
    fn refused(sp: &Path) {
        ubdirect_ub::fallback::record(
            "arrow_sidecar_invalid",
            format!(
                "{}: not this stream's scan (or not sealed by this user); scanning it again",
                sp.display()
            ),
        );
    }

    /// The scan the sidecar bytes `b` describe for a file of `size` bytes whose identity is `id`
    /// (`None`: not compared), sealed under `key` (`None`: not checked), if they are a valid sidecar
    /// of such a file.
    pub(super) fn parse(
        b: &[u8],
        id: Option<[u64; 7]>,
        size: u64,
        key: Option<&[u8; 32]>,
    ) -> Option<((u64, u32), Vec<Block>)> {
        if b.len() < HEAD + seal::SEAL || b.len() as u64 > most_bytes(size) {
            return None;
        }
        if key.is_some_and(|k| !seal::verify_bytes(k, b)) {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        if &b[..8] != MAGIC || id.is_some_and(|id| (0..7).any(|k| u64_at(8 + 8 * k) != id[k])) {
            return None;
        }
        let schema = (u64_at(64), u32::from_le_bytes(b[72..76].try_into().ok()?));
        let n = u32::from_le_bytes(b[76..80].try_into().ok()?) as usize;
        if b.len() != HEAD + n * 20 + seal::SEAL {
            return None;
        }
        let blocks: Vec<Block> = b[HEAD..b.len() - seal::SEAL]
            .chunks_exact(20)
            .map(|c| {
                (
                    i64::from_le_bytes(c[..8].try_into().unwrap_or([0; 8])),
                    i32::from_le_bytes(c[8..12].try_into().unwrap_or([0; 4])),
                    i64::from_le_bytes(c[12..20].try_into().unwrap_or([0; 8])),
                )
            })
            .collect();
        super::blocks_in_order(&blocks, size).ok()?;
        Some((schema, blocks))
    }

    /// Writes the sidecar of `p`; a directory that is not writable only costs the next scan.
    pub(super) fn store(p: &Path, size: u64, schema: (u64, u32), blocks: &[Block]) {
        let Some(id) = identity(p, size) else { return };
        if blocks.len() as u64 > MAX_BLOCKS {
            return;
        }
        let mut b = Vec::with_capacity(HEAD + blocks.len() * 20 + seal::SEAL);
        b.extend_from_slice(MAGIC);
        for v in id {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&schema.0.to_le_bytes());
        b.extend_from_slice(&schema.1.to_le_bytes());
        b.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
        for &(o, m, l) in blocks {
            b.extend_from_slice(&o.to_le_bytes());
            b.extend_from_slice(&m.to_le_bytes());
            b.extend_from_slice(&l.to_le_bytes());
        }
        let b = seal::sealed(b, seal::key().as_ref());
        // Written whole, then renamed into place, never through a planted name: a reader never
        // sees half of one.
        let _ = ubdirect_ub::write_new(&path(p), &b);
    }
}

/// Buffers and field nodes a field occupies in a record batch (children included); view types consume
/// one variadic count each.
fn shape(
    f: &Field,
    variadic: &mut std::collections::VecDeque<i64>,
) -> Result<(usize, usize), String> {
    let children = |fields: &[Arc<Field>], variadic: &mut std::collections::VecDeque<i64>| {
        fields.iter().try_fold((0usize, 0usize), |(b, n), c| {
            let (cb, cn) = shape(c, variadic)?;
            Ok::<_, String>((b + cb, n + cn))
        })
    };
    Ok(match f.data_type() {
        DataType::Null => (0, 1),
        DataType::Binary | DataType::Utf8 | DataType::LargeBinary | DataType::LargeUtf8 => (3, 1),
        DataType::BinaryView | DataType::Utf8View => {
            let extra = variadic
                .pop_front()
                .ok_or("missing variadic buffer count")?;
            // From the file: a negative or absurd count is corrupt, not an overflow.
            let extra = usize::try_from(extra)
                .ok()
                .filter(|e| *e <= 1 << 20)
                .ok_or("variadic buffer count out of range")?;
            (2 + extra, 1)
        }
        DataType::List(c) | DataType::LargeList(c) | DataType::Map(c, _) => {
            let (b, n) = shape(c, variadic)?;
            (2 + b, 1 + n)
        }
        DataType::ListView(c) | DataType::LargeListView(c) => {
            let (b, n) = shape(c, variadic)?;
            (3 + b, 1 + n)
        }
        DataType::FixedSizeList(c, _) => {
            let (b, n) = shape(c, variadic)?;
            (1 + b, 1 + n)
        }
        DataType::Struct(fields) => {
            let (b, n) = children(fields, variadic)?;
            (1 + b, 1 + n)
        }
        DataType::Union(fields, mode) => {
            let fs: Vec<Arc<Field>> = fields.iter().map(|(_, f)| f.clone()).collect();
            let (b, n) = children(&fs, variadic)?;
            (if *mode == UnionMode::Dense { 2 } else { 1 } + b, 1 + n)
        }
        DataType::RunEndEncoded(a, b) => {
            let (b1, n1) = shape(a, variadic)?;
            let (b2, n2) = shape(b, variadic)?;
            (b1 + b2, 1 + n1 + n2)
        }
        DataType::Dictionary(_, _) => (2, 1),
        _ => (2, 1),
    })
}

/// Indexes column `column` of Arrow IPC files.
pub fn open(paths: &[PathBuf], column: &str) -> Result<DatasetIndex, FormatError> {
    let mut shards = paths
        .iter()
        .map(|p| Ok((p.clone(), file_size(p)?, File::open(p).map_err(io_err(p))?)))
        .collect::<Result<Vec<_>, FormatError>>()?;
    open_readers(&mut shards, column)
}

/// Indexes column `column` of Arrow IPC shards read through seekable sources: (name, size, source).
pub fn open_readers<R: Read + Seek>(
    shards: &mut [(PathBuf, u64, R)],
    column: &str,
) -> Result<DatasetIndex, FormatError> {
    let mut idx = DatasetIndex {
        format: "arrow".into(),
        ..Default::default()
    };
    for (si, (p, size, r)) in shards.iter_mut().enumerate() {
        let samples = index_file(r, p, *size, column)?;
        idx.samples
            .extend(samples.into_iter().map(|(offset, len)| SampleLoc {
                shard: si as u32,
                offset,
                len,
            }));
        idx.shards.push(Shard {
            path: p.clone(),
            size: *size,
        });
    }
    Ok(idx)
}

/// The element type of list column `column` of a local Arrow IPC file or stream (GPT mode's token
/// type): `None` when the column is not a list of integers.
pub fn column_dtype(path: &Path, column: &str) -> Result<Option<super::Dtype>, FormatError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let size = file_size(path)?;
    column_dtype_in(&mut f, path, size, column)
}

/// [`column_dtype`] of an Arrow IPC file or stream of `size` bytes read through `f` (a local file or
/// a `ub://` shard's reader, `path` naming it in errors): a file's schema from its footer, a
/// stream's from its first message (nothing else is read).
pub fn column_dtype_in<R: Read + Seek>(
    f: &mut R,
    path: &Path,
    size: u64,
    column: &str,
) -> Result<Option<super::Dtype>, FormatError> {
    use super::Dtype;
    Ok(column_element_in(f, path, size, column)?
        .map(|(d, _)| d)
        .filter(|d| !matches!(d, Dtype::F16 | Dtype::F32 | Dtype::F64)))
}

/// The element type of `column`'s lists (integers and floats) in an Arrow file or stream, and
/// the list size where the column is a fixed-size list; `None` when the column is missing or not
/// a list of those.
pub fn column_element_in<R: Read + Seek>(
    f: &mut R,
    path: &Path,
    size: u64,
    column: &str,
) -> Result<Option<(super::Dtype, Option<u64>)>, FormatError> {
    use super::Dtype;
    let is_file = size >= 16 && read_at(f, path, 0, 6, "magic")? == b"ARROW1";
    let schema = if is_file {
        footer_blocks(f, path, size)?.0
    } else {
        first_schema(f, path, size)?
    };
    let Some(field) = schema.fields().iter().find(|f| f.name() == column) else {
        return Ok(None);
    };
    let (child, fixed) = match field.data_type() {
        DataType::List(c) | DataType::LargeList(c) => (c.data_type(), None),
        DataType::FixedSizeList(c, n) => (c.data_type(), u64::try_from(*n).ok()),
        _ => return Ok(None),
    };
    let dtype = match child {
        DataType::UInt8 => Dtype::U8,
        DataType::Int8 => Dtype::I8,
        DataType::UInt16 => Dtype::U16,
        DataType::Int16 => Dtype::I16,
        DataType::UInt32 => Dtype::U32,
        DataType::Int32 => Dtype::I32,
        DataType::UInt64 => Dtype::U64,
        DataType::Int64 => Dtype::I64,
        DataType::Float16 => Dtype::F16,
        DataType::Float32 => Dtype::F32,
        DataType::Float64 => Dtype::F64,
        _ => return Ok(None),
    };
    Ok(Some((dtype, fixed)))
}

/// The schema of an IPC stream: its first message, which must be one.
fn first_schema<R: Read + Seek>(
    f: &mut R,
    p: &Path,
    size: u64,
) -> Result<arrow_schema::Schema, FormatError> {
    if size < 8 {
        return Err(corrupt(p, "no schema message: not an Arrow IPC stream"));
    }
    let head = read_at(f, p, 0, 8, "message length")?;
    let (prefix, len) = if head[..4] == [0xFF; 4] {
        (
            8u64,
            i32::from_le_bytes([head[4], head[5], head[6], head[7]]),
        )
    } else {
        (
            4u64,
            i32::from_le_bytes([head[0], head[1], head[2], head[3]]),
        )
    };
    if len <= 0 || prefix + len as u64 > size {
        return Err(corrupt(
            p,
            format!("message at offset 0: metadata length {len} outside the file"),
        ));
    }
    schema_at(f, p, (prefix, len as u32))
}

/// The record batch blocks an Arrow sidecar (`FILE.ubdirect-index`) lists for a file of `size`
/// bytes, if it is a valid one (its identity fields are not compared): for fuzzing the parser.
pub fn parse_sidecar(bytes: &[u8], size: u64) -> Option<Vec<(i64, i32, i64)>> {
    sidecar::parse(bytes, None, size, None).map(|(_, blocks)| blocks)
}

/// Checks that `blocks` lie inside a file of `size` bytes, in file order, none overlapping the one
/// before (so there are at most `size / 8` of them); `Err((block, why))`.
fn blocks_in_order(blocks: &[Block], size: u64) -> Result<(), (usize, String)> {
    if blocks.len() as u64 > sidecar::most_blocks(size) {
        return Err((
            blocks.len(),
            format!("{} blocks listed in a file of {size} bytes", blocks.len()),
        ));
    }
    let mut end = 0u64;
    for (bi, &(boff, mlen, blen)) in blocks.iter().enumerate() {
        let (Ok(o), Ok(m), Ok(l)) = (
            u64::try_from(boff),
            u64::try_from(mlen),
            u64::try_from(blen),
        ) else {
            return Err((
                bi,
                format!("block {boff}+{mlen}+{blen} has a negative field"),
            ));
        };
        if m < 8 || o < end {
            return Err((
                bi,
                format!("block at {o} overlaps the one before (ends at {end})"),
            ));
        }
        end = o.saturating_add(m).saturating_add(l);
        if end > size {
            return Err((
                bi,
                format!("block {o}+{m}+{l} lies outside the file ({size} bytes)"),
            ));
        }
    }
    Ok(())
}

/// The schema and record batch blocks of an IPC file, from its footer.
fn footer_blocks<R: Read + Seek>(
    f: &mut R,
    p: &Path,
    size: u64,
) -> Result<(arrow_schema::Schema, Vec<Block>), FormatError> {
    let tail: [u8; 10] = read_at(f, p, size - 10, 10, "footer trailer")?
        .try_into()
        .map_err(|_| corrupt(p, "footer trailer"))?;
    let flen = arrow_ipc::reader::read_footer_length(tail)
        .map_err(|e| corrupt(p, format!("at offset {}: {e}", size - 10)))? as u64;
    if flen + 10 > size {
        return Err(corrupt(p, format!("footer length {flen} exceeds the file")));
    }
    // A footer is the schema and 24 bytes a record batch: past MAX_FOOTER it is a damaged or forged
    // length, refused before it is read (a sparse file declaring 2³¹ − 1 bytes cost 2 GiB).
    if flen > MAX_FOOTER {
        return Err(corrupt(
            p,
            format!(
                "footer length {flen} exceeds {MAX_FOOTER} bytes (about 2.7 million record batches)"
            ),
        ));
    }
    let fbuf = read_at(f, p, size - 10 - flen, flen as usize, "footer")?;
    let footer = arrow_ipc::root_as_footer(&fbuf)
        .map_err(|e| corrupt(p, format!("footer at offset {}: {e}", size - 10 - flen)))?;
    let schema = arrow_ipc::convert::try_fb_to_schema(
        footer
            .schema()
            .ok_or_else(|| corrupt(p, "footer has no schema"))?,
    )
    .map_err(|e| corrupt(p, format!("footer schema: {e}")))?;
    let blocks = footer
        .recordBatches()
        .ok_or_else(|| corrupt(p, "footer lists no record batches"))?
        .iter()
        .map(|b| (b.offset(), b.metaDataLength(), b.bodyLength()))
        .collect();
    Ok((schema, blocks))
}

/// Writes an Arrow IPC file with columns `id` (Int64), `payload` (Binary, the given rows) and `vec`
/// (FixedSizeList<Float32, 16>), in record batches of `batch_rows` rows, uncompressed.
pub fn write(path: &Path, payloads: &[Vec<u8>], batch_rows: usize) -> Result<(), FormatError> {
    use arrow_array::builder::{BinaryBuilder, FixedSizeListBuilder, Float32Builder};
    use arrow_array::{ArrayRef, Int64Array, RecordBatch};
    use arrow_schema::Schema;
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("payload", DataType::Binary, false),
        Field::new(
            "vec",
            DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Float32, true)), 16),
            false,
        ),
    ]));
    let file = ubdirect_ub::NewFile::create(path).map_err(io_err(path))?;
    let arrow_err = |e: arrow_schema::ArrowError| corrupt(path, format!("writing: {e}"));
    let mut w = arrow_ipc::writer::FileWriter::try_new(file, &schema).map_err(arrow_err)?;
    for (ci, chunk) in payloads.chunks(batch_rows.max(1)).enumerate() {
        let base = (ci * batch_rows.max(1)) as i64;
        let ids = Int64Array::from_iter_values(base..base + chunk.len() as i64);
        let mut bin = BinaryBuilder::new();
        for r in chunk {
            bin.append_value(r);
        }
        let mut fl = FixedSizeListBuilder::new(Float32Builder::new(), 16);
        for (i, _) in chunk.iter().enumerate() {
            for k in 0..16 {
                fl.values()
                    .append_value((base + i as i64) as f32 + k as f32 / 16.0);
            }
            fl.append(true);
        }
        let cols: Vec<ArrayRef> =
            vec![Arc::new(ids), Arc::new(bin.finish()), Arc::new(fl.finish())];
        let rb = RecordBatch::try_new(schema.clone(), cols).map_err(arrow_err)?;
        w.write(&rb).map_err(arrow_err)?;
    }
    w.into_inner()
        .map_err(arrow_err)?
        .commit()
        .map_err(io_err(path))
}
