"""Files written by the Hugging Face `datasets` package itself (`save_to_disk` shards and the cache file
`.map(...)` writes: Arrow IPC streams with `list<int32>` token columns) read through ubdirect: every
row's bytes equal what `datasets` reads back, for one column, two columns as one sample's parts, and
GPT windows across the rows. Skipped (with the reason) when `datasets` is not installed."""
import os

import numpy as np
import pytest

try:
    import datasets  # noqa: F401
except ImportError as e:  # not installed, or installed against a pyarrow it cannot import
    pytest.skip(f"the Hugging Face `datasets` package does not import: {e}", allow_module_level=True)

import ubdirect  # noqa: E402

ROWS = 300


def _write(tmp_path):
    """A tokenized-like dataset saved in 2 shards, and a `.map` adding `labels` (its cache file)."""
    from datasets import Dataset, Features, Sequence, Value, load_from_disk

    rng = np.random.default_rng(15)
    # Lengths 0..120 (empty rows included), ids up to 2^31 - 1 so every byte of an int32 matters.
    ids = [rng.integers(0, 2**31 - 1, size=int(rng.integers(0, 121))).astype(np.int32).tolist()
           for _ in range(ROWS)]
    ids[7] = None  # a null row: `datasets` writes it empty (offsets equal), delivered as 0 bytes
    feat = Features({"text": Value("string"), "input_ids": Sequence(Value("int32"))})
    ds = Dataset.from_dict({"text": [f"document {i}" for i in range(ROWS)], "input_ids": ids},
                           features=feat)
    saved = tmp_path / "saved"
    ds.save_to_disk(str(saved), num_shards=2)
    loaded = load_from_disk(str(saved))
    shards = [f["filename"] for f in loaded.cache_files]
    assert len(shards) == 2 and all(s.endswith(".arrow") for s in shards), shards
    mapped = loaded.map(
        lambda b: {"labels": [None if x is None else x[1:] + [-100] for x in b["input_ids"]]},
        batched=True, batch_size=32, writer_batch_size=40,  # several record batches in the stream
        features=Features({**feat, "labels": Sequence(Value("int32"))}),
    )
    cache = [f["filename"] for f in mapped.cache_files]
    assert len(cache) == 1 and os.path.basename(cache[0]).startswith("cache-"), cache
    for f in shards + cache:
        with open(f, "rb") as fh:
            assert fh.read(6) != b"ARROW1", f"{f}: datasets writes IPC streams, not files"
    return shards, cache[0], loaded, mapped


def _rows(ds, column):
    """What `datasets` reads back (its Arrow format, as stored): each row's int32 values as bytes."""
    import pyarrow as pa

    col = ds.with_format("arrow")[:][column].combine_chunks()
    assert col.type.value_type == pa.int32(), col.type
    return [col[i].values.to_numpy(zero_copy_only=False).astype("<i4", copy=False).tobytes()
            if col[i].is_valid else b"" for i in range(len(col))]


def _cfg(paths, batch, **dataset):
    return {
        "dataset": {"format": "arrow", "paths": paths, "generate": False, **dataset},
        "device": {"select": "host"},
        "loader": {"batch_size": batch, "seed": 3},
    }


def _check_once(seen, total, batch):
    assert len(seen) == len(set(seen)), "a row delivered twice"
    assert total - len(seen) < batch, f"{len(seen)} of {total} rows"


def test_save_to_disk_shards_and_map_cache_equal_datasets(tmp_path):
    shards, cache, loaded, mapped = _write(tmp_path)
    # One column across the two save_to_disk shards: sample ids are rows in shard order.
    want = _rows(loaded, "input_ids")
    assert want[7] == b"" and max(len(w) for w in want) == 120 * 4
    assert loaded[7]["input_ids"] is None
    seen = []
    for b in ubdirect.Loader(_cfg(shards, 16, column="input_ids")).epoch(0):
        for i, sid in enumerate(b.ids):
            assert b.sample_bytes(i) == want[int(sid)], f"row {int(sid)}"
            seen.append(int(sid))
    _check_once(seen, ROWS, 16)
    # The map's cache file, two columns of one row as one sample's parts.
    cols = ["input_ids", "labels"]
    want = {c: _rows(mapped, c) for c in cols}
    assert want["labels"] != want["input_ids"]
    seen = []
    for b in ubdirect.Loader(_cfg([cache], 8, columns=cols)).epoch(0):
        buf = np.from_dlpack(b)
        for i, sid in enumerate(b.ids):
            parts = b.parts(i)
            assert len(parts) == 2
            for (off, n), c in zip(parts, cols):
                assert buf[off:off + n].tobytes() == want[c][int(sid)], f"row {int(sid)} {c}"
            seen.append(int(sid))
    _check_once(seen, ROWS, 8)


def test_gpt_windows_across_datasets_rows(tmp_path):
    _, cache, _, mapped = _write(tmp_path)
    seq = 16
    stream = np.frombuffer(b"".join(_rows(mapped, "input_ids")), dtype=np.int32)
    windows = {stream[k * seq:k * seq + seq + 1].tobytes() for k in range((len(stream) - 1) // seq)}
    got = []
    for b in ubdirect.Loader(_cfg([cache], 8, column="input_ids", sequence_length=seq)).epoch(0):
        assert b.token_shape == (len(b.ids), seq + 1, "i32")
        a = np.from_dlpack(b)
        assert a.dtype == np.int32 and a.shape == (len(b.ids), seq + 1)
        got += [r.tobytes() for r in a]
    assert len(got) == len(set(got)), "a window twice"
    assert set(got) <= windows, "a delivered row is not a window of datasets' token stream"
    assert len(windows) - len(got) < 8
