//! Indexing one Arrow IPC file or stream: its schema and record batch blocks (footer, sidecar or a
//! scan), the column's layout, then each record batch's rows from its metadata and offsets buffers —
//! values are never decoded.

use std::io::{Read, Seek};
use std::path::Path;

use arrow_schema::DataType;

use super::{
    Block, blocks_in_order, footer_blocks, read_at, scan_stream, schema_at, shape, sidecar,
    unsupported,
};
use crate::formats::{FormatError, corrupt};

/// Every row of `column` in the file: (offset, length) of its bytes.
pub(super) fn index_file<R: Read + Seek>(
    f: &mut R,
    p: &Path,
    size: u64,
    column: &str,
) -> Result<Vec<(u64, u32)>, FormatError> {
    let (schema, blocks) = schema_and_blocks(f, p, size)?;
    let (col_idx, layout) = column_layout(&schema, p, column)?;
    // Blocks listed by a footer or a sidecar are untrusted: each once, in file order, so the work
    // below is bounded by the file's size (one block listed 2^18 times cost 11 s and 2.1 GB).
    blocks_in_order(&blocks, size).map_err(|(bi, why)| {
        corrupt(
            p,
            format!("record batch {bi}: {why} (blocks are listed once each, in file order)"),
        )
    })?;
    let mut out = Vec::new();
    for (bi, &block) in blocks.iter().enumerate() {
        index_batch(f, p, size, bi, block, &schema, col_idx, layout, &mut out)?;
    }
    Ok(out)
}

/// The schema and the record batch blocks: a file's footer, a stream's sidecar (the scan of this very
/// file, kept beside it), or a scan of the stream (stored as a sidecar).
fn schema_and_blocks<R: Read + Seek>(
    f: &mut R,
    p: &Path,
    size: u64,
) -> Result<(arrow_schema::Schema, Vec<Block>), FormatError> {
    let is_file = size >= 16 && read_at(f, p, 0, 6, "magic")? == b"ARROW1";
    Ok(if is_file {
        footer_blocks(f, p, size)?
    } else if let Some((at, blocks)) = sidecar::load(p, size) {
        // The scan of this very file, kept beside it.
        (schema_at(f, p, at)?, blocks)
    } else {
        // A stream (Hugging Face `datasets` files), indexed by one scan.
        let (schema, at, blocks) = scan_stream(f, p, size, 0).map_err(|e| match e {
            FormatError::Corrupt { path, reason } => FormatError::Corrupt {
                path,
                reason: format!("not an Arrow IPC file or stream: {reason}"),
            },
            e => e,
        })?;
        sidecar::store(p, size, at, &blocks);
        (schema, blocks)
    })
}

/// One record batch of an IPC file: its rows, field nodes (length, null count) and buffers (offset
/// in the file, length), every buffer checked to lie inside the batch's body.
#[derive(Debug, Clone)]
pub(crate) struct BatchBuffers {
    /// Rows.
    pub rows: u64,
    /// Each field node's (length, null count), in schema order (flattened).
    pub nodes: Vec<(i64, i64)>,
    /// Each buffer's (offset in the file, length).
    pub buffers: Vec<(u64, u64)>,
}

/// The schema and record batches of an Arrow IPC *file* (its footer; every batch listed once, in file
/// order, uncompressed), each batch's nodes and buffers read from its metadata and checked against
/// its body — nothing decoded, so no byte of the file can make it panic (arrow-ipc's `FileReader`
/// panicked on 37 of 250 mutated files). What a caller reads of a buffer is then bounded by it.
pub(crate) fn file_batches<R: Read + Seek>(
    f: &mut R,
    p: &Path,
    size: u64,
) -> Result<(arrow_schema::Schema, Vec<BatchBuffers>), FormatError> {
    if size < 16 || read_at(f, p, 0, 6, "magic")? != b"ARROW1" {
        return Err(corrupt(p, "not an Arrow IPC file (no ARROW1 magic)"));
    }
    let (schema, blocks) = footer_blocks(f, p, size)?;
    blocks_in_order(&blocks, size).map_err(|(bi, why)| {
        corrupt(
            p,
            format!("record batch {bi}: {why} (blocks are listed once each, in file order)"),
        )
    })?;
    let mut out = Vec::new();
    for (bi, &(boff, mlen, blen)) in blocks.iter().enumerate() {
        let body = boff as u64 + mlen as u64;
        let batch = with_record_batch(f, p, bi, (boff, mlen, blen), |_, rb| {
            let rows = u64::try_from(rb.length())
                .map_err(|_| corrupt(p, format!("record batch {bi}: {} rows", rb.length())))?;
            let nodes = rb
                .nodes()
                .map(|n| n.iter().map(|n| (n.length(), n.null_count())).collect())
                .unwrap_or_default();
            let buffers = match rb.buffers() {
                Some(bufs) => bufs
                    .iter()
                    .enumerate()
                    .map(|(i, b)| body_buffer(p, bi, Some(b), i, body, blen))
                    .collect::<Result<Vec<_>, _>>()?,
                None => Vec::new(),
            };
            Ok(BatchBuffers {
                rows,
                nodes,
                buffers,
            })
        })?;
        out.push(batch);
    }
    Ok((schema, out))
}

