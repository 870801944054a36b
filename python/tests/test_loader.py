"""The Python iterator on the host device: bytes equal the files, exact resume, leases come back,
config errors are Python exceptions with the Rust message."""
import gc
import os
import pickle
import time
import zlib

import numpy as np
import pytest

import ubdirect


def make_raw(tmp_path, n=600, record=1000):
    d = tmp_path / "raw"
    d.mkdir()
    rng = np.random.default_rng(7)
    files = []
    for s in range(3):
        data = rng.integers(0, 65535, size=(n // 3) * record, dtype=np.uint16)
        p = d / f"shard-{s:05}.bin"
        data.tofile(p)
        files.append(p)
    return d, files


def config(d, **loader):
    return {
        "dataset": {"format": "raw", "dir": str(d), "generate": False, "dtype": "u16", "record_len": 1000},
        "device": {"select": "host"},
        "loader": {"batch_size": 16, "seed": 3, **loader},
    }


def reference(files, record_bytes=2000):
    crcs = []
    for p in files:
        b = p.read_bytes()
        crcs += [zlib.crc32(b[i:i + record_bytes]) for i in range(0, len(b), record_bytes)]
    return crcs


def test_sample_bytes_equal_the_files(tmp_path):
    d, files = make_raw(tmp_path)
    want = reference(files)
    loader = ubdirect.Loader(config(d))
    assert len(loader) == 600 // 16
    seen = set()
    for batch in loader.epoch(0):
        assert batch.__dlpack_device__() == (1, 0)
        data = np.from_dlpack(batch)
        assert data.dtype == np.uint8 and data.ndim == 1
        for sid, off, n in zip(batch.ids, batch.offsets, batch.lengths):
            assert n == 2000
            assert zlib.crc32(data[off:off + n].tobytes()) == want[sid]
            seen.add(int(sid))
        assert zlib.crc32(batch.sample_bytes(0)) == want[batch.ids[0]]
    assert len(seen) == 592


def test_resume_equals_uninterrupted(tmp_path):
    d, _ = make_raw(tmp_path)
    full = [list(b.ids) for b in ubdirect.Loader(config(d, window=48)).epoch(2)]
    a = ubdirect.Loader(config(d, window=48))
    it = a.epoch(2)
    first = [list(next(it).ids) for _ in range(11)]
    it.close()
    state = pickle.loads(pickle.dumps(a.state_dict()))
    assert state["epoch"] == 2 and state["next_batch"] == 11
    b = ubdirect.Loader(config(d, window=48))
    b.load_state_dict(state)
    rest = [list(x.ids) for x in b.epoch(2)]
    assert first + rest == full
    other = ubdirect.Loader(config(d, seed=4))
    with pytest.raises(ValueError, match="state_dict"):
        other.load_state_dict(state)


def test_dropping_every_reference_returns_the_blocks(tmp_path):
    d, _ = make_raw(tmp_path)
    loader = ubdirect.Loader(config(d))
    it = loader.epoch(0)
    batches = [next(it) for _ in range(5)]
    arrays = [np.from_dlpack(b) for b in batches]
    del batches
    gc.collect()
    st = loader.pool_stats()
    assert st["batch_free"] < st["batch_total"], "arrays must keep their batches' blocks alive"
    assert arrays[0][:10].tobytes()  # still readable
    del arrays, it
    gc.collect()
    deadline = time.time() + 10
    while True:
        st = loader.pool_stats()
        if st["batch_free"] == st["batch_total"] and st["staging_free"] == st["staging_total"]:
            break
        assert time.time() < deadline, f"blocks not returned: {st}"
        time.sleep(0.01)
    assert st["registrations"] == 1


def test_config_errors_are_exceptions_with_the_rust_message(tmp_path):
    with pytest.raises(ValueError, match="queue_dept"):
        ubdirect.Loader({"engine": {"queue_dept": 3}})
    with pytest.raises(ValueError, match="dataset.format"):
        ubdirect.Loader({"dataset": {"format": "parquet"}})
    with pytest.raises(ValueError, match="nope.bin"):
        ubdirect.Loader({"dataset": {"format": "raw", "paths": [str(tmp_path / "nope.bin")], "generate": False}, "device": {"select": "host"}})
    bad = tmp_path / "bad.toml"
    bad.write_text("[loader]\nbatch_size = 0\n")
    with pytest.raises(ValueError, match="batch_size"):
        ubdirect.Loader(str(bad))


def test_ranks_from_arguments(tmp_path):
    d, _ = make_raw(tmp_path)
    ids = []
    for r in range(2):
        ids += [int(i) for b in ubdirect.Loader(config(d), rank=r, world_size=2).epoch(0) for i in b.ids]
    assert len(ids) == len(set(ids)) == 18 * 2 * 16


def test_state_dict_resumes_at_another_world_size(tmp_path):
    # 576 samples in batches of 16: 4 ranks × 3 batches, then 2 ranks × 6, then 3 ranks to the end.
    d, _ = make_raw(tmp_path, n=576)
    seen = []
    state = None
    for world, stop in [(4, 3), (2, 6), (3, None)]:
        states = []
        for r in range(world):
            loader = ubdirect.Loader(config(d), rank=r, world_size=world)
            if state is not None:
                loader.load_state_dict(state)
            it = loader.epoch(0)
            for k, b in enumerate(it):
                seen += [int(i) for i in b.ids]
                if stop is not None and k + 1 == stop:
                    break
            it.close()
            states.append(pickle.loads(pickle.dumps(loader.state_dict())))
        assert len({s["position"] for s in states}) == 1, "ranks agree on the global position"
        state = states[0]
    # The last stage ran to the epoch's end: its state is the next epoch's start.
    assert (state["epoch"], state["position"]) == (1, 0)
    assert sorted(seen) == list(range(576)), "every sample exactly once across 4 → 2 → 3 ranks"


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler, as in a terminal. A process started in the background by a
    non-interactive shell (CI runners, `cmd &`) inherits SIGINT ignored; Python then installs no
    handler, and `_thread.interrupt_main()` does nothing at all."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_interrupts_a_waiting_iterator(tmp_path, monkeypatch, python_sigint):
    import _thread
    import threading

    # Holding every block on purpose: the held-blocks error (after 0.5 s of such a wait, see
    # test_first_hour) would otherwise race the interrupt on a loaded machine.
    monkeypatch.setenv("UBDIRECT_STALL_GRACE_MS", "600000")
    d, _ = make_raw(tmp_path)
    cfg = config(d, prefetch=1)
    # The acquire deadline only bounds a broken test: far past the watcher's own 60 + 30 s.
    cfg["pool"] = {"batch_blocks": 2, "acquire_timeout_ms": 180000}
    cfg["loader"]["batch_timeout_ms"] = 180000
    loader = ubdirect.Loader(cfg)
    it = loader.epoch(0)
    held = []
    sent = []

    def interrupt_once_every_block_is_held():
        # A real condition, not a guess at how long it takes: the loop holds every batch block, so
        # the iterator is waiting for one to come back (or about to).
        deadline = time.time() + 60
        while len(held) < 2 and time.time() < deadline:
            time.sleep(0.005)
        sent.append((time.time(), len(held) >= 2 and loader.pool_stats()["batch_free"] == 0))
        # Again every 0.5 s until the loop has seen one: an interrupt that lands between two
        # bytecodes of the test's own loop on a loaded machine is raised there, not in the wait.
        for _ in range(60):
            if done.is_set():
                return
            _thread.interrupt_main()
            time.sleep(0.5)

    done = threading.Event()
    threading.Thread(target=interrupt_once_every_block_is_held, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        # Holding every batch exhausts the batch pool: the iterator waits (GIL released) until
        # the interrupt arrives, long before the acquire deadline.
        for b in it:
            held.append(b)
    done.set()
    try:
        time.sleep(0.6)  # an interrupt already on its way lands here
    except KeyboardInterrupt:
        pass
    assert sent, "interrupted before the watcher sent it"
    assert sent[0][1], "the loop never held every batch block"
    assert time.time() - sent[0][0] < 5, "Ctrl-C did not interrupt the wait"
    assert len(held) >= 1
