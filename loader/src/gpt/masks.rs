//! What a training step needs beside the tokens of a GPT window: Megatron-Core's `position_ids`,
//! `loss_mask` and `attention_mask` exactly as `GPTDataset.__getitem__` (0.16) makes them, and the
//! document boundaries of a batch as `cu_seqlens` (FlashAttention varlen / Transformer Engine THD).
//!
//! Megatron's tensors follow the **EOD token** in the window (`tokenizer.eod`):
//! - `position_ids[j]` = `j`, or with `reset_position_ids` the distance from the token after the
//!   last EOD before `j`;
//! - `loss_mask[j]` = 1, 0 where the token is EOD with `eod_mask_loss`, and 0 where the label is the
//!   pad id (-1: the last label of a window made without the extra token);
//! - `attention_mask[r][c]` (true = masked) = `c > r`, and with `reset_attention_mask` also
//!   `c` before the token after the last EOD before `r`.
//!
//! `cu_seqlens` follows the **index**: the windows split where one sequence of the `.idx` ends and
//! the next begins (Megatron's GPT "documents" are the index's sequences), whatever tokens they hold.
//! With datasets written by `preprocess_data.py --append-eod` both views agree.
//!
//! Checked element for element against Megatron-Core itself (`loader/tests/gpt_masks.rs`, fixtures
//! made by `tests/fixtures/gpt/make_masks.py`).

use crate::formats::Dtype;

/// Megatron's pad id for labels past the window (`_PAD_TOKEN_ID`).
pub const PAD_TOKEN_ID: i64 = -1;

/// The flags of Megatron's `GPTDatasetConfig` that shape the tensors (keys named like Megatron's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MaskConfig {
    /// `tokenizer.eod`: the end-of-document token.
    pub eod: i64,
    /// Positions restart after every EOD.
    pub reset_position_ids: bool,
    /// Tokens attend only within their EOD-delimited segment.
    pub reset_attention_mask: bool,
    /// No loss on EOD tokens.
    pub eod_mask_loss: bool,
    /// Windows hold `sequence_length + 1` tokens (labels are the window shifted by one); without,
    /// `sequence_length` tokens and the last label is the pad id.
    pub add_extra_token: bool,
}

impl MaskConfig {
    /// Tokens of a window of `width` elements that the model sees (`sequence_length`).
    pub fn seq_len(&self, width: usize) -> usize {
        if self.add_extra_token {
            width.saturating_sub(1)
        } else {
            width
        }
    }
}

/// Element `i` of a row of `dtype` values as i64 (`None` past the row, or for float types).
pub fn token_at(row: &[u8], dtype: Dtype, i: usize) -> Option<i64> {
    let es = dtype.size();
    let b = row.get(i * es..(i + 1) * es)?;
    Some(match dtype {
        Dtype::U8 => b[0] as i64,
        Dtype::I8 => b[0] as i8 as i64,
        Dtype::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
        Dtype::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
        Dtype::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
        Dtype::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
        Dtype::U64 | Dtype::I64 => {
            i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
        }
        Dtype::F16 | Dtype::Bf16 | Dtype::F32 | Dtype::F64 => return None,
    })
}

/// Megatron's `position_ids` and `loss_mask` for one window (`text`: the window's tokens as
/// `GPTDataset` reads them, `sequence_length (+ 1)` of them), written into `pos` and `loss`
/// (`seq_len` elements each). One pass, no allocation.
pub fn positions_and_loss(text: &[i64], cfg: &MaskConfig, pos: &mut [i64], loss: &mut [f32]) {
    let s = cfg.seq_len(text.len()).min(pos.len()).min(loss.len());
    let mut start = 0usize;
    for j in 0..s {
        let t = text[j];
        pos[j] = if cfg.reset_position_ids {
            (j - start) as i64
        } else {
            j as i64
        };
        // Labels are the window shifted by one; without the extra token the last one is the pad id.
        let label = if cfg.add_extra_token || j + 1 < s {
            text[j + 1]
        } else {
            PAD_TOKEN_ID
        };
        loss[j] = if (cfg.eod_mask_loss && t == cfg.eod) || label == PAD_TOKEN_ID {
            0.0
        } else {
            1.0
        };
        if t == cfg.eod {
            start = j + 1;
        }
    }
}

/// Megatron's `attention_mask` for one window (1 = masked, 0 = attended: the bytes of a bool
/// tensor), `seq_len × seq_len` row after row into `out`.
pub fn attention_mask(text: &[i64], cfg: &MaskConfig, out: &mut [u8]) {
    let s = cfg.seq_len(text.len());
    let mut start = 0usize; // first column row `r` may see
    for (r, &t) in text.iter().take(s).enumerate() {
        let Some(row) = out.get_mut(r * s..(r + 1) * s) else {
            return;
        };
        let lo = if cfg.reset_attention_mask { start } else { 0 };
        for (c, m) in row.iter_mut().enumerate() {
            *m = (c > r || c < lo) as u8;
        }
        if t == cfg.eod {
            start = r + 1;
        }
    }
}