/// Column `column`'s position among the schema's fields and how its rows map to bytes.
fn column_layout(
    schema: &arrow_schema::Schema,
    p: &Path,
    column: &str,
) -> Result<(usize, Layout), FormatError> {
    let (col_idx, field) = schema
        .fields()
        .iter()
        .enumerate()
        .find(|(_, f)| f.name() == column)
        .ok_or_else(|| {
            let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            FormatError::Config(format!(
                "{}: no column {column:?} (columns: {names:?})",
                p.display()
            ))
        })?;
    let layout = match field.data_type() {
        DataType::Binary | DataType::Utf8 => Layout::Var { wide: false },
        DataType::LargeBinary | DataType::LargeUtf8 => Layout::Var { wide: true },
        DataType::FixedSizeBinary(w) if *w > 0 => Layout::Fixed { row: *w as u64 },
        DataType::List(c) | DataType::LargeList(c) => match c.data_type().primitive_width() {
            Some(w) if !c.data_type().is_nested() && *c.data_type() != DataType::Boolean => {
                Layout::List {
                    wide: matches!(field.data_type(), DataType::LargeList(_)),
                    elem: w as u64,
                }
            }
            _ => {
                return Err(unsupported(
                    p,
                    format!("column {column:?}: list of {}", c.data_type()),
                ));
            }
        },
        DataType::FixedSizeList(c, n) if *n > 0 => match c.data_type().primitive_width() {
            Some(w) if !c.data_type().is_nested() && *c.data_type() != DataType::Boolean => {
                Layout::Fixed {
                    row: w as u64 * *n as u64,
                }
            }
            _ => {
                return Err(unsupported(
                    p,
                    format!("column {column:?}: fixed-size list of {}", c.data_type()),
                ));
            }
        },
        other => {
            return Err(unsupported(
                p,
                format!(
                    "column {column:?} has type {other}; supported: Binary, LargeBinary, Utf8, LargeUtf8, FixedSizeBinary, FixedSizeList, List or LargeList of a primitive"
                ),
            ));
        }
    };
    Ok((col_idx, layout))
}

