"""ubdirect: training data from storage into GPU memory, the short way.

    import torch, ubdirect
    loader = ubdirect.Loader("configs/megatron.toml")        # or a dict of the same keys
    for batch in loader.epoch(0):
        data = torch.from_dlpack(batch)                      # CUDA tensor on a GPU, no copy
        for off, n in zip(batch.offsets, batch.lengths):
            sample = data[off:off + n]
    state = loader.state_dict()                              # picklable; loader.load_state_dict(state)

Batches hold their memory until the last tensor made from them is gone; waiting for a batch
releases the GIL and Ctrl-C interrupts it.
"""
from __future__ import annotations

import collections
import json
import os
from typing import Any, Iterator, Mapping, Optional, Union

import numpy as np

from . import _native

__all__ = ["Loader", "Batch", "IterableDataset", "HostBatch", "Recorder"]


def _jsonable(v):
    """What a dict config may hold beside JSON's own types: paths, numpy scalars and arrays."""
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    raise TypeError(f"config value {v!r} of type {type(v).__name__} is not a number, string, bool, "
                    "list, dict or path")


def _config_json(config: Mapping[str, Any]) -> str:
    return json.dumps(config, default=_jsonable)


_NUMPY_DTYPES = {"u8": "u1", "i8": "i1", "u16": "<u2", "i16": "<i2", "u32": "<u4", "i32": "<i4",
                 "u64": "<u8", "i64": "<i8", "f16": "<f2", "f32": "<f4", "f64": "<f8"}
_TORCH_DTYPES = {"u8": "uint8", "i8": "int8", "u16": "uint16", "i16": "int16", "u32": "uint32",
                 "i32": "int32", "u64": "uint64", "i64": "int64", "f16": "float16",
                 "bf16": "bfloat16", "f32": "float32", "f64": "float64"}


