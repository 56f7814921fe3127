"""Dumped tensors to ``.pt`` files (``torch.save``'s format) without slowing the training thread.

``TensorFiles`` is the core's (``msprobe_core.dump.tensor_files``), given ``.pt`` jobs: it copies each
tensor once into a shared-memory arena and hands the job to the writer process
(``msprobe_core.files.writer_process``) that never touches the trainer's GIL: writer *threads* running
``torch.save`` hold the GIL while they copy and checksum, and every small torch op of the training
thread then waits for it. Where no arena can be made (no /dev/shm or temp space, no subprocess), a
thread pool does the same job with the GIL-friendly ``pt_archive`` writer. Files load with
``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import collections
import ctypes
import io
import os
import pickle
from typing import Optional

import torch

from msprobe_core.dump import tensor_files
from msprobe_core.dump.tensor_files import RING_BYTES, PathLike, ProcessWriter, ThreadWriter
from msprobe_core.files.pt_archive import (DIRECT_BLOCK, direct_io_helps, header_bytes_needed, removed_on_failure,
                                          trailer_bytes_needed, write_pt_atomic)
from msprobe_core.pytorch.tensor_stats import copy_host_stats, host_stats, raw_values

_STORAGE_CLASS = {
    torch.float32: torch.FloatStorage, torch.float64: torch.DoubleStorage, torch.float16: torch.HalfStorage,
    torch.bfloat16: torch.BFloat16Storage, torch.int64: torch.LongStorage, torch.int32: torch.IntStorage,
    torch.int16: torch.ShortStorage, torch.int8: torch.CharStorage, torch.uint8: torch.ByteStorage,
    torch.bool: torch.BoolStorage, torch.complex64: torch.ComplexFloatStorage,
    torch.complex128: torch.ComplexDoubleStorage,
}
_MEMMOVE_BELOW = 1 << 19  # contiguous CPU tensors below this size are copied by memcpy; larger ones by torch (threads)
# Tensors of at least this many bytes bound for a local disk are copied into an archive-shaped slot of the
# arena and written from there with O_DIRECT; smaller ones, and all on tmpfs or network file systems, get a
# plain write (the page cache is cheaper there than a device round trip).
IN_PLACE_MIN = 1 << 16


# ------------------------------------------------------------------------------------------ the pickle
class _StorageRef:
    def __init__(self, storage_class, numel: int):
        self.pid = ("storage", storage_class, "0", "cpu", numel)


class _TensorRecipe:
    """Pickles to the call ``torch.save`` records for a contiguous CPU tensor at storage offset 0."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]):
        strides, acc = [], 1
        for size in reversed(shape):
            strides.append(acc)
            acc *= max(size, 1)
        numel = 1
        for size in shape:
            numel *= size
        self.args = (_StorageRef(_STORAGE_CLASS[dtype], numel), 0, tuple(shape), tuple(reversed(strides)), False,
                     collections.OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _StorageRef) else None


_pickles: dict[tuple, bytes] = {}


def tensor_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of a contiguous tensor of this dtype and shape, byte for byte as torch.save writes it
    (made once per dtype and shape: the same shapes recur every step)."""
    key = (dtype, tuple(shape))
    pkl = _pickles.get(key)
    if pkl is None:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(_TensorRecipe(dtype, key[1]))
        pkl = buf.getvalue()
        if len(_pickles) < 100_000:
            _pickles[key] = pkl
    return pkl


def supported(t: torch.Tensor) -> bool:
    """Dense tensors of a dtype with a storage class; anything else is written by ``torch.save``."""
    return t.layout == torch.strided and t.dtype in _STORAGE_CLASS and not t.is_quantized


def write_file(t: torch.Tensor, path: PathLike) -> None:
    """Write ``t`` now (atomically) in torch.save's format."""
    x = t.detach()
    if not supported(x):
        tmp = f"{path}.tmp"
        with removed_on_failure(tmp):
            torch.save(x.cpu().clone(), tmp)
            os.replace(tmp, path)
        return
    x = x.cpu().contiguous()
    payload = memoryview(x.reshape(-1).view(torch.uint8).numpy()) if x.numel() else memoryview(b"")
    write_pt_atomic(path, tensor_pickle(x.dtype, tuple(x.shape)), payload)


# ------------------------------------------------------------------------------------------ backends
class _ThreadFiles(ThreadWriter):
    """Fallback: clone on the training thread, write on two toolkit threads."""

    def save(self, t: torch.Tensor, path: PathLike, want_stats: bool = False) -> None:
        self.submit(path, write_file, t.detach().clone(memory_format=torch.contiguous_format), path)


class _ProcessFiles(ProcessWriter):
    """The core's writer process (``dump.tensor_files``), given ``.pt`` jobs: a tensor's bytes are copied
    into the arena by memcpy or torch (which also computes its statistics while copying, when asked)."""

    def __init__(self, arena_bytes: int, ring_bytes: int = RING_BYTES):
        super().__init__(arena_bytes, ring_bytes)
        self.arena = torch.from_numpy(self.bytes)

    def save(self, t: torch.Tensor, path: PathLike, want_stats: bool = False) -> Optional[tuple[float, ...]]:
        n = t.numel() * t.element_size()
        if n == 0 or n > self.size // 2 or not supported(t):
            write_file(t, path)  # empty, huge or exotic: write it here, now
            return None
        self._poll()
        path = os.fspath(path)
        pkl = tensor_pickle(t.dtype, tuple(t.shape))
        if n >= IN_PLACE_MIN and direct_io_helps(path):  # an archive-shaped slot, written with O_DIRECT
            name_len = len(path) - path.rfind(os.sep) - 1
            data_offset = header_bytes_needed(name_len, len(pkl))
            slot_bytes = (data_offset + n + trailer_bytes_needed(name_len) + DIRECT_BLOCK - 1) // DIRECT_BLOCK * DIRECT_BLOCK
            span = self._alloc(slot_bytes, DIRECT_BLOCK)
            off = span[0] + data_offset
            job: tuple = ("i", path, pkl, span[0], slot_bytes, data_offset, n)
        else:
            span = self._alloc(n)
            off = span[0]
            job = ("w", path, pkl, off, n)
        stats = copy_host_stats(self._base + off, t) if want_stats else None
        if stats is None:
            if n < _MEMMOVE_BELOW and raw_values(t):
                ctypes.memmove(self._base + off, t.data_ptr(), n)  # a torch copy costs more than a small memcpy
            else:
                copy = self.arena[off:off + n].view(t.dtype).view(t.shape)
                copy.copy_(t.detach())
                if want_stats:  # from the contiguous copy (a strided tensor would need one of its own)
                    stats = host_stats(copy)
        self._send(job, span)
        return stats

    def _unmap(self) -> None:
        del self.arena
        super()._unmap()


class TensorFiles(tensor_files.TensorFiles):
    """Where the dump's tensors go: ``save(t, path)`` (``.pt``), ``save_array(a, path)`` (``.npy``),
    ``link(src, dst)``, ``flush()`` (all written), ``close()``. Starts its writer process on first use;
    falls back to threads if it cannot."""

    process_backend = _ProcessFiles
    thread_backend = _ThreadFiles

    def save(self, t: torch.Tensor, path: PathLike, want_stats: bool = False) -> Optional[tuple[float, ...]]:
        """Write ``t`` to ``path`` (in the background). With ``want_stats``, may also return its
        ``tensor_stats.host_stats`` computed while copying it (``None``: compute them yourself)."""
        return self._run("save", t, path, want_stats)
