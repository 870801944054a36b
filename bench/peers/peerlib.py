"""What the peer scripts share: KvikIO reading whole shards into GPU memory, dropping the page cache,
and one `ubdirect run` of a raw dataset with a config fragment."""
import json, os, subprocess, tempfile, time


def drop_caches():
    """Empties the page cache (root): cold reads after it come from the device."""
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def kvikio_read(paths, threads, task=4 << 20):
    """KvikIO in compat mode, every shard in flight at once, into CuPy device buffers: GB/s, CPU s/GB."""
    import cupy, kvikio, kvikio.defaults
    kvikio.defaults.set({"compat_mode": kvikio.CompatMode.ON, "num_threads": threads, "task_size": task})
    bufs = {p: cupy.empty(os.path.getsize(p), dtype=cupy.uint8) for p in paths}
    cupy.cuda.runtime.deviceSynchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    futs = []
    for p in paths:
        f = kvikio.CuFile(p, "r")
        futs.append((f, f.pread(bufs[p])))
    n = sum(fut.get() for _, fut in futs)
    for f, _ in futs:
        f.close()
    cupy.cuda.runtime.deviceSynchronize()
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    del bufs
    cupy.get_default_memory_pool().free_all_blocks()
    return {"gb_per_s": n / dt / 1e9, "cpu_s_per_gb": cpu / (n / 1e9), "wall_s": dt, "first_batch_s": None, "epochs": None}


def ubdirect_run(binary, dataset, sample, select, extra, epochs=1, env=None):
    """`ubdirect run --json` of a raw dataset (`dataset`: the `dir = …` or `paths = […]` line) of
    `sample`-byte records with the TOML fragment `extra`; returns (summary JSON, wall seconds)."""
    cfg = f"""
[dataset]
format = "raw"
{dataset}
generate = false
dtype = "u8"
record_len = {sample}
[device]
select = "{select}"
{extra}
"""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(cfg)
    t0 = time.perf_counter()
    out = subprocess.run([binary, "run", "--config", f.name, "--json", "--epochs", str(epochs)],
                         capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    os.unlink(f.name)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout), wall
