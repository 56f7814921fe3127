"""Call arguments of MindSpore (and mindtorch) code as dump.json structures, and tensors as ``.npy`` files.

A tensor becomes ``{"type": "mindspore.Tensor", "dtype": "Float32", "shape": [...], "Max", "Min", "Mean",
"Norm", "requires_grad"}`` plus ``md5`` (CRC-32, msprobe's field name) and ``data_name`` when asked, as in
msprobe's MindSpore and MSAdapter dumps. On the CPU backend statistics are read from the tensor's memory
at once; on a device they stay there and reach the host in one stacked copy per ``resolve()``.

Tensor files are written when the call that made them returns (msprobe's documented behaviour), each
through a temporary name and a rename: a crash never leaves a torn ``.npy``. bfloat16 tensors are saved as
float32 (NumPy has no bfloat16); their dtype in dump.json stays ``BFloat16``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import mindspore as ms

from msprobe_core.files.safe_names import name_max, safe_file_name
from msprobe_core.mindspore import tensor_stats
from msprobe_core.mindspore.runtime import Tensor, dtype_name, numel, requires_grad
from msprobe_core.mindspore.tensor_stats import Stats

_STAT_KEYS = ("Max", "Min", "Mean", "Norm")


class Summarizer:
    """Summaries of one process's records. ``on_host``: statistics read from host memory at once (CPU
    backend) rather than deferred on the device."""

    def __init__(self, statistics: bool, md5: bool, on_host: bool, read_pointers: bool = True):
        self.statistics = statistics
        self.md5 = md5
        self.on_host = on_host
        self.read_pointers = read_pointers and on_host  # a device tensor's address is device memory
        self.tensor_dir: Optional[Path] = None
        self._made_dir: Optional[Path] = None
        self._pending: list[tuple[dict, Tensor, str, int]] = []
        self._pending_crc: list[tuple[dict, Tensor]] = []

    # ------------------------------------------------------------------ structures
    def summarize(self, obj: Any, file_base: Optional[str], save: bool) -> Any:
        """The dump.json structure of ``obj``; ``file_base`` names saved tensors when ``save``."""
        if isinstance(obj, Tensor):
            return self.tensor(obj, file_base, save)
        if obj is None:
            return None
        if isinstance(obj, (list, tuple)):
            if type(obj).__name__ == "Size":  # mindtorch's torch.Size
                return {"type": "torch.Size", "value": [int(v) for v in obj]}
            return [self.summarize(v, f"{file_base}.{i}" if file_base else None, save) for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            return {str(k): self.summarize(v, f"{file_base}.{k}" if file_base else None, save) for k, v in obj.items()}
        return describe_value(obj)

    def tensor(self, t: Tensor, file_base: Optional[str], save: bool) -> dict:
        """One tensor's summary (and its file when ``save``)."""
        summary: dict[str, Any] = {"type": "mindspore.Tensor", "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        count = numel(t)
        kind = tensor_stats.kind_of(t.dtype)
        array = None
        if count and (save or self.md5) and self.on_host:
            array = tensor_stats.host_array(t, self.read_pointers)
        if not self.statistics or not count:
            summary.update(Max=None, Min=None, Mean=None, Norm=None)
        elif self.on_host:
            stats = tensor_stats.array_stats(array) if array is not None else tensor_stats.host_stats(t, self.read_pointers)
            fill_stats(summary, stats, kind, count)
        else:
            summary.update(Max=None, Min=None, Mean=None, Norm=None)
            self._pending.append((summary, tensor_stats.device_stats(t, kind), kind, count))
        summary["requires_grad"] = requires_grad(t)
        if self.md5:
            if array is not None or not count:
                summary["md5"] = tensor_stats.array_crc32(array if array is not None else np.empty(0))
            else:
                summary["md5"] = None
                self._pending_crc.append((summary, t))
        if save and file_base and self.tensor_dir is not None:
            name = safe_file_name(file_base, ".npy", name_max(self.tensor_dir))
            self._write(name, array if array is not None else tensor_stats.host_array(t, self.read_pointers))
            summary["data_name"] = name
        return summary

    def _write(self, name: str, array: np.ndarray) -> None:
        assert self.tensor_dir is not None
        if self._made_dir != self.tensor_dir:
            self.tensor_dir.mkdir(parents=True, exist_ok=True)
            self._made_dir = self.tensor_dir
        if array.dtype.name == "bfloat16":
            array = array.astype(np.float32)  # ml_dtypes' bfloat16: NumPy cannot read it back
        write_npy(self.tensor_dir / name, array)

    # ------------------------------------------------------------------ device statistics
    @property
    def has_pending(self) -> bool:
        """Are some summaries still waiting for their device statistics or checksums?"""
        return bool(self._pending or self._pending_crc)

    def resolve(self) -> None:
        """Copy every pending device statistic to the host in one transfer per dtype and fill the summaries."""
        pending, self._pending = self._pending, []
        if pending:
            rows = tensor_stats.rows_to_host([row for _, row, _, _ in pending])
            for (summary, _, kind, count), stats in zip(pending, rows):
                fill_stats(summary, stats, kind, count)
        crcs, self._pending_crc = self._pending_crc, []
        for summary, t in crcs:
            summary["md5"] = tensor_stats.array_crc32(tensor_stats.host_array(t, read_pointer=False))


def fill_stats(summary: dict, stats: Stats, kind: str, count: int) -> None:
    """Max/Min/Mean/Norm from (max, min, sum, sum of squares) of ``count`` elements; bools get Max=any,
    Min=all."""
    if kind == "bool":
        summary.update(Max=bool(stats[0]), Min=bool(stats[1]), Mean=None, Norm=None)
    else:
        summary.update(Max=stats[0], Min=stats[1], Mean=stats[2] / count, Norm=stats[3] ** 0.5)


def write_npy(path: Path, array: np.ndarray) -> None:
    """``np.save`` through a temporary file and a rename (readers never see a partial file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.lib.format.write_array(f, array if array.flags.c_contiguous else np.ascontiguousarray(array),
                                  allow_pickle=False)  # (ascontiguousarray makes a 0-d array 1-d)
    os.replace(tmp, path)


def describe_value(obj: Any) -> dict:
    """A non-tensor argument as msprobe writes it: ``{"type": ..., "value": ...}``."""
    if isinstance(obj, bool):
        return {"type": "bool", "value": obj}
    if isinstance(obj, (int, np.integer)):
        return {"type": "int", "value": int(obj)}
    if isinstance(obj, (float, np.floating)):
        return {"type": "float", "value": float(obj)}
    if isinstance(obj, str):
        return {"type": "str", "value": obj}
    if isinstance(obj, slice):
        return {"type": "slice", "value": [_plain(obj.start), _plain(obj.stop), _plain(obj.step)]}
    if obj is Ellipsis:
        return {"type": "ellipsis", "value": "..."}
    if isinstance(obj, ms.dtype.Type):
        return {"type": "mindspore.dtype", "value": dtype_name(obj)}
    if isinstance(obj, complex):
        return {"type": "complex", "value": [obj.real, obj.imag]}
    return {"type": type(obj).__qualname__, "value": None}


def _plain(v: Any) -> Any:
    return v if v is None or isinstance(v, (int, float, str, bool)) else str(v)


def tensors_in(obj: Any) -> list:
    """Tensors inside a nested structure (lists, tuples, dicts), in the order the structure lists them."""
    if isinstance(obj, Tensor):
        return [obj]
    found: list = []
    if isinstance(obj, (list, tuple)):
        for v in obj:
            found.extend(tensors_in(v))
    elif isinstance(obj, dict):
        for v in obj.values():
            found.extend(tensors_in(v))
    return found
