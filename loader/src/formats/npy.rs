//! NumPy `.npy` files (format versions 1.0, 2.0 and 3.0; C order). Sample = one slice along the first
//! axis.

use std::io::{Read, Seek};
use std::path::{Path, PathBuf};

use super::index::{DatasetIndex, Samples, Shard};
use super::{FormatError, corrupt, io_err};

/// What the header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyHeader {
    /// Format version (major, minor).
    pub version: (u8, u8),
    /// The dtype descriptor, e.g. `<f4`.
    pub descr: String,
    /// Bytes per element.
    pub itemsize: u64,
    /// Shape.
    pub shape: Vec<u64>,
    /// Offset of the first data byte.
    pub data_offset: u64,
}

fn unsupported(path: &Path, reason: impl Into<String>) -> FormatError {
    FormatError::Unsupported {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Parses the header of a `.npy` file.
pub fn read_header(path: &Path) -> Result<NpyHeader, FormatError> {
    let (mut f, _) = super::open_regular(path).map_err(io_err(path))?;
    read_header_from(&mut f, path)
}

/// Parses a `.npy` header from any seekable source (a local file, a `ub://` file); `path` names it
/// in errors.
pub fn read_header_from<R: Read + Seek>(f: &mut R, path: &Path) -> Result<NpyHeader, FormatError> {
    let mut pre = [0u8; 12];
    let n = read_up_to(f, &mut pre).map_err(io_err(path))?;
    if n < 10 || &pre[..6] != b"\x93NUMPY" {
        return Err(corrupt(path, "bad magic at offset 0: not a .npy file"));
    }
    let version = (pre[6], pre[7]);
    let (hlen, start) = match version.0 {
        1 => (u16::from_le_bytes([pre[8], pre[9]]) as u64, 10u64),
        2 | 3 => {
            if n < 12 {
                return Err(corrupt(path, "truncated header length at offset 8"));
            }
            (
                u32::from_le_bytes([pre[8], pre[9], pre[10], pre[11]]) as u64,
                12u64,
            )
        }
        v => {
            return Err(unsupported(
                path,
                format!("format version {v}.{}", version.1),
            ));
        }
    };
    if hlen > 1 << 20 {
        return Err(corrupt(
            path,
            format!("header length {hlen} at offset 8 is implausible"),
        ));
    }
    let mut header = vec![0u8; hlen as usize];
    f.seek(std::io::SeekFrom::Start(start))
        .map_err(io_err(path))?;
    f.read_exact(&mut header).map_err(|_| {
        corrupt(
            path,
            format!("truncated: header of {hlen} bytes at offset {start}"),
        )
    })?;
    let text = std::str::from_utf8(&header).map_err(|_| corrupt(path, "header is not text"))?;
    let descr = dict_str(text, "descr").ok_or_else(|| {
        if text.contains("'descr': [") {
            unsupported(path, "structured dtypes")
        } else {
            corrupt(path, format!("header has no 'descr': {text:?}"))
        }
    })?;
    match dict_raw(text, "fortran_order").map(str::trim) {
        Some(v) if v.starts_with("False") => {}
        Some(v) if v.starts_with("True") => {
            return Err(unsupported(
                path,
                "Fortran-order arrays (save with C order)",
            ));
        }
        _ => return Err(corrupt(path, "header has no valid 'fortran_order'")),
    }
    let shape = parse_shape(text)
        .ok_or_else(|| corrupt(path, format!("header has no valid 'shape': {text:?}")))?;
    if shape.is_empty() {
        return Err(unsupported(
            path,
            "0-d arrays have no first axis to sample along",
        ));
    }
    let itemsize = itemsize(&descr).map_err(|r| unsupported(path, r))?;
    Ok(NpyHeader {
        version,
        descr,
        itemsize,
        shape,
        data_offset: start + hlen,
    })
}

fn read_up_to<R: Read>(f: &mut R, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn dict_raw<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let k = format!("'{key}':");
    let i = text.find(&k)? + k.len();
    Some(&text[i..])
}

fn dict_str(text: &str, key: &str) -> Option<String> {
    let rest = dict_raw(text, key)?.trim_start();
    let q = rest.chars().next().filter(|c| *c == '\'' || *c == '"')?;
    let rest = &rest[1..];
    let end = rest.find(q)?;
    Some(rest[..end].to_string())
}

fn parse_shape(text: &str) -> Option<Vec<u64>> {
    let rest = dict_raw(text, "shape")?.trim_start();
    let rest = rest.strip_prefix('(')?;
    let end = rest.find(')')?;
    rest[..end]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('L').parse::<u64>().ok())
        .collect()
}

fn itemsize(descr: &str) -> Result<u64, String> {
    let d = descr.trim_start_matches(['<', '>', '|', '=']);
    let mut chars = d.chars();
    let kind = chars.next().ok_or("empty dtype")?;
    let n: u64 = chars
        .as_str()
        .split('[')
        .next()
        .unwrap_or("")
        .parse()
        .map_err(|_| format!("dtype {descr:?}"))?;
    match kind {
        'b' | 'i' | 'u' | 'f' | 'c' | 'V' | 'S' | 'M' | 'm' if n > 0 => Ok(n),
        'U' if n > 0 => n.checked_mul(4).ok_or_else(|| format!("dtype {descr:?}")),
        'O' => Err("object arrays (pickled Python objects)".into()),
        _ => Err(format!("dtype {descr:?}")),
    }
}

/// Indexes `.npy` files.
pub fn open(paths: &[PathBuf]) -> Result<DatasetIndex, FormatError> {
    let mut shards = paths
        .iter()
        .map(|p| {
            let (f, size) = super::open_regular(p).map_err(io_err(p))?;
            Ok((p.clone(), size, f))
        })
        .collect::<Result<Vec<_>, FormatError>>()?;
    open_readers(&mut shards)
}

/// Indexes `.npy` shards read through seekable sources: (name, size, source).
pub fn open_readers<R: Read + Seek>(
    shards: &mut [(PathBuf, u64, R)],
) -> Result<DatasetIndex, FormatError> {
    let mut idx = DatasetIndex {
        format: "npy".into(),
        ..Default::default()
    };
    // Rows are fixed-size records after each file's header: one run per file, nothing per row.
    let (mut runs, mut bases) = (Vec::new(), Vec::new());
    for (si, (p, size, r)) in shards.iter_mut().enumerate() {
        let h = read_header_from(r, p)?;
        if let Some((run, base)) = add_shard(&mut idx, si, p, *size, &h)? {
            runs.push(run);
            bases.push(base);
        }
    }
    idx.samples = Samples::fixed_at(runs, bases);
    Ok(idx)
}

/// A file's rows: `(shard, row bytes, rows)` and the offset of the first.
type Rows = ((u32, u32, u64), u64);

/// Adds shard `si` to `idx.shards`; its rows as a run `(shard, row bytes, rows)` and the offset
/// of the first (`None`: rows of no bytes, which are no samples).
fn add_shard(
    idx: &mut DatasetIndex,
    si: usize,
    p: &Path,
    size: u64,
    h: &NpyHeader,
) -> Result<Option<Rows>, FormatError> {
    {
        let row = h.shape[1..]
            .iter()
            .try_fold(h.itemsize, |a, &d| a.checked_mul(d))
            .filter(|r| *r <= u32::MAX as u64)
            .ok_or_else(|| unsupported(p, "rows larger than 4 GiB"))?;
        let need = h.shape[0]
            .checked_mul(row)
            .and_then(|b| b.checked_add(h.data_offset));
        if need.is_none_or(|n| n > size) {
            return Err(corrupt(
                p,
                format!(
                    "truncated: shape {:?} of {} needs {} bytes from offset {}, file has {size}",
                    h.shape,
                    h.descr,
                    h.shape[0].saturating_mul(row),
                    h.data_offset
                ),
            ));
        }
        idx.shards.push(Shard {
            path: p.to_path_buf(),
            size,
        });
        Ok((row > 0 && h.shape[0] > 0)
            .then_some(((si as u32, row as u32, h.shape[0]), h.data_offset)))
    }
}

/// Writes a version 1.0 `.npy` file with C-order `data` of dtype `descr` and `shape`.
pub fn write(path: &Path, descr: &str, shape: &[u64], data: &[u8]) -> Result<(), FormatError> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_s}, }}");
    let total = 10 + h.len() + 1;
    h.push_str(&" ".repeat((64 - total % 64) % 64));
    h.push('\n');
    let mut out = Vec::with_capacity(10 + h.len() + data.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(h.len() as u16).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    ubdirect_ub::write_new(path, &out).map_err(io_err(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_shapes_and_dtypes() {
        let t = "{'descr': '<f4', 'fortran_order': False, 'shape': (10, 3, 2), }";
        assert_eq!(parse_shape(t), Some(vec![10, 3, 2]));
        assert_eq!(dict_str(t, "descr").as_deref(), Some("<f4"));
        assert_eq!(parse_shape("{'shape': (7,), }"), Some(vec![7]));
        assert_eq!(parse_shape("{'shape': (), }"), Some(vec![]));
        assert_eq!(itemsize("<f4"), Ok(4));
        assert_eq!(itemsize("|u1"), Ok(1));
        assert_eq!(itemsize("<U3"), Ok(12));
        assert!(itemsize("|O").is_err());
    }
}
