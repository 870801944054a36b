"""The wheel carries the object-store feature: an s3:// dataset read from Python against moto_server
on loopback (installed by .ci/run). Skips, saying why, where moto is missing — except in CI
(UBDIRECT_REQUIRE_MOTO=1), where that is a failure."""
import os
import shutil
import socket
import subprocess
import time
import zlib

import numpy as np
import pytest

import ubdirect


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _need(what, why):
    if os.environ.get("UBDIRECT_REQUIRE_MOTO"):
        pytest.fail(f"UBDIRECT_REQUIRE_MOTO is set and {what} is missing: {why}")
    pytest.skip(f"{what} is missing ({why}): pip install 'moto[server]'")


@pytest.fixture
def moto():
    exe = shutil.which("moto_server")
    if exe is None:
        _need("moto_server", "not on PATH")
    try:
        import boto3  # moto's own dependency
    except ImportError as e:
        _need("boto3", e)
    port = _free_port()
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.time() < deadline, "moto_server did not come up"
                time.sleep(0.1)
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
        yield port, s3
    finally:
        proc.kill()
        proc.wait()


def test_s3_dataset_from_python(moto):
    port, s3 = moto
    s3.create_bucket(Bucket="ubdirect-ds")
    rng = np.random.default_rng(11)
    want = {}
    record = 1000 * 2
    for s in range(2):
        data = rng.integers(0, 65535, size=300 * 1000, dtype=np.uint16).tobytes()
        s3.put_object(Bucket="ubdirect-ds", Key=f"raw/shard-{s:05}.bin", Body=data)
        for i in range(300):
            want[s * 300 + i] = zlib.crc32(data[i * record:(i + 1) * record])
    loader = ubdirect.Loader({
        "dataset": {"format": "raw", "dir": "s3://ubdirect-ds/raw", "dtype": "u16", "record_len": 1000},
        "device": {"select": "host"},
        "loader": {"batch_size": 16, "seed": 5},
        "object_store": {"endpoint": f"http://127.0.0.1:{port}", "allow_http": True, "region": "us-east-1",
                         "access_key_id": "test", "secret_access_key": "test"},
    })
    seen = set()
    for batch in loader.epoch(0):
        data = np.from_dlpack(batch)
        for sid, off, n in zip(batch.ids, batch.offsets, batch.lengths):
            assert zlib.crc32(data[off:off + n].tobytes()) == want[int(sid)]
            seen.add(int(sid))
    assert len(seen) == 600 // 16 * 16
    # The summary says what came from the store against what was delivered (no cache: each sample
    # once, plus the planner's merged gaps).
    st = loader.summary()["object_store"]
    assert st is not None and st["requests"] > 0
    assert st["bytes_from_store"] >= loader.summary()["sample_bytes"] > 0
    assert 1.0 <= loader.summary()["store_per_delivered"] < 1.5, st
