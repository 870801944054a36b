//! `[dataset.tensors]`: Megatron-Core's `position_ids`, `loss_mask` and `attention_mask` made in each
//! GPT batch's block, through the whole loader, equal Megatron-Core 0.16.1's own (fixtures:
//! `tests/fixtures/gpt/make_masks.py`) for all 16 flag combinations, sample for sample in
//! Megatron's order — on the host, and on a GPU where one is usable (the block is read back); and
//! `cu_seqlens` splits every window where the index's sequences end.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use support::gpt::{fixture, npy};
use ubdirect_loader::gpt::Order;
use ubdirect_loader::gpt::masks::TensorsConfig;
use ubdirect_loader::{Loader, RunConfig};
use ubdirect_ub::DeviceSelection;

fn cfg(
    dataset: &str,
    seq: u32,
    extra: bool,
    t: TensorsConfig,
    select: DeviceSelection,
) -> RunConfig {
    let mut c = support::gpt::config(seq, 5, Order::Megatron, 4);
    c.dataset.paths = vec![fixture(dataset)];
    c.dataset.add_extra_token = extra;
    c.dataset.gpt_index_cache = false; // nothing written beside the fixtures
    c.dataset.tensors = Some(t);
    c.device.select = select;
    c
}

fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Every flag combination of one fixture case on one device: every delivered sample's tensors equal
/// Megatron-Core's row for its position in Megatron's order. Returns the samples checked.
fn check_case(name: &str, dataset: &str, seq: u32, extra: bool, select: DeviceSelection) -> usize {
    let (text, n, width) = {
        let (v, shape) = npy(&format!("{name}.text.npy"));
        (v, shape[0], shape[1])
    };
    let s = seq as usize;
    let mut checked = 0;
    for bits in 0..16u8 {
        let (rp, ra, em, ca) = (bits & 1 != 0, bits & 2 != 0, bits & 4 != 0, bits & 8 != 0);
        let t = TensorsConfig {
            eod: Some(2),
            reset_position_ids: rp,
            reset_attention_mask: ra,
            eod_mask_loss: em,
            create_attention_mask: ca,
        };
        let (want_pos, _) = npy(&format!("{name}.pos{}.npy", rp as u8));
        let (want_loss, _) = npy(&format!("{name}.loss{}.npy", em as u8));
        let (want_attn, ashape) = npy(&format!("{name}.attn{}.npy", ra as u8));
        let arow = ashape[1..].iter().product::<usize>();
        let l = Loader::from_config(&cfg(dataset, seq, extra, t, select)).unwrap();
        let mut delivered = 0;
        for b in l.epoch(0).unwrap() {
            let b = b.unwrap();
            let tk = b.tokens().unwrap();
            let bt = b
                .tensors()
                .expect("[dataset.tensors] batches carry tensors")
                .clone();
            let lay = &bt.layout;
            assert_eq!(
                (lay.rows, lay.seq_len, tk.cols),
                (b.len(), s, width),
                "{name}"
            );
            let pos = i64s(&b.block_to_vec(lay.position_ids, b.len() * s * 8).unwrap());
            let loss = f32s(&b.block_to_vec(lay.loss_mask, b.len() * s * 4).unwrap());
            let cu = i32s(
                &b.block_to_vec(lay.cu_seqlens, bt.cu_seqlens.len() * 4)
                    .unwrap(),
            );
            assert_eq!(
                cu, bt.cu_seqlens,
                "{name}: the block's cu_seqlens are the host's"
            );
            let attn = lay
                .attention_mask
                .map(|a| b.block_to_vec(a, b.len() * s * s).unwrap());
            assert_eq!(attn.is_some(), ca, "{name} bits {bits}");
            for (i, e) in b.samples().iter().enumerate() {
                let p = e.position as usize;
                assert!(p < n, "{name}: position {p} past Megatron's {n} samples");
                let row = &text[p * width..(p + 1) * width];
                let tok = b.sample_to_vec(i).unwrap();
                let got: Vec<i64> = tok
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as i64)
                    .collect();
                assert_eq!(got, row, "{name}: tokens of sample {p}");
                let ctx = format!("{name} {select:?} rp={rp} ra={ra} em={em} ca={ca} sample {p}");
                assert_eq!(
                    pos[i * s..(i + 1) * s],
                    want_pos[p * s..(p + 1) * s],
                    "position_ids {ctx}"
                );
                let wl: Vec<f32> = want_loss[p * s..(p + 1) * s]
                    .iter()
                    .map(|v| *v as f32)
                    .collect();
                assert_eq!(loss[i * s..(i + 1) * s], wl[..], "loss_mask {ctx}");
                if let Some(a) = &attn {
                    let rb = s.div_ceil(8);
                    for r in 0..s {
                        for c in 0..s {
                            let byte = want_attn[p * arow + r * rb + c / 8] as u8;
                            let want = byte & (0x80 >> (c % 8)) != 0;
                            assert_eq!(
                                a[i * s * s + r * s + c] != 0,
                                want,
                                "attention_mask {ctx} [{r}][{c}]"
                            );
                        }
                    }
                }
                // cu_seqlens: window i's segments cover its s input tokens, and (eoda: EOD only at
                // the end of sequences) every EOD inside the input ends a segment.
                let (lo, hi) = ((i * s) as i32, ((i + 1) * s) as i32);
                assert!(cu.contains(&lo) && cu.contains(&hi), "{ctx}: {cu:?}");
                if dataset == "eoda" {
                    for (j, &t) in row.iter().enumerate().take(s - 1) {
                        if t == 2 {
                            assert!(
                                cu.contains(&(lo + j as i32 + 1)),
                                "{ctx}: EOD at {j}, cu {cu:?}"
                            );
                        }
                    }
                }
            }
            assert!(cu.windows(2).all(|w| w[0] < w[1]), "{name}: {cu:?}");
            let max = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap();
            assert_eq!(max, bt.max_seqlen, "{name}");
            delivered += b.len();
            checked += b.len();
        }
        assert_eq!(
            delivered,
            n / 4 * 4,
            "{name}: every full batch of Megatron's samples"
        );
    }
    checked
}

