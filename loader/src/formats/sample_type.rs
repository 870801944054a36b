//! What one sample is, where the format says so (since 2026-12-07): its element type and shape, so
//! that a batch of whole samples can be handed over as a typed `(batch, *shape)` tensor rather than
//! bytes. Read once at open, from the config (raw) or the first shard's header (npy, Arrow,
//! Megatron); every batch's samples are checked against it when a tensor is made of them.

use std::path::Path;

use super::{Dtype, Format, Opener};
use crate::formats::index::DatasetIndex;

/// A sample's element type and shape.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SampleType {
    /// Element type.
    pub dtype: Dtype,
    /// Shape of one sample; `None`: one dimension, as long as the sample (Megatron documents,
    /// Arrow lists of any length).
    pub shape: Option<Vec<u64>>,
}

impl SampleType {
    /// Bytes of one sample where the shape is fixed.
    pub fn sample_bytes(&self) -> Option<u64> {
        let s = self.shape.as_ref()?;
        s.iter()
            .try_fold(self.dtype.size() as u64, |a, &d| a.checked_mul(d))
    }
}

/// The samples' type of a dataset of `format` (`dtype` and `record_len`: the raw keys; `column`:
/// Arrow's), or why there is none (the text a `tensor()` call raises).
pub fn sample_type(
    format: Format,
    dtype: Dtype,
    record_len: u64,
    column: &str,
    index: &DatasetIndex,
    opener: &dyn Opener,
) -> Result<SampleType, String> {
    let first = index.shards.first().map(|s| s.path.as_path());
    match format {
        Format::Raw => Ok(SampleType {
            dtype,
            shape: Some(vec![record_len]),
        }),
        Format::WebDataset => Err(
            "WebDataset samples are files whose type only their extension names: decode sample_bytes(i), or read them as bytes (torch.from_dlpack(batch))".into(),
        ),
        Format::Npy => npy(first.ok_or("no shards")?, opener),
        Format::Arrow => arrow(first.ok_or("no shards")?, column, opener),
        Format::Megatron => {
            let mapped = index.samples.megatron_files().and_then(|f| f.first());
            let t = match mapped {
                Some(m) => m.dtype(),
                None => super::megatron::megatron_dtype(first.ok_or("no shards")?)
                    .map_err(|e| e.to_string())?,
            };
            Ok(SampleType {
                dtype: t,
                shape: None,
            })
        }
    }
}

/// An `.npy` shard's element type (`<`, `|` or `=` byte order: this machine's) and the shape of a
/// slice along its first axis.
fn npy(path: &Path, opener: &dyn Opener) -> Result<SampleType, String> {
    let mut f = opener.open(path).map_err(|e| e.to_string())?;
    let h = super::npy::read_header_from(&mut f, path).map_err(|e| e.to_string())?;
    let code = h.descr.trim_start_matches(['<', '|', '=', '>']);
    if h.descr.starts_with('>') && !code.ends_with('1') {
        return Err(format!(
            "{}: dtype {:?} is big-endian: no typed tensor",
            path.display(),
            h.descr
        ));
    }
    let dtype = match code {
        "u1" => Dtype::U8,
        "i1" => Dtype::I8,
        "u2" => Dtype::U16,
        "i2" => Dtype::I16,
        "u4" => Dtype::U32,
        "i4" => Dtype::I32,
        "u8" => Dtype::U64,
        "i8" => Dtype::I64,
        "f2" => Dtype::F16,
        "f4" => Dtype::F32,
        "f8" => Dtype::F64,
        other => {
            return Err(format!(
                "{}: dtype {other:?} has no tensor type here (integers and floats do)",
                path.display()
            ));
        }
    };
    Ok(SampleType {
        dtype,
        shape: Some(h.shape[1..].to_vec()),
    })
}

/// An Arrow shard's column of lists: their element type, and the list size where it is fixed.
fn arrow(path: &Path, column: &str, opener: &dyn Opener) -> Result<SampleType, String> {
    let mut f = opener.open(path).map_err(|e| e.to_string())?;
    let size = f.size();
    match super::arrow::column_element_in(&mut f, path, size, column).map_err(|e| e.to_string())? {
        Some((dtype, fixed)) => Ok(SampleType {
            dtype,
            shape: fixed.map(|n| vec![n]),
        }),
        None => Err(format!(
            "{}: column {column:?} is not a list of integers or floats: no typed tensor",
            path.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_shape_has_bytes_and_a_free_one_has_none() {
        let t = SampleType {
            dtype: Dtype::I32,
            shape: Some(vec![4, 8]),
        };
        assert_eq!(t.sample_bytes(), Some(128));
        let t = SampleType {
            dtype: Dtype::U16,
            shape: None,
        };
        assert_eq!(t.sample_bytes(), None);
        let t = SampleType {
            dtype: Dtype::U8,
            shape: Some(vec![u64::MAX, 2]),
        };
        assert_eq!(t.sample_bytes(), None);
    }
}