def _typed(data, batch: "Batch", lib: str):
    """``data`` (1-D uint8 over the batch's buffer, numpy or torch) as ``(batch, *shape)`` of the
    samples' type: a view where the samples lie back to back in order, else one gather (a copy of
    the samples' bytes, on the batch's device)."""
    kind, shape, why = batch._type
    if kind is None:
        raise TypeError(f"this dataset's samples have no tensor type: {why}")
    offs, lens = batch.offsets.astype(np.int64), batch.lengths.astype(np.int64)
    if lib == "torch":
        import torch

        dt = getattr(torch, _TORCH_DTYPES[kind])
        item = torch.empty((), dtype=dt).element_size()
    else:
        if kind not in _NUMPY_DTYPES:
            raise TypeError(f"numpy has no {kind}: use batch.tensor() (torch)")
        dt = np.dtype(_NUMPY_DTYPES[kind])
        item = dt.itemsize
    if shape is None:  # one dimension, as long as the sample: every sample of the batch alike
        if len(lens) and not (lens == lens[0]).all():
            i = int(np.argmax(lens != lens[0]))
            raise ValueError(f"sample {int(batch.ids[i])} is {int(lens[i])} bytes and sample "
                             f"{int(batch.ids[0])} {int(lens[0])}: samples of different lengths make "
                             "no (batch, n) tensor; use offsets and lengths")
        shape = [int(lens[0]) // item] if len(lens) else [0]
    n = int(np.prod(shape, dtype=np.int64)) * item
    bad = np.flatnonzero(lens != n)
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"sample {int(batch.ids[i])} is {int(lens[i])} bytes, not the {n} of its type "
                         f"{kind}{tuple(shape)}")
    b = len(offs)
    if b and (np.diff(offs) == n).all() and offs[0] % item == 0:  # back to back, in order: a view
        start = int(offs[0])
        out = data[start:start + n * b]
    elif b and (offs % item == 0).all():  # one gather of rows over a sliding window of elements
        e = data[:len(data) // item * item].view(dt)
        k = n // item
        idx = offs // item
        if lib == "torch":
            import torch

            win = e.as_strided((e.numel() - k + 1, k), (1, 1))
            return win[torch.as_tensor(idx, device=e.device)].reshape(b, *shape)
        win = np.lib.stride_tricks.as_strided(e, (len(e) - k + 1, k), (item, item), writeable=False)
        return win[idx].reshape(b, *shape)
    else:
        parts = [data[int(o):int(o) + n] for o in offs]
        out = (__import__("torch").cat(parts) if lib == "torch" else np.concatenate(parts)) if b else data[:0]
    return out.view(dt).reshape(b, *shape)


class Batch:
    """One batch: a single buffer (GPU or host memory) plus its sample table."""

    __slots__ = ("_b", "_type")

    def __init__(self, native: "_native.Batch", sample_type=(None, None, "unknown")):
        self._b = native
        self._type = sample_type

    @property
    def sample_type(self):
        """``(dtype name, shape)`` of one sample where the format says (raw's ``dtype`` and
        ``record_len``, the ``.npy`` header, an Arrow list column, Megatron's token type; shape
        ``None``: one dimension as long as the sample), else ``None``."""
        return None if self._type[0] is None else (self._type[0], self._type[1])

    def numpy(self) -> np.ndarray:
        """Host batches: the samples as one ``(batch, *shape)`` numpy array of their type (a view
        where they lie back to back, else a copy of their bytes). Writable, like the torch view:
        the batch's memory is yours until the batch is dropped; writes never reach the files."""
        if self.__dlpack_device__()[0] != 1:
            raise TypeError("a GPU batch: use batch.tensor() (torch) for a typed tensor")
        data = np.from_dlpack(self)
        if self.token_shape is not None:
            return data
        return _typed(data, self, "numpy")

    def __len__(self) -> int:
        return len(self._b)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return self._b.__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        return self._b.__dlpack_device__()

    @property
    def epoch(self) -> int:
        return self._b.epoch

    @property
    def index(self) -> int:
        return self._b.index

    @property
    def nbytes(self) -> int:
        return self._b.nbytes

    @property
    def ids(self) -> np.ndarray:
        return np.frombuffer(self._b._ids(), dtype="<u8")

    @property
    def offsets(self) -> np.ndarray:
        """Byte offset of every sample in the batch's buffer."""
        return np.frombuffer(self._b._offsets(), dtype="<u8")

    @property
    def lengths(self) -> np.ndarray:
        return np.frombuffer(self._b._lengths(), dtype="<u8")

    @property
    def positions(self) -> np.ndarray:
        """Position of every sample in the epoch's global order (the same at every world size)."""
        return np.frombuffer(self._b._positions(), dtype="<u8")

    def provenance(self) -> dict:
        """Where each sample comes from, as numpy uint64 arrays (one entry per sample, in order):
        ``sample`` (id), ``dataset`` (of a blend), ``window`` (GPT: the row of that dataset's sample index),
        ``document`` (GPT: first document read, a sequence id of its ``.idx``; whole samples: the id),
        ``token_offset`` (in that document), ``documents`` (spanned), ``length`` (tokens, or bytes for
        whole samples), ``shard`` and ``shard_offset`` (bytes)."""
        return {k: np.frombuffer(v, dtype="<u8") for k, v in self._b._provenance()}

    @property
    def token_shape(self):
        """GPT mode (``dataset.sequence_length``): ``(batch, sequence_length + 1, dtype name)`` —
        the DLPack tensor is then that 2-D array of tokens; ``None`` for whole samples."""
        return self._b.token_shape

    def tensor(self, name: Optional[str] = None):
        """Without ``name``: the samples as one torch tensor of shape ``(batch, *shape)`` and their
        type (:attr:`sample_type`), on the batch's device — a view where they lie back to back,
        else one gather on that device; GPT batches: the ``(batch, sequence_length + 1)`` tokens.
        A sample whose size differs from its type's is a ``ValueError`` naming it.

        With ``name`` (GPT mode with ``[dataset.tensors]``): Megatron-Core's per-sample tensor
        ``name`` on the batch's device, as an object any framework takes by DLPack
        (``torch.from_dlpack``), no copy: ``position_ids`` (int64, ``(batch, seq)``), ``loss_mask``
        (float32, ``(batch, seq)``), ``cu_seqlens`` (int32, segments of the flattened batch split at
        document ends) and, with ``create_attention_mask``, ``attention_mask`` (bool, ``(batch, 1,
        seq, seq)``, True = masked). ``None`` when the batch has no such tensor."""
        if name is not None:
            return self._b._tensor(name)
        import torch

        data = torch.from_dlpack(self)
        if self.token_shape is not None:
            return data
        return _typed(data, self, "torch")

    @property
    def position_ids(self):
        """``tensor("position_ids")``."""
        return self._b._tensor("position_ids")

    @property
    def loss_mask(self):
        """``tensor("loss_mask")``."""
        return self._b._tensor("loss_mask")

    @property
    def attention_mask(self):
        """``tensor("attention_mask")`` (``None`` without ``create_attention_mask``)."""
        return self._b._tensor("attention_mask")

    @property
    def cu_seqlens(self):
        """``tensor("cu_seqlens")``: int32 on the batch's device (FlashAttention varlen,
        Transformer Engine THD)."""
        return self._b._tensor("cu_seqlens")

    @property
    def max_seqlen(self):
        """The longest segment of ``cu_seqlens`` as a Python int (``None`` without tensors)."""
        s = self._b._seqlens()
        return None if s is None else s[0]

    @property
    def cu_seqlens_host(self) -> Optional[np.ndarray]:
        """``cu_seqlens`` as a host numpy array (int32), computed where the batch was made."""
        s = self._b._seqlens()
        return None if s is None else np.asarray(s[1], dtype=np.int32)

    def parts(self, i: int):
        """With ``dataset.columns``: sample ``i``'s parts as ``(offset, length)`` in the batch's buffer,
        one per column (e.g. ``input_ids`` then ``labels``); ``None`` otherwise."""
        return self._b.parts(i)

    def sample_bytes(self, i: int) -> bytes:
        """A copy of sample ``i`` (from host or device memory)."""
        return self._b.sample_bytes(i)

    def __repr__(self) -> str:
        dev = self.__dlpack_device__()
        return f"Batch(epoch={self.epoch}, index={self.index}, samples={len(self)}, device={'cuda' if dev[0] == 2 else 'cpu'})"


class Recorder:
    """Writes what each step trained on (see :meth:`Loader.recorder`)."""

    def __init__(self, native):
        self._r = native

    def record(self, batch: "Batch") -> None:
        self._r.record(batch._b)

    def close(self) -> None:
        self._r.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Epoch:
    def __init__(self, native, sample_type):
        self._it = native
        self._type = sample_type

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return Batch(next(self._it), self._type)

    def __len__(self) -> int:
        return len(self._it)

    def close(self) -> None:
        self._it.close()


class Loader:
    """The ubdirect dataset iterator.

    ``config`` is a path to a TOML config (see docs/configuration.md), a dict with the same
    sections and keys, or None for the embedded default. ``rank`` and ``world_size`` override the
    config and torchrun's ``RANK``/``WORLD_SIZE``. Bad configs raise ``ValueError`` with the loader's
    message (file, key, offset).
    """

    def __init__(self, config: Union[str, os.PathLike, Mapping[str, Any], None] = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None, *, _host: bool = False):
        rank = None if rank is None else int(rank)
        world_size = None if world_size is None else int(world_size)
        kw = dict(rank=rank, world_size=world_size, host=_host)
        if config is None:
            self._n = _native.Loader(**kw)
        elif isinstance(config, Mapping):
            self._n = _native.Loader(config_json=_config_json(config), **kw)
        else:
            self._n = _native.Loader(config_path=os.fspath(config), **kw)
        self._type = tuple(self._n._sample_type())
        # The process that owns the loader's threads and pools: a forked child has neither.
        self._pid = os.getpid()

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this ubdirect.Loader was made in process {self._pid} and is used in process "
                f"{os.getpid()} (a fork: a DataLoader worker, multiprocessing); its I/O threads and "
                "pools stayed in the parent. Make the Loader in the process that iterates it — "
                "ubdirect.IterableDataset does that in each DataLoader worker — or use num_workers=0 "
                "(ubdirect does its own I/O and prefetching)")

    def __len__(self) -> int:
        return len(self._n)

    def epoch(self, epoch: int) -> _Epoch:
        self._check_process()
        return _Epoch(self._n.epoch(int(epoch)), self._type)

    def replay(self, record: Union[str, os.PathLike], step: int, epoch: Optional[int] = None) -> _Epoch:
        """Step ``step`` of a record (``ubdirect run --record FILE`` or :meth:`recorder`) delivered
        again at this loader's world size: this rank's slice of that step's samples, in their global
        order (the same dataset and GPT settings; the step's samples must divide among the ranks)."""
        self._check_process()
        return _Epoch(self._n.replay(os.fspath(record), int(step), None if epoch is None else int(epoch)),
                      self._type)

    def recorder(self, path: Union[str, os.PathLike]) -> "Recorder":
        """Records every step given to it: ``rec.record(batch)``, then ``rec.close()`` (or use it in a
        ``with`` block). One Arrow IPC record batch of :meth:`Batch.provenance` per step;
        ``path.rank{R}`` per rank when the world size is above one."""
        return Recorder(self._n.recorder(os.fspath(path)))

    def state_dict(self) -> dict:
        return dict(self._n.state_dict())

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self._n.load_state_dict(dict(state))

    def summary(self) -> dict:
        """The run report, the same fields as ``ubdirect run --json`` (docs/python.md): device and
        why, I/O path, counters, ``time_to_first_batch_s`` and ``startup_s``, per-epoch rates,
        ``resolved`` (what each ``0 = auto`` key became, and why), ``fallbacks`` as objects."""
        return json.loads(self._n._summary_json())

    def pool_stats(self) -> dict:
        return dict(self._n.pool_stats())

    @property
    def device(self) -> str:
        return self._n.device_kind

    @property
    def sample_type(self):
        """``(dtype name, shape)`` of one sample where the format says, else ``None``
        (:attr:`Batch.sample_type`)."""
        return None if self._type[0] is None else (self._type[0], self._type[1])


