//! Megatron-Core's per-sample tensors (`position_ids`, `loss_mask`, `attention_mask`) made by
//! `ubdirect_loader::gpt::masks` equal Megatron-Core 0.16.1's own, element for element, for every
//! flag combination (fixtures: `tests/fixtures/gpt/make_masks.py`; each tensor depends on one flag,
//! which the script checks over all 16 combinations).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use support::gpt::npy;
use ubdirect_loader::gpt::masks::{MaskConfig, attention_mask, positions_and_loss};

fn configs() -> Vec<(String, bool)> {
    support::gpt::mask_cases()
        .into_iter()
        .map(|(name, _, _, extra)| (name, extra))
        .collect()
}

fn rows(name: &str) -> (Vec<i64>, usize, usize) {
    let (v, shape) = npy(name);
    (v, shape[0], shape[1..].iter().product())
}

#[test]
fn position_ids_and_loss_mask_equal_megatron_core_for_every_flag() {
    let cfgs = configs();
    assert_eq!(cfgs.len(), 3);
    for (name, extra) in cfgs {
        let (text, n, width) = rows(&format!("{name}.text.npy"));
        for (rp, em) in [(false, false), (false, true), (true, false), (true, true)] {
            let cfg = MaskConfig {
                eod: 2,
                reset_position_ids: rp,
                reset_attention_mask: false,
                eod_mask_loss: em,
                add_extra_token: extra,
            };
            let s = cfg.seq_len(width);
            let (want_pos, pn, pw) = rows(&format!("{name}.pos{}.npy", rp as u8));
            let (want_loss, ln, lw) = rows(&format!("{name}.loss{}.npy", em as u8));
            assert_eq!((pn, pw, ln, lw), (n, s, n, s), "{name}");
            let (mut pos, mut loss) = (vec![0i64; s], vec![0f32; s]);
            let mut resets = 0;
            for i in 0..n {
                let t = &text[i * width..(i + 1) * width];
                positions_and_loss(t, &cfg, &mut pos, &mut loss);
                assert_eq!(
                    pos,
                    want_pos[i * s..(i + 1) * s],
                    "{name} rp={rp} sample {i}"
                );
                let want: Vec<f32> = want_loss[i * s..(i + 1) * s]
                    .iter()
                    .map(|v| *v as f32)
                    .collect();
                assert_eq!(loss, want, "{name} em={em} sample {i}");
                resets += pos.iter().skip(1).filter(|p| **p == 0).count();
            }
            // The fixtures exercise what they claim: EODs inside windows reset positions.
            assert_eq!(resets > 0, rp, "{name} rp={rp}: {resets} resets");
        }
    }
}

#[test]
fn attention_mask_equals_megatron_core_with_and_without_reset() {
    for (name, extra) in configs() {
        let (text, n, width) = rows(&format!("{name}.text.npy"));
        for ra in [false, true] {
            let cfg = MaskConfig {
                eod: 2,
                reset_position_ids: false,
                reset_attention_mask: ra,
                eod_mask_loss: false,
                add_extra_token: extra,
            };
            let s = cfg.seq_len(width);
            let (packed, pn, pw) = rows(&format!("{name}.attn{}.npy", ra as u8));
            let row_bytes = s.div_ceil(8);
            assert_eq!((pn, pw), (n, s * row_bytes), "{name}");
            let mut got = vec![0u8; s * s];
            let mut below_diagonal_masked = 0;
            for i in 0..n {
                let t = &text[i * width..(i + 1) * width];
                attention_mask(t, &cfg, &mut got);
                for r in 0..s {
                    for c in 0..s {
                        let byte = packed[i * pw + r * row_bytes + c / 8] as u8;
                        let want = byte & (0x80 >> (c % 8)) != 0;
                        assert_eq!(
                            got[r * s + c] != 0,
                            want,
                            "{name} ra={ra} sample {i} [{r}][{c}]"
                        );
                        if want && c < r {
                            below_diagonal_masked += 1;
                        }
                    }
                }
            }
            assert_eq!(below_diagonal_masked > 0, ra, "{name} ra={ra}");
        }
    }
}