/// `cu_seqlens` (int32, THD layout) and `max_seqlen` of a batch of windows flattened one after the
/// other: `pieces[b]` are window `b`'s pieces' token counts in order (each piece one sequence of the
/// index), of which the first `seq_len` tokens are the window's input. Segments end where a piece
/// ends inside the input and at every window's end; empty pieces add nothing.
pub fn cu_seqlens<'a>(
    pieces: impl IntoIterator<Item = &'a [u32]>,
    seq_len: usize,
) -> (Vec<i32>, i32) {
    let mut cu = vec![0i32];
    let mut max = 0i32;
    let mut base = 0usize;
    for window in pieces {
        let mut at = 0usize;
        for &p in window {
            if at >= seq_len {
                break;
            }
            let end = (at + p as usize).min(seq_len);
            if end > at {
                cu.push((base + end) as i32);
                max = max.max((end - at) as i32);
            }
            at = end;
        }
        if at < seq_len {
            // Pieces shorter than the window (not made by the planner): the rest is one segment.
            cu.push((base + seq_len) as i32);
            max = max.max((seq_len - at) as i32);
        }
        base += seq_len;
    }
    (cu, max)
}

/// `[dataset.tensors]`: Megatron-Core's per-sample tensors made with every GPT batch
/// (`position_ids`, `loss_mask`, `cu_seqlens`, and `attention_mask` when asked), keys named like
/// Megatron's `GPTDatasetConfig`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TensorsConfig {
    /// `tokenizer.eod`: the end-of-document token (required).
    pub eod: Option<i64>,
    /// Positions restart after every EOD.
    pub reset_position_ids: bool,
    /// Tokens attend only within their EOD-delimited segment.
    pub reset_attention_mask: bool,
    /// No loss on EOD tokens.
    pub eod_mask_loss: bool,
    /// Also the `(batch, 1, seq, seq)` bool attention mask (Megatron's `create_attention_mask`).
    pub create_attention_mask: bool,
}

/// `[dataset.tensors]` resolved for a run: what each GPT batch carries beside its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorSpec {
    /// Megatron's flags and EOD token.
    pub mask: MaskConfig,
    /// `create_attention_mask`: also the `(batch, 1, seq_len, seq_len)` bool mask.
    pub attention: bool,
    /// Tokens per row of the batch (`sequence_length (+ 1)`).
    pub width: usize,
    /// The token type.
    pub dtype: Dtype,
}

/// Where a batch's tensors sit in its block (byte offsets from the block's start), made in the
/// pack block right after the batch's tokens: every batch's tensors travel with its tokens in the
/// one host-to-device copy of the chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLayout {
    /// Rows (samples).
    pub rows: usize,
    /// `sequence_length`: columns of each per-sample tensor.
    pub seq_len: usize,
    /// `position_ids`: int64 `(rows, seq_len)`.
    pub position_ids: usize,
    /// `loss_mask`: float32 `(rows, seq_len)`.
    pub loss_mask: usize,
    /// `cu_seqlens`: int32, `cu_len` of them (room for `rows × seq_len + 1`).
    pub cu_seqlens: usize,
    /// `attention_mask`: bool `(rows, 1, seq_len, seq_len)`, with `create_attention_mask`.
    pub attention_mask: Option<usize>,
}

/// A batch's tensors once made: where they are, and the `cu_seqlens` the host computed (also kept
/// here: FlashAttention's varlen call takes `max_seqlen` as a host integer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchTensors {
    /// Where each tensor is in the batch's block.
    pub layout: TensorLayout,
    /// `cu_seqlens` (as in the block).
    pub cu_seqlens: Vec<i32>,
    /// The longest segment.
    pub max_seqlen: i32,
}

const fn align64(x: usize) -> usize {
    x.div_ceil(64) * 64
}

impl TensorSpec {
    /// `sequence_length`.
    pub fn seq_len(&self) -> usize {
        self.mask.seq_len(self.width)
    }

    /// The layout of a batch of `rows` whose tokens start at `at` in the block; and where the
    /// batch's bytes end.
    pub fn layout(&self, at: usize, rows: usize) -> (TensorLayout, usize) {
        let s = self.seq_len();
        let tokens = rows * self.width * self.dtype.size();
        let position_ids = align64(at + tokens);
        let loss_mask = align64(position_ids + rows * s * 8);
        let cu_seqlens = align64(loss_mask + rows * s * 4);
        let mut end = cu_seqlens + (rows * s + 1) * 4;
        let attention_mask = self.attention.then(|| {
            let a = align64(end);
            end = a + rows * s * s;
            a
        });
        (
            TensorLayout {
                rows,
                seq_len: s,
                position_ids,
                loss_mask,
                cu_seqlens,
                attention_mask,
            },
            end,
        )
    }