fn check_device(select: DeviceSelection) {
    let mut checked = 0;
    for (name, dataset, seq, extra) in support::gpt::mask_cases() {
        checked += check_case(&name, &dataset, seq, extra, select);
    }
    assert!(checked > 1000, "{checked}");
}

#[test]
fn megatron_tensors_from_host_batches_equal_megatron_core_for_every_flag() {
    check_device(DeviceSelection::Host);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn megatron_tensors_from_cuda_batches_equal_megatron_core_for_every_flag() {
    check_device(DeviceSelection::Cuda);
}

#[test]
fn tensors_settings_are_checked() {
    let mut c = cfg(
        "eoda",
        24,
        true,
        TensorsConfig::default(),
        DeviceSelection::Host,
    );
    let e = Loader::from_config(&c).unwrap_err().to_string();
    assert!(e.contains("needs eod"), "{e}");
    c.dataset.sequence_length = 0;
    c.dataset.tensors = Some(TensorsConfig {
        eod: Some(2),
        ..Default::default()
    });
    let e = Loader::from_config(&c).unwrap_err().to_string();
    assert!(e.contains("needs GPT mode"), "{e}");
    // From TOML, keys named like Megatron's; an unknown key is refused.
    let t: RunConfig = toml::from_str(
        "[dataset]\nsequence_length = 8\n[dataset.tensors]\neod = 0\nreset_position_ids = true\ncreate_attention_mask = true\n",
    )
    .unwrap();
    let tc = t.dataset.tensors.unwrap();
    assert!(tc.reset_position_ids && tc.create_attention_mask && !tc.eod_mask_loss);
    assert!(
        toml::from_str::<RunConfig>("[dataset.tensors]\neod = 0\nreset_position = true\n").is_err()
    );
}
