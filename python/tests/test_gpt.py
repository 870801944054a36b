"""GPT mode from Python: batches are (batch, sequence_length + 1) token arrays through DLPack, equal to
the samples Megatron-Core's GPTDataset makes (fixtures made by Megatron-Core itself)."""
import os

import numpy as np

import ubdirect

FX = os.path.join(os.path.dirname(__file__), "..", "..", "loader", "tests", "fixtures", "gpt")


def test_gpt_batches_are_token_arrays_equal_to_megatron():
    cfg = {
        "dataset": {"format": "megatron", "paths": [os.path.join(FX, "u16a")], "generate": False,
                    "sequence_length": 32},
        "device": {"select": "host"},
        "loader": {"batch_size": 8, "seed": 1234, "order": "megatron"},
    }
    want = np.load(os.path.join(FX, "one_epoch_s1234_n32.tokens.npy"))
    n = 0
    for k, b in enumerate(ubdirect.Loader(cfg).epoch(0)):
        a = np.from_dlpack(b)
        assert a.shape == (8, 33) and a.dtype == np.uint16
        assert b.token_shape == (8, 33, "u16")
        assert (a.astype(np.int64) == want[k * 8:(k + 1) * 8]).all(), f"batch {k}"
        n += 1
    assert n == len(want) // 8


def test_several_columns_are_one_samples_parts():
    import json

    fx = os.path.join(os.path.dirname(__file__), "..", "..", "loader", "tests", "fixtures", "arrow")
    want = json.load(open(os.path.join(fx, "expected.json")))["files"]["stream.arrow"]
    cols = ["input_ids", "labels"]
    cfg = {
        "dataset": {"format": "arrow", "paths": [os.path.join(fx, "stream.arrow")], "generate": False,
                    "columns": cols},
        "device": {"select": "host"},
        "loader": {"batch_size": 3},
    }
    n = 0
    for b in ubdirect.Loader(cfg).epoch(0):
        buf = np.from_dlpack(b)
        for i, sid in enumerate(b.ids):
            parts = b.parts(i)
            assert len(parts) == 2
            for (off, ln), c in zip(parts, cols):
                assert off % 8 == 0
                assert buf[off:off + ln].tobytes().hex() == want[c][int(sid)]
            n += 1
    assert n == 12


def test_summary_explains_num_samples_and_the_index_cache(tmp_path):
    import shutil

    for ext in ("bin", "idx"):
        shutil.copy(os.path.join(FX, f"u16a.{ext}"), tmp_path / f"u16a.{ext}")
    cfg = {
        "dataset": {"format": "megatron", "paths": [str(tmp_path / "u16a")], "generate": False,
                    "sequence_length": 32, "num_samples": 100},
        "device": {"select": "host"},
        "loader": {"batch_size": 8, "seed": 1234, "order": "megatron"},
    }
    g = ubdirect.Loader(cfg).summary()["gpt"]
    assert g["num_samples"] == 100 and g["samples"] > 100, g
    assert g["document_epochs"] == [1] and g["index_cache"] == ["stored"], g
    assert "whole epochs" in g["num_samples_note"] and str(g["samples"]) in g["num_samples_note"], g
    # The next start maps the stored indices.
    assert ubdirect.Loader(cfg).summary()["gpt"]["index_cache"] == ["hit"]
    cfg["dataset"]["num_samples"] = 0
    g = ubdirect.Loader(cfg).summary()["gpt"]
    assert g.get("num_samples_note") is None, g


def test_provenance_of_a_blend_names_megatrons_dataset_for_every_sample():
    cfg = {
        "dataset": {"format": "megatron", "generate": False, "sequence_length": 24, "num_samples": 400,
                    "blend": [{"paths": [os.path.join(FX, "u16a")], "weight": 0.3},
                              {"paths": [os.path.join(FX, "u16b")], "weight": 0.7}]},
        "device": {"select": "host"},
        "loader": {"batch_size": 10, "seed": 99, "order": "megatron"},
    }
    want = np.load(os.path.join(FX, "blend_s99_n24.dataset_index.npy"))
    got = []
    for b in ubdirect.Loader(cfg).epoch(0):
        p = b.provenance()
        assert sorted(p) == sorted(["sample", "dataset", "window", "document", "token_offset", "documents",
                                    "length", "shard", "shard_offset"])
        assert all(len(v) == len(b) and v.dtype == np.uint64 for v in p.values())
        assert (p["sample"] == b.ids).all()
        assert (p["length"] == 25).all() and (p["documents"] >= 1).all()
        got.extend(p["dataset"].tolist())
    assert got == want.tolist()


