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


def odirect_h2d(paths, depth=2, block=4 << 20):
    """The cold ceiling with the copy a loader of GPU batches must also make: a thread per shard
    reads it with O_DIRECT, `block` bytes at a time, into `depth` pinned buffers in turn, and copies
    each to the shard's device buffer on the thread's own stream (a buffer is read into again once
    its copy is done). GB/s, CPU s/GB."""
    import threading
    import cupy, numpy
    rt = cupy.cuda.runtime
    dev = {p: cupy.empty(os.path.getsize(p), dtype=cupy.uint8) for p in paths}
    pins = {p: [cupy.cuda.alloc_pinned_memory(block) for _ in range(depth)] for p in paths}
    rt.deviceSynchronize()
    errors = []

    def one(p):
        try:
            s = cupy.cuda.Stream(non_blocking=True)
            views = [memoryview(numpy.frombuffer(m, dtype=numpy.uint8, count=block)) for m in pins[p]]
            done = [None] * depth
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            try:
                off, i, n = 0, 0, os.path.getsize(p)
                while off < n:
                    k = i % depth
                    if done[k] is not None:
                        done[k].synchronize()
                    got = os.preadv(fd, [views[k]], off)
                    if got <= 0:
                        raise OSError(f"{p}: read {got} at {off}")
                    rt.memcpyAsync(dev[p].data.ptr + off, pins[p][k].ptr, got, rt.memcpyHostToDevice, s.ptr)
                    done[k] = cupy.cuda.Event(disable_timing=True)
                    done[k].record(s)
                    off, i = off + got, i + 1
                s.synchronize()
            finally:
                os.close(fd)
        except Exception as e:  # reported by the caller
            errors.append(e)

    ts = [threading.Thread(target=one, args=(p,)) for p in paths]
    c0, t0 = time.process_time(), time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if errors:
        raise errors[0]
    n = sum(os.path.getsize(p) for p in paths)
    del dev, pins
    cupy.get_default_memory_pool().free_all_blocks()
    return {"gb_per_s": n / dt / 1e9, "cpu_s_per_gb": cpu / (n / 1e9), "epochs": None}


def populate_fill(paths):
    """The page cache's fill without a copy to user space: a thread per shard maps it and calls
    `madvise(MADV_POPULATE_READ)` on the whole mapping (Linux 5.14+), which reads it into the page
    cache through the kernel's read-ahead. GB/s."""
    import ctypes, threading
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    PROT_READ, MAP_SHARED, MADV_POPULATE_READ = 1, 1, 22
    errors = []

    def one(p):
        n = os.path.getsize(p)
        fd = os.open(p, os.O_RDONLY)
        try:
            a = libc.mmap(None, n, PROT_READ, MAP_SHARED, fd, 0)
            if a in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {p}")
            try:
                if libc.madvise(a, n, MADV_POPULATE_READ) != 0:
                    raise OSError(ctypes.get_errno(), f"madvise(MADV_POPULATE_READ) {p}")
            finally:
                libc.munmap(a, n)
        except Exception as e:  # reported by the caller
            errors.append(e)
        finally:
            os.close(fd)

    ts = [threading.Thread(target=one, args=(p,)) for p in paths]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"gb_per_s": sum(os.path.getsize(p) for p in paths) / dt / 1e9, "cpu_s_per_gb": None, "epochs": None}


def closed_loop(paths, in_flight=12, balanced=False, block=4 << 20, seed=0):
    """O_DIRECT reads of every `block` of every shard, `in_flight` at a time (a thread each, its own
    aligned buffer, taking the next read when its last one is done: a loader's staging depth, no
    copy after). `balanced=False` takes the reads in a shuffled order, as a shuffled plan issues
    them; `balanced=True` takes the same reads, but each thread the next one of the device with the
    fewest reads in flight (the device: the file system's `st_dev`). GB/s."""
    import mmap, random, threading
    reads = [(p, off) for p in paths for off in range(0, os.path.getsize(p), block)]
    random.Random(seed).shuffle(reads)
    dev_of = {p: os.stat(p).st_dev for p in paths}
    queues = {}
    for p, off in reads:
        queues.setdefault(dev_of[p], []).append((p, off))
    for q in queues.values():
        q.reverse()  # pop() from the end takes them in shuffled order
    order = list(reversed(reads))
    busy = {d: 0 for d in queues}
    lock = threading.Lock()
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths}
    errors = []

    def take(prev):
        with lock:
            if prev is not None:
                busy[prev] -= 1
            if balanced:
                ds = [d for d, q in queues.items() if q]
                if not ds:
                    return None
                d = min(ds, key=lambda d: busy[d])
                p, off = queues[d].pop()
            else:
                if not order:
                    return None
                p, off = order.pop()
                d = dev_of[p]
            busy[d] += 1
            return d, p, off

    def worker():
        buf = mmap.mmap(-1, block)
        prev = None
        try:
            while (t := take(prev)) is not None:
                d, p, off = t
                os.preadv(fds[p], [buf], off)
                prev = d
        except Exception as e:  # reported after the join
            errors.append(e)
        finally:
            buf.close()

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(in_flight)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    if errors:
        raise errors[0]
    return {"gb_per_s": sum(os.path.getsize(p) for p in paths) / dt / 1e9, "cpu_s_per_gb": None, "epochs": None}
