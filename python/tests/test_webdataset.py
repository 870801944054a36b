"""WebDataset `.tar` shards written by Python's `tarfile` (ustar, GNU and pax formats: long names,
non-ASCII names, multi-dot and upper-case extensions, directories, symlinks and `__meta__` members
between samples) read through ubdirect: every sample's parts byte-equal to what the `webdataset`
package's own iteration yields, in the same order (shuffle off). Skipped (with the reason) when
`webdataset` is not installed; `.ci/run` installs it."""
import io
import tarfile

import numpy as np
import pytest

try:
    import webdataset as wds
except ImportError as e:
    pytest.skip(f"the `webdataset` package does not import: {e}", allow_module_level=True)

import ubdirect  # noqa: E402

FORMATS = [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]


def _member(t, name, data=None, kind=tarfile.REGTYPE):
    ti = tarfile.TarInfo(name)
    ti.type = kind
    if kind == tarfile.SYMTYPE:
        ti.linkname = "elsewhere"
    ti.size = len(data) if data is not None else 0
    t.addfile(ti, io.BytesIO(data) if data is not None else None)


def _key(s, i, fmt):
    if i % 9 == 4 and fmt != tarfile.USTAR_FORMAT:
        return f"{'deep/' * 30}s{s}-{i:05}"  # a long name: GNU `L` or pax `path`
    if i % 9 == 7 and fmt == tarfile.PAX_FORMAT:
        return f"données/ß{s}-{i:05}"  # non-ASCII: a pax `path`
    if i % 9 == 2:
        return f"sub.dir/s{s}-{i:05}"  # a dot in a directory is not the extension's
    return f"s{s}-{i:05}"


def _write(path, s, n, fmt, rng):
    with tarfile.open(path, "w", format=fmt) as t:
        _member(t, "__meta__", b"metadata: skipped by webdataset")
        for i in range(n):
            k = _key(s, i, fmt)
            if i % 11 == 5:
                _member(t, f"dir-{s}-{i}", kind=tarfile.DIRTYPE)
                _member(t, f"link-{s}-{i}.jpg", kind=tarfile.SYMTYPE)
            jpg = rng.integers(0, 256, size=int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()
            ext = "JPG" if i % 13 == 6 else "jpg"  # lowercased by webdataset
            _member(t, f"{k}.{ext}", jpg)
            _member(t, f"{k}.cls", str(i % 10).encode())
            if i % 4 == 1:
                _member(t, f"{k}.seg.png", b"\x89PNG" + jpg[:17])


def _dataset(tmp_path):
    rng = np.random.default_rng(26)
    paths = []
    for s, fmt in enumerate(FORMATS):
        p = tmp_path / f"shard-{s:05}.tar"
        _write(p, s, 60 + 17 * s, fmt, rng)
        paths.append(str(p))
    return paths


def _reference(paths):
    """The `webdataset` package's own iteration: every sample's parts, in order."""
    ds = wds.WebDataset(paths, shardshuffle=False, empty_check=False)
    return [dict(s) for s in ds]


def _cfg(paths, batch, **dataset):
    return {
        "dataset": {"format": "webdataset", "paths": paths, "generate": False, **dataset},
        "device": {"select": "host"},
        "loader": {"batch_size": batch, "seed": 3, "shuffle": False, "remainder": "pad"},
    }


def _epoch(cfg, columns):
    """(sample id, [part bytes per column]) of every delivered sample, in order."""
    out = []
    for b in ubdirect.Loader(cfg).epoch(0):
        buf = np.from_dlpack(b)
        for i, sid in enumerate(b.ids):
            parts = b.parts(i)
            if parts is None:
                got = [b.sample_bytes(i)]
            else:
                got = [buf[off:off + n].tobytes() for off, n in parts]
            assert len(got) == len(columns)
            out.append((int(sid), got))
    return out


def test_every_samples_parts_equal_the_webdataset_packages(tmp_path):
    paths = _dataset(tmp_path)
    want = _reference(paths)
    assert len(want) == 60 + 77 + 94, len(want)
    assert any("seg.png" in w for w in want) and any("/" in w["__key__"] for w in want)
    for columns in (["jpg", "cls"], ["cls"], ["cls", "jpg"]):
        kw = {"column": columns[0]} if len(columns) == 1 else {"columns": columns}
        got = _epoch(_cfg(paths, 8, **kw), columns)
        # Shuffle off: file order, every sample once (then padding up to a whole batch).
        assert [sid for sid, _ in got[:len(want)]] == list(range(len(want)))
        for sid, parts in got:
            for c, part in zip(columns, parts):
                assert part == want[sid][c], f"sample {sid} ({want[sid]['__key__']}) part {c}"


def test_shuffled_epochs_deliver_the_same_parts(tmp_path):
    paths = _dataset(tmp_path)
    want = _reference(paths)
    cfg = _cfg(paths, 8, columns=["jpg", "cls"])
    cfg["loader"]["shuffle"] = True
    got = _epoch(cfg, ["jpg", "cls"])
    ids = [sid for sid, _ in got]
    assert set(ids) == set(range(len(want))) and ids[:len(want)] != list(range(len(want)))
    for sid, (jpg, cls) in got:
        assert jpg == want[sid]["jpg"] and cls == want[sid]["cls"], f"sample {sid}"


def test_a_part_not_every_sample_has_is_an_error(tmp_path):
    paths = _dataset(tmp_path)
    want = _reference(paths)
    assert not all("seg.png" in w for w in want)
    with pytest.raises(Exception, match="no part \"seg.png\""):
        ubdirect.Loader(_cfg(paths, 8, columns=["jpg", "seg.png"]))


def test_a_damaged_tar_is_an_error_naming_it(tmp_path):
    paths = _dataset(tmp_path)
    with open(paths[1], "r+b") as f:
        f.seek(1024 + 10)
        f.write(b"\xff\xfe")  # inside a header: its checksum no longer matches
    with pytest.raises(Exception, match="shard-00001.tar"):
        ubdirect.Loader(_cfg(paths, 8, columns=["jpg", "cls"]))