def test_record_then_replay_a_step_at_another_world_size(tmp_path):
    def cfg(rank, world, batch):
        return ubdirect.Loader({
            "dataset": {"format": "megatron", "paths": [os.path.join(FX, "u16a")], "generate": False,
                        "sequence_length": 32},
            "device": {"select": "host"},
            "loader": {"batch_size": batch, "seed": 1234, "order": "megatron"},
        }, rank=rank, world_size=world)

    rec_path = tmp_path / "steps.arrow"
    steps = {}
    for rank in range(2):
        loader = cfg(rank, 2, 4)
        with loader.recorder(rec_path) as rec:
            for b in loader.epoch(0):
                rec.record(b)
                rows = np.from_dlpack(b)
                for i, pos in enumerate(b.positions):
                    steps.setdefault(b.index, {})[int(pos)] = rows[i].copy()
    assert (tmp_path / "steps.arrow.rank0").exists() and (tmp_path / "steps.arrow.rank1").exists()
    want = [steps[3][p] for p in sorted(steps[3])]
    assert len(want) == 8
    for world in (1, 4):
        got = []
        for rank in range(world):
            for b in cfg(rank, world, 2).replay(rec_path, 3):
                got.extend(r.copy() for r in np.from_dlpack(b))
        assert len(got) == 8 and all((g == w).all() for g, w in zip(got, want)), world


def test_megatron_tensors_equal_megatron_core_for_every_flag():
    """``[dataset.tensors]``: position_ids, loss_mask and attention_mask by DLPack equal Megatron-Core
    0.16.1's for each sample of its order (fixtures: make_masks.py), and cu_seqlens covers each window."""
    import itertools

    seq, name = 24, "masks_eoda_s24_x"
    text = np.load(os.path.join(FX, f"{name}.text.npy"))
    checked = 0
    for rp, ra, em, ca in itertools.product([False, True], repeat=4):
        cfg = {
            "dataset": {"format": "megatron", "paths": [os.path.join(FX, "eoda")], "generate": False,
                        "sequence_length": seq, "gpt_index_cache": False,
                        "tensors": {"eod": 2, "reset_position_ids": rp, "reset_attention_mask": ra,
                                    "eod_mask_loss": em, "create_attention_mask": ca}},
            "device": {"select": "host"},
            "loader": {"batch_size": 4, "seed": 5, "order": "megatron"},
        }
        pos_w = np.load(os.path.join(FX, f"{name}.pos{int(rp)}.npy"))
        loss_w = np.load(os.path.join(FX, f"{name}.loss{int(em)}.npy"))
        attn_w = np.unpackbits(np.load(os.path.join(FX, f"{name}.attn{int(ra)}.npy")), axis=-1)[:, :, :seq]
        for b in ubdirect.Loader(cfg).epoch(0):
            at = b.positions
            toks = np.from_dlpack(b).astype(np.int64)
            assert (toks == text[at]).all()
            pos = np.from_dlpack(b.position_ids)
            loss = np.from_dlpack(b.loss_mask)
            assert pos.dtype == np.int64 and pos.shape == (4, seq)
            assert loss.dtype == np.float32 and loss.shape == (4, seq)
            assert (pos == pos_w[at]).all() and (loss == loss_w[at]).all()
            if ca:
                attn = np.from_dlpack(b.attention_mask)
                assert attn.dtype == np.bool_ and attn.shape == (4, 1, seq, seq)
                assert (attn[:, 0] == attn_w[at].astype(bool)).all()
            else:
                assert b.attention_mask is None
            cu = np.from_dlpack(b.cu_seqlens)
            assert cu.dtype == np.int32 and (cu == b.cu_seqlens_host).all()
            assert cu[0] == 0 and cu[-1] == 4 * seq and (np.diff(cu) > 0).all()
            assert b.max_seqlen == int(np.diff(cu).max())
            checked += len(b)
    assert checked == 16 * (len(text) // 4 * 4)