HostBatch = collections.namedtuple("HostBatch", ["data", "offsets", "lengths"])
HostBatch.__doc__ = """A batch of whole samples: ``data`` (a uint8 tensor over the batch's buffer) and the
samples' ``offsets`` and ``lengths`` in it (int64 tensors). A named tuple, so that PyTorch's
``DataLoader`` passes it through as it is."""


class _TorchIterable:
    """The state of :func:`IterableDataset`, picklable (DataLoader workers, ``spawn``): the loader is
    made in the process that iterates, lazily."""

    def __init__(self, config, epoch, rank, world_size, sample_shape, dtype):
        if isinstance(config, Mapping):
            config = json.loads(_config_json(config))  # plain values only: it is pickled to workers
        elif config is not None:
            config = os.fspath(config)
        self.config, self.epoch, self.rank, self.world_size = config, int(epoch), rank, world_size
        self.sample_shape = None if sample_shape is None else tuple(int(d) for d in sample_shape)
        self.dtype = dtype
        self._loader = None
        self._key = None

    def __getstate__(self):
        st = dict(self.__dict__)
        st["_loader"], st["_key"] = None, None
        return st

    def set_epoch(self, e: int) -> None:
        """The epoch the next iteration delivers; call it at the start of every epoch (as with a
        ``DistributedSampler``), or every pass repeats the epoch given at construction."""
        self.epoch = int(e)

    def loader(self) -> "Loader":
        """This process's loader: in a DataLoader worker, rank ``rank * num_workers + worker id`` of
        ``world_size * num_workers`` (each worker a shard of the rank), host batches."""
        import torch

        info = torch.utils.data.get_worker_info()
        key = (os.getpid(), None if info is None else (info.id, info.num_workers))
        if self._loader is None or self._key != key:
            rank, world = self.rank, self.world_size
            if info is not None:
                if rank is None or world is None:
                    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
                    world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world
                rank, world = rank * info.num_workers + info.id, world * info.num_workers
            if self._loader is not None and self._key[0] != os.getpid():
                # A loader forked from the parent: its threads are not in this process, so dropping
                # it here would wait for them forever. Kept until the process exits.
                _INHERITED.append(self._loader)
            self._loader = Loader(self.config, rank=rank, world_size=world, _host=info is not None)
            self._key = key
        return self._loader

    def __len__(self) -> int:
        return len(self.loader())

    def __iter__(self):
        import torch

        for b in self.loader().epoch(self.epoch):
            data = torch.from_dlpack(b)
            if b.token_shape is not None:
                yield data  # GPT mode: a (batch, sequence_length + 1) tensor of tokens
                continue
            offs, lens = b.offsets, b.lengths
            if self.sample_shape is None:
                yield HostBatch(data, torch.from_numpy(offs.astype(np.int64)),
                                torch.from_numpy(lens.astype(np.int64)))
                continue
            dtype, shape = self.dtype, self.sample_shape
            n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            if not (lens == n).all():
                raise ValueError(f"samples are not all {n} bytes; drop sample_shape")
            if (np.diff(offs.astype(np.int64)) == n).all():
                start = int(offs[0])
                out = data[start:start + n * len(b)].view(dtype).reshape(len(b), *shape)
            else:
                out = torch.stack([data[int(o):int(o) + n].view(dtype).reshape(shape) for o in offs])
            yield out