/// The rows of record batch `bi` (its block `(boff, mlen, blen)`), appended to `out`.
#[allow(clippy::too_many_arguments)] // one batch's whole context
fn index_batch<R: Read + Seek>(
    f: &mut R,
    p: &Path,
    size: u64,
    bi: usize,
    (boff, mlen, blen): Block,
    schema: &arrow_schema::Schema,
    col_idx: usize,
    layout: Layout,
    out: &mut Vec<(u64, u32)>,
) -> Result<(), FormatError> {
    check_block(p, size, bi, (boff, mlen, blen))?;
    let body = boff as u64 + mlen as u64;
    with_record_batch(f, p, bi, (boff, mlen, blen), |f, rb| {
        let (buf_base, node_base) = column_base(p, bi, schema, col_idx, &rb)?;
        let nodes = rb
            .nodes()
            .ok_or_else(|| corrupt(p, format!("record batch {bi}: no field nodes")))?;
        let bufs = rb
            .buffers()
            .ok_or_else(|| corrupt(p, format!("record batch {bi}: no buffers")))?;
        let rows = nodes
            .iter()
            .nth(node_base)
            .ok_or_else(|| {
                corrupt(
                    p,
                    format!("record batch {bi}: missing field node {node_base}"),
                )
            })?
            .length();
        let buf = |i: usize| {
            body_buffer(
                p,
                bi,
                bufs.iter().nth(buf_base + i),
                buf_base + i,
                body,
                blen,
            )
        };
        match layout {
            Layout::Var { .. } | Layout::List { .. } => {
                // Var: [validity, offsets, data]; List: [validity, offsets, child validity, values].
                let di = if matches!(layout, Layout::List { .. }) {
                    3
                } else {
                    2
                };
                var_rows(f, p, bi, rows, layout, buf(1)?, buf(di)?, out)
            }
            Layout::Fixed { row } => {
                // FixedSizeBinary: [validity, values]; FixedSizeList: [validity, child validity, child values].
                let fixed_list = matches!(
                    schema.fields()[col_idx].data_type(),
                    DataType::FixedSizeList(..)
                );
                fixed_rows(p, bi, rows, row, buf(if fixed_list { 2 } else { 1 })?, out)
            }
        }
    })
}

/// Refuses record batch `bi`'s block `(boff, mlen, blen)` unless it lies in the file of `size`
/// bytes (with a metadata length of at least 8).
fn check_block(
    p: &Path,
    size: u64,
    bi: usize,
    (boff, mlen, blen): Block,
) -> Result<(), FormatError> {
    if boff < 0
        || mlen < 8
        || blen < 0
        || (boff as u64)
            .saturating_add(mlen as u64)
            .saturating_add(blen as u64)
            > size
    {
        return Err(corrupt(
            p,
            format!("record batch {bi}: block {boff}+{mlen}+{blen} lies outside the file"),
        ));
    }
    Ok(())
}

/// The index of column `col_idx`'s first buffer and first field node in record batch `rb`: the
/// buffers and nodes of the columns before it.
fn column_base(
    p: &Path,
    bi: usize,
    schema: &arrow_schema::Schema,
    col_idx: usize,
    rb: &arrow_ipc::RecordBatch<'_>,
) -> Result<(usize, usize), FormatError> {
    let mut variadic: std::collections::VecDeque<i64> = rb
        .variadicBufferCounts()
        .map(|v| v.iter().collect())
        .unwrap_or_default();
    let (mut buf_base, mut node_base) = (0usize, 0usize);
    for f in schema.fields().iter().take(col_idx) {
        let (b, n) =
            shape(f, &mut variadic).map_err(|e| corrupt(p, format!("record batch {bi}: {e}")))?;
        buf_base += b;
        node_base += n;
    }
    Ok((buf_base, node_base))
}

/// The `rows` rows of `row` bytes each of a fixed-size column, in its values buffer `(voff,
/// vlen)`, appended to `out`.
fn fixed_rows(
    p: &Path,
    bi: usize,
    rows: i64,
    row: u64,
    (voff, vlen): (u64, u64),
    out: &mut Vec<(u64, u32)>,
) -> Result<(), FormatError> {
    if (rows as u64).saturating_mul(row) > vlen {
        return Err(corrupt(
            p,
            format!(
                "record batch {bi}: values buffer holds {vlen} bytes, {rows} rows of {row} need more"
            ),
        ));
    }
    crate::formats::reserve_index(out, p, rows as u64)?;
    out.extend((0..rows as u64).map(|r| (voff + r * row, row as u32)));
    Ok(())
}

