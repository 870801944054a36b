"""Typed tensors of whole samples (issue 45): where the format knows the samples' type — raw's
dtype and record_len, the .npy header, an Arrow list column, Megatron's tokens — a batch is a
(batch, *shape) array of it, not bytes; numpy's view of a host batch is writable as torch's is."""
import numpy as np
import pytest

import ubdirect


def loader_of(d, fmt, shuffle, **dataset):
    return ubdirect.Loader({
        "dataset": {"format": fmt, "dir": str(d), **dataset},
        "device": {"select": "host"},
        "loader": {"batch_size": 32, "seed": 5, "shuffle": shuffle},
    })


@pytest.mark.parametrize("shuffle", [False, True])
def test_npy_batches_are_arrays_of_the_headers_dtype_and_shape(tmp_path, shuffle):
    src = np.random.default_rng(1).integers(-2**31, 2**31 - 1, size=(3000, 512), dtype=np.int32)
    np.save(tmp_path / "part-0.npy", src)
    loader = loader_of(tmp_path, "npy", shuffle)
    assert loader.sample_type == ("i32", [512])
    seen = 0
    for b in loader.epoch(0):
        x = b.numpy()
        assert x.dtype == np.int32 and x.shape == (len(b), 512)
        np.testing.assert_array_equal(x, src[b.ids.astype(np.int64)])
        if not shuffle:  # samples back to back, in order: a view of the batch's buffer
            assert np.shares_memory(x, np.from_dlpack(b))
        seen += len(b)
    assert seen == 3000 // 32 * 32


def test_raw_batches_follow_dtype_and_record_len(tmp_path):
    src = np.arange(600 * 100, dtype=np.uint16).reshape(600, 100)
    src.tofile(tmp_path / "shard-0.bin")
    loader = loader_of(tmp_path, "raw", True, dtype="u16", record_len=100)
    b = next(iter(loader.epoch(0)))
    x = b.numpy()
    assert x.shape == (32, 100) and x.dtype == np.uint16
    np.testing.assert_array_equal(x, src[b.ids.astype(np.int64)])


def test_host_batches_are_writable_in_numpy_as_in_torch(tmp_path):
    np.arange(600 * 100, dtype=np.uint16).tofile(tmp_path / "shard-0.bin")
    loader = loader_of(tmp_path, "raw", False, dtype="u16", record_len=100)
    b = next(iter(loader.epoch(0)))
    a = np.from_dlpack(b)
    assert a.flags.writeable
    a[0] = 7  # the batch's own memory; the file is untouched
    assert np.fromfile(tmp_path / "shard-0.bin", dtype=np.uint8)[0] == 0
    assert b.numpy().flags.writeable


def test_samples_without_a_type_say_why(tmp_path):
    import io
    import tarfile

    with tarfile.open(tmp_path / "shard-000000.tar", "w") as t:
        for i in range(64):
            data = bytes([i]) * 100
            info = tarfile.TarInfo(f"s{i:04}.bin")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    loader = loader_of(tmp_path, "webdataset", False, column="bin")
    assert loader.sample_type is None
    b = next(iter(loader.epoch(0)))
    with pytest.raises(TypeError, match="WebDataset samples"):
        b.numpy()


def test_torch_tensor_of_samples(tmp_path):
    torch = pytest.importorskip("torch")
    src = np.random.default_rng(2).standard_normal((1000, 64), dtype=np.float32)
    np.save(tmp_path / "x.npy", src)
    loader = loader_of(tmp_path, "npy", True)
    for b in loader.epoch(0):
        t = b.tensor()
        assert t.dtype == torch.float32 and tuple(t.shape) == (len(b), 64)
        np.testing.assert_array_equal(t.cpu().numpy(), src[b.ids.astype(np.int64)])