def IterableDataset(config=None, epoch: int = 0, rank=None, world_size=None, sample_shape=None, dtype=None):
    """A ``torch.utils.data.IterableDataset`` yielding, per batch, a :class:`HostBatch`
    ``(data, offsets, lengths)`` (``data`` a uint8 tensor over the batch's buffer, on the GPU when
    there is one), or — with ``sample_shape`` and ``dtype`` for fixed-size samples — a tensor of
    shape ``(batch, *sample_shape)``. In GPT mode (``dataset.sequence_length``) each item is the
    ``(batch, sequence_length + 1)`` token tensor.

    Use it with ``DataLoader(ds, batch_size=None)``. ``num_workers=0`` is the fast path: ubdirect
    does its own I/O and prefetching, and puts batches on the GPU itself. With ``num_workers=N``
    each worker makes its own loader as rank ``rank * N + worker id`` of ``world_size * N`` (every
    sample of the epoch once across them, as ``get_worker_info()`` describes) with host batches;
    ``pin_memory=True`` and ``.cuda()`` move them as usual.
    ``ds.set_epoch(e)`` selects the epoch each pass delivers (reshuffled per epoch); without it every
    pass is epoch ``epoch``.
    """
    return _torch_dataset_class()(config, epoch, rank, world_size, sample_shape, dtype)


_INHERITED: list = []
_TORCH_DATASET = None


def _torch_dataset_class():
    """``ubdirect.TorchIterableDataset``, made on first use (torch is imported only then); a module
    attribute, so that pickle finds it by name in a ``spawn``ed worker."""
    global _TORCH_DATASET
    if _TORCH_DATASET is None:
        import torch

        class TorchIterableDataset(_TorchIterable, torch.utils.data.IterableDataset):
            pass

        TorchIterableDataset.__module__ = __name__
        TorchIterableDataset.__qualname__ = "TorchIterableDataset"
        _TORCH_DATASET = TorchIterableDataset
    return _TORCH_DATASET


def __getattr__(name):
    if name == "TorchIterableDataset":
        return _torch_dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