/// Reads record batch `bi`'s metadata (its block `(boff, mlen, _)`, checked to lie in the file)
/// and hands `visit` the reader and the verified record batch header: the one parse of a batch's
/// message that indexing a column and listing a file's buffers share. Compressed bodies are
/// refused.
fn with_record_batch<R: Read + Seek, T>(
    f: &mut R,
    p: &Path,
    bi: usize,
    (boff, mlen, _): Block,
    visit: impl FnOnce(&mut R, arrow_ipc::RecordBatch<'_>) -> Result<T, FormatError>,
) -> Result<T, FormatError> {
    let meta = read_at(f, p, boff as u64, mlen as usize, "record batch metadata")?;
    let mbuf = if meta.get(..4) == Some(&[0xFF; 4]) {
        meta.get(8..)
    } else {
        meta.get(4..)
    }
    .ok_or_else(|| corrupt(p, format!("record batch {bi}: metadata of {mlen} bytes")))?;
    let msg = arrow_ipc::root_as_message(mbuf).map_err(|e| {
        corrupt(
            p,
            format!("record batch {bi} metadata at offset {boff}: {e}"),
        )
    })?;
    let rb = msg.header_as_record_batch().ok_or_else(|| {
        corrupt(
            p,
            format!("block {bi} at offset {boff} is not a record batch"),
        )
    })?;
    if rb.compression().is_some() {
        return Err(unsupported(
            p,
            format!(
                "record batch {bi} is compressed (write with compression off to read it in place)"
            ),
        ));
    }
    visit(f, rb)
}

/// The rows of a variable-length or list column in one record batch, from its offsets buffer
/// `(ooff, olen)` into its data buffer `(doff, dlen)`.
#[allow(clippy::too_many_arguments)] // one batch's buffers
fn var_rows<R: Read + Seek>(
    f: &mut R,
    p: &Path,
    bi: usize,
    rows: i64,
    layout: Layout,
    (ooff, olen): (u64, u64),
    (doff, dlen): (u64, u64),
    out: &mut Vec<(u64, u32)>,
) -> Result<(), FormatError> {
    let (wide, elem) = match layout {
        Layout::List { wide, elem } => (wide, elem),
        Layout::Var { wide } => (wide, 1),
        Layout::Fixed { .. } => (false, 1),
    };
    let w = if wide { 8 } else { 4 };
    let need = u64::try_from(rows)
        .ok()
        .and_then(|r| r.checked_add(1)?.checked_mul(w))
        .ok_or_else(|| corrupt(p, format!("record batch {bi}: {rows} rows")))?;
    if rows > 0 && olen < need {
        return Err(corrupt(
            p,
            format!(
                "record batch {bi}: offsets buffer holds {olen} bytes, {rows} rows need {need}"
            ),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    crate::formats::reserve_index(out, p, rows as u64)?;
    let ob = read_at(f, p, ooff, need as usize, "offsets buffer")?;
    let offs: Vec<i64> = if wide {
        ob.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect()
    } else {
        ob.chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as i64)
            .collect()
    };
    for (r, w) in offs.windows(2).enumerate() {
        let (a, b) = (
            w[0].saturating_mul(elem as i64),
            w[1].saturating_mul(elem as i64),
        );
        if w[0] < 0 || w[1] < w[0] || b as u64 > dlen || (b - a) as u64 > u32::MAX as u64 {
            return Err(corrupt(
                p,
                format!(
                    "record batch {bi} row {r}: offsets {}..{} invalid for a data buffer of {dlen} bytes",
                    w[0], w[1]
                ),
            ));
        }
        out.push((doff + a as u64, (b - a) as u32));
    }
    Ok(())
}

/// How a column's rows map to bytes.
#[derive(Debug, Clone, Copy)]
pub(super) enum Layout {
    /// Variable-length with 32- or 64-bit offsets.
    Var { wide: bool },
    /// Fixed bytes per row.
    Fixed { row: u64 },
    /// A list of primitives of `elem` bytes, 32- or 64-bit offsets (in elements).
    List { wide: bool, elem: u64 },
}

/// Buffer `i` (`b`, if the batch has it) of a record batch whose body is `blen` bytes at `body`: (offset in the file, length),
/// checked to lie inside the body.
fn body_buffer(
    p: &Path,
    bi: usize,
    b: Option<&arrow_ipc::Buffer>,
    i: usize,
    body: u64,
    blen: i64,
) -> Result<(u64, u64), FormatError> {
    let b = b.ok_or_else(|| corrupt(p, format!("record batch {bi}: missing buffer {i}")))?;
    if b.offset() < 0
        || b.length() < 0
        || (b.offset() as u64).saturating_add(b.length() as u64) > blen as u64
    {
        return Err(corrupt(
            p,
            format!(
                "record batch {bi}: buffer {i} at {}+{} outside the body",
                b.offset(),
                b.length()
            ),
        ));
    }
    Ok((body + b.offset() as u64, b.length() as u64))
}
