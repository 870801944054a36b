"""PyTorch habits (issue 45): DataLoader workers, dict configs with paths and numpy values, a forked
loader, and what DataLoader does to the items."""
import os
import pathlib
import time

import numpy as np
import pytest

import ubdirect


@pytest.fixture
def torch():
    # PyPI's torch for x86-64 Linux needs CUDA's libraries (~3 GB); CI's machine has none, so these
    # run where torch is (the GPU machine: bench/peers/README.md), and skip here.
    return pytest.importorskip("torch")


def make_raw(tmp_path, n=640, record=256):
    d = tmp_path / "raw"
    d.mkdir()
    for s in range(4):
        ids = np.arange(s * (n // 4), (s + 1) * (n // 4), dtype=np.uint32)
        # Each record starts with its id, the rest is filler: a delivered record names itself.
        recs = np.zeros((n // 4, record // 4), dtype=np.uint32)
        recs[:, 0] = ids
        recs.tofile(d / f"shard-{s:05}.bin")
    return d


def config(d, batch=16):
    return {
        "dataset": {"format": "raw", "dir": d, "dtype": "u32", "record_len": np.int64(64)},
        "device": {"select": "host"},
        "loader": {"batch_size": np.int32(batch), "seed": 5},
    }


def ids_of(item):
    data, offs, lens = item
    a = np.asarray(data)
    return [int(a[int(o):int(o) + 4].view(np.uint32)[0]) for o in offs]


@pytest.mark.parametrize("workers", [2, 4])
def test_dataloader_workers_deliver_every_sample_once(tmp_path, workers, torch):
    d = make_raw(tmp_path)
    ds = ubdirect.IterableDataset(config(d))
    t0 = time.monotonic()
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, timeout=60)
    seen = []
    for item in dl:
        assert isinstance(item, ubdirect.HostBatch), type(item)
        assert item.offsets.dtype == torch.int64
        seen.extend(ids_of(item))
    assert time.monotonic() - t0 < 60
    assert sorted(seen) == list(range(640)), (len(seen), len(set(seen)))


def test_workers_with_spawn_pickle_the_dataset(tmp_path, torch):
    d = make_raw(tmp_path)
    ds = ubdirect.IterableDataset(config(d))
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, timeout=120,
                                     multiprocessing_context="spawn")
    seen = [i for item in dl for i in ids_of(item)]
    assert sorted(seen) == list(range(640))


def test_a_dataset_whose_length_was_asked_still_works_in_workers(tmp_path, torch):
    # len() makes a loader in the parent; the forked workers make their own and never touch it.
    d = make_raw(tmp_path)
    ds = ubdirect.IterableDataset(config(d))
    assert len(ds) == 640 // 16
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, timeout=60)
    assert sorted(i for item in dl for i in ids_of(item)) == list(range(640))


def test_a_forked_loader_fails_at_once_naming_the_fix(tmp_path):
    d = make_raw(tmp_path)
    loader = ubdirect.Loader(config(d))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        t0 = time.monotonic()
        try:
            loader.epoch(0)
            msg = "no error"
        except RuntimeError as e:
            msg = f"{time.monotonic() - t0:.3f} {e}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    secs, _, text = msg.partition(" ")
    assert "IterableDataset" in text and "num_workers=0" in text, msg
    assert float(secs) < 1.0, msg


def test_dict_configs_take_paths_and_numpy_values(tmp_path):
    d = make_raw(tmp_path)
    cfg = config(pathlib.Path(d))
    cfg["loader"]["seed"] = np.uint64(5)
    loader = ubdirect.Loader(cfg, rank=np.int64(0), world_size=np.int64(1))
    assert len(loader) == 640 // 16
    with pytest.raises(TypeError, match="object"):
        ubdirect.Loader({"dataset": {"dir": object()}})


def test_an_epoch_can_be_a_list_of_its_batches_where_the_pools_hold_it(tmp_path):
    d = make_raw(tmp_path, n=128)
    loader = ubdirect.Loader(config(d))
    batches = list(loader.epoch(0))
    assert len(batches) == 128 // 16
    assert sorted(i for b in batches for i in ids_of((np.from_dlpack(b), b.offsets, b.lengths))) == list(range(128))