    /// Makes a batch's tensors in `block` (which holds its tokens): row `i`'s tokens at
    /// `rows_at[i]`, its pieces' token counts (documents of the index, in order) given by
    /// `pieces(i, &mut out)`. Host work only: the tokens are read where the pack copy put them.
    pub fn fill(
        &self,
        block: &mut [u8],
        layout: TensorLayout,
        rows_at: &[usize],
        mut pieces: impl FnMut(usize, &mut Vec<u32>),
    ) -> Result<BatchTensors, TensorError> {
        let (s, es) = (layout.seq_len, self.dtype.size());
        let row_bytes = self.width * es;
        let mut text = vec![0i64; self.width];
        let (mut pos, mut loss) = (vec![0i64; s], vec![0f32; s]);
        let mut attn = vec![0u8; if self.attention { s * s } else { 0 }];
        let mut window_pieces: Vec<Vec<u32>> = Vec::with_capacity(rows_at.len());
        for (i, &at) in rows_at.iter().enumerate() {
            let row = block.get(at..at + row_bytes).ok_or(TensorError::Block {
                at,
                len: row_bytes,
                block: block.len(),
            })?;
            for (j, t) in text.iter_mut().enumerate() {
                *t = token_at(row, self.dtype, j).ok_or(TensorError::Dtype(self.dtype))?;
            }
            positions_and_loss(&text, &self.mask, &mut pos, &mut loss);
            put(
                block,
                layout.position_ids + i * s * 8,
                pos.iter().map(|v| v.to_le_bytes()),
            )?;
            put(
                block,
                layout.loss_mask + i * s * 4,
                loss.iter().map(|v| v.to_le_bytes()),
            )?;
            if let Some(a) = layout.attention_mask {
                attention_mask(&text, &self.mask, &mut attn);
                put(block, a + i * s * s, attn.iter().map(|v| [*v]))?;
            }
            let mut w = Vec::new();
            pieces(i, &mut w);
            window_pieces.push(w);
        }
        let (cu, max_seqlen) = cu_seqlens(window_pieces.iter().map(|w| &w[..]), s);
        put(block, layout.cu_seqlens, cu.iter().map(|v| v.to_le_bytes()))?;
        Ok(BatchTensors {
            layout,
            cu_seqlens: cu,
            max_seqlen,
        })
    }
}

/// Writes `items` (each `N` bytes) back to back from `at`.
fn put<const N: usize>(
    block: &mut [u8],
    at: usize,
    items: impl ExactSizeIterator<Item = [u8; N]>,
) -> Result<(), TensorError> {
    let len = items.len() * N;
    let size = block.len();
    let dst = block.get_mut(at..at + len).ok_or(TensorError::Block {
        at,
        len,
        block: size,
    })?;
    for (d, v) in dst.chunks_exact_mut(N).zip(items) {
        d.copy_from_slice(&v);
    }
    Ok(())
}

/// Why a batch's tensors could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// The layout runs past the block (a plan and a block that disagree).
    #[error("GPT tensors: {len} bytes at {at} run past the batch block of {block}")]
    Block {
        /// Offset.
        at: usize,
        /// Bytes.
        len: usize,
        /// The block's size.
        block: usize,
    },
    /// Tokens of a float type have no EOD to find.
    #[error("GPT tensors need integer tokens, not {0:?}")]
    Dtype(Dtype),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cu_seqlens_split_at_piece_ends_inside_the_input() {
        // Two windows of 8 input tokens (+1 extra): pieces 3,4,2 and 9.
        let w: [&[u32]; 2] = [&[3, 4, 2], &[9]];
        let (cu, max) = cu_seqlens(w, 8);
        assert_eq!(cu, vec![0, 3, 7, 8, 16]);
        assert_eq!(max, 8);
        let (cu, max) = cu_seqlens([&[0u32, 8, 1][..]], 8);
        assert_eq!((cu, max), (vec![0, 8], 8));
    }

    #[test]
    fn token_at_reads_each_integer_type_and_refuses_floats() {
        assert_eq!(token_at(&[0xff, 0xff], Dtype::U16, 0), Some(65535));
        assert_eq!(token_at(&[0xff, 0xff], Dtype::I16, 0), Some(-1));
        assert_eq!(token_at(&[1, 0, 0, 0, 2, 0, 0, 0], Dtype::I32, 1), Some(2));
        assert_eq!(token_at(&[1, 0], Dtype::I32, 0), None);
        assert_eq!(token_at(&[0; 4], Dtype::F32, 0), None);
    }
}
