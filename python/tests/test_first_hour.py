"""What a newcomer meets in the first hour (issue 24): a typo'd dataset.dir is an error, not
synthetic data; holding batches fails fast naming the key; checkpoints behave like torchdata's
StatefulDataLoader; the summary carries throughput and page-cache figures."""
import pickle
import time

import numpy as np
import pytest

import ubdirect


def make_raw(tmp_path, n=600, record=1000):
    d = tmp_path / "raw"
    d.mkdir()
    rng = np.random.default_rng(7)
    for s in range(3):
        rng.integers(0, 65535, size=(n // 3) * record, dtype=np.uint16).tofile(d / f"shard-{s:05}.bin")
    return d


def config(d, **loader):
    return {
        "dataset": {"format": "raw", "dir": str(d), "dtype": "u16", "record_len": 1000},
        "device": {"select": "host"},
        "loader": {"batch_size": 16, "seed": 3, **loader},
    }


def test_a_typo_in_dataset_dir_is_an_error_naming_key_and_path(tmp_path):
    typo = tmp_path / "my-datset"
    with pytest.raises(ValueError, match=r"dataset\.dir .*my-datset.* does not exist"):
        ubdirect.Loader(config(typo))
    assert not typo.exists(), "nothing may be written into a typo'd directory"


def test_generated_data_is_said_in_the_summary(tmp_path):
    cfg = config(tmp_path / "gen")
    cfg["dataset"].update({"generate": True, "generate_samples": 256, "generate_shards": 2})
    s = ubdirect.Loader(cfg).summary()
    assert s["generated"]["samples"] == 256 and s["generated"]["shards"] == 2, s


def test_holding_200_batches_fails_fast_naming_the_key(tmp_path):
    d = make_raw(tmp_path, n=3600)
    loader = ubdirect.Loader(config(d, batch_size=8, max_chunk_batches=1, prefetch=4))
    held = []
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="pool.batch_blocks") as e:
        for b in loader.epoch(0):
            held.append(b)
            if len(held) == 200:
                break
    assert time.monotonic() - t < 1.5, "the error must come within a second of the stall, not after pool.acquire_timeout_ms"
    assert len(held) < 200, e


def test_a_state_at_an_epochs_end_resumes_at_the_next_epoch(tmp_path):
    d = make_raw(tmp_path)
    a = ubdirect.Loader(config(d))
    for _ in a.epoch(0):
        pass
    state = pickle.loads(pickle.dumps(a.state_dict()))
    assert (state["epoch"], state["next_batch"]) == (1, 0)
    b = ubdirect.Loader(config(d))
    b.load_state_dict(state)
    got = [list(x.ids) for x in b.epoch(1)]
    want = [list(x.ids) for x in ubdirect.Loader(config(d)).epoch(1)]
    assert got == want and len(got) == len(b) > 0


def test_a_state_used_with_another_epoch_is_an_error(tmp_path):
    d = make_raw(tmp_path)
    a = ubdirect.Loader(config(d))
    it = a.epoch(0)
    for _ in range(5):
        next(it)
    it.close()
    state = a.state_dict()
    b = ubdirect.Loader(config(d))
    b.load_state_dict(state)
    with pytest.raises(ValueError, match=r"continues epoch 0"):
        b.epoch(3)
    # The state stays loaded: the right epoch still resumes, and len() is what remains.
    it = b.epoch(0)
    assert len(it) == len(b) - 5
    assert sum(1 for _ in it) == len(b) - 5


def test_a_refused_state_names_the_settings_that_differ(tmp_path):
    d = make_raw(tmp_path)
    state = ubdirect.Loader(config(d)).state_dict()
    with pytest.raises(ValueError, match=r"loader\.batch_size 16 \(state\) vs 32") as e:
        ubdirect.Loader(config(d, batch_size=32)).load_state_dict(state)
    assert "loader.seed" not in str(e.value)
    with pytest.raises(ValueError, match=r"loader\.seed 3 \(state\) vs 4"):
        ubdirect.Loader(config(d, seed=4)).load_state_dict(state)


def test_summary_has_throughput_and_page_cache_figures(tmp_path):
    d = make_raw(tmp_path)
    loader = ubdirect.Loader(config(d))
    for _ in loader.epoch(0):
        pass
    s = loader.summary()
    for k in ("seconds", "samples_per_s", "gb_per_s", "read_gb_per_s", "wasted_bytes", "page_cache"):
        assert k in s, (k, s)
    assert s["samples_per_s"] > 0 and s["gb_per_s"] > 0
    assert s["samples"] == 600 // 16 * 16


def test_summary_is_the_clis_run_report(tmp_path):
    # Issue 45: summary() lacked time_to_first_batch_s and gave fallbacks as strings where
    # `ubdirect run --json` gives objects. Both are now the one RunReport.
    d = make_raw(tmp_path)
    loader = ubdirect.Loader(config(d))
    n = sum(1 for _ in loader.epoch(0))
    s = loader.summary()
    assert s["epochs"] == 1 and s["batches"] == n == 600 // 16, s
    assert 0 < s["time_to_first_batch_s"] < 60, s
    phases = dict(s["startup_s"])
    assert {"dataset", "pools", "first_plan", "first_batch"} <= set(phases), phases
    assert len(s["epoch_gb_per_s"]) == 1 and s["epoch_gb_per_s"][0] > 0, s
    assert all(isinstance(f, dict) and {"kind", "count", "detail"} <= set(f) for f in s["fallbacks"]), s
    assert any(r["key"] == "pool.batch_blocks" for r in s["resolved"]), s["resolved"]


def test_generated_data_is_said_as_a_warning(tmp_path):
    # Issue 45: a training script trained on generated data without a word (the CLI says it).
    cfg = config(tmp_path / "gen-warn")
    cfg["dataset"].update({"generate": True, "generate_samples": 256, "generate_shards": 2})
    with pytest.warns(UserWarning, match="SYNTHETIC data"):
        ubdirect.Loader(cfg)


def _readme_python_example():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", readme, re.S).group(1)


def test_the_readme_example_runs_as_nobody_under_an_8_mib_memlock_limit(tmp_path):
    """Issue 45: as a user without CAP_IPC_LOCK under the common 8 MiB RLIMIT_MEMLOCK, the README's
    Python example runs its epoch (the pools pageable, said as a warning) and says which depths it
    chose. Where torch is not installed, numpy's from_dlpack stands in for torch's (a `torch.py`
    shim); the README's code runs as written."""
    import os
    import pathlib
    import resource
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and util-linux setpriv to run a child as nobody")
    repo = pathlib.Path(__file__).resolve().parents[2]
    code = _readme_python_example() + (
        "\nimport json\nprint('SAMPLES', sum(len(b.lengths) for b in loader.epoch(1)))\n"
        "print('RESOLVED', json.dumps(loader.summary()['resolved']))\n"
    )
    shim = tmp_path / "shim"
    shim.mkdir()
    try:
        import torch  # noqa: F401
    except ImportError:
        (shim / "torch.py").write_text("from numpy import from_dlpack\n")
    # nobody must reach the interpreter, the wheel and the repo (under /root in CI), and write HOME.
    for p in [pathlib.Path(sys.executable).resolve(), *map(pathlib.Path, sys.path), repo, tmp_path]:
        for parent in [p, *p.parents]:
            if parent.exists():
                os.chmod(parent, os.stat(parent).st_mode | 0o055 if parent.is_dir() else os.stat(parent).st_mode | 0o044)
    os.chmod(tmp_path, 0o777)
    os.chmod(shim, 0o755)

    def limit():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))

    env = {
        "HOME": str(tmp_path),
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": os.pathsep.join([str(shim), *[p for p in sys.path if p]]),
    }
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
         "--bounding-set=-all", "--", sys.executable, "-c", code],
        cwd=repo, env=env, preexec_fn=limit, capture_output=True, text=True, timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "SAMPLES 16384" in out.stdout, text
    assert "pools_not_locked" in out.stderr and "RLIMIT_MEMLOCK is 8388608" in out.stderr, text
    import json

    resolved = json.loads(out.stdout.split("RESOLVED ", 1)[1])
    staging = next(r for r in resolved if r["key"] == "pool.staging_blocks")
    assert staging["why"].startswith("the dataset: "), staging
