"""Call arguments of MindSpore (and mindtorch) code as dump.json structures, and tensors as ``.npy`` files.

A tensor becomes ``{"type": "mindspore.Tensor", "dtype": "Float32", "shape": [...], "Max", "Min", "Mean",
"Norm", "requires_grad"}`` plus ``md5`` (CRC-32, msprobe's field name) and ``data_name`` when asked, as in
msprobe's MindSpore and MSAdapter dumps. On the CPU backend statistics are read from the tensor's memory
at once; on a device they stay there and reach the host in one stacked copy per ``resolve()``. The walk over
arguments, non-tensor values and the deferred host copy are the core's (``dump.summarize``).

Tensor files are handed over when the call that made them returns (msprobe's documented behaviour): the
training thread copies the host array once into the core's writer (``dump.tensor_files``: the writer
process shared with PyTorch), which writes it through a temporary name and a rename, so a crash never
leaves a torn ``.npy``. bfloat16 tensors are saved as float32 (NumPy has no bfloat16); their dtype in
dump.json stays ``BFloat16``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import mindspore as ms

from msprobe_core.dump import summarize as core
from msprobe_core.dump.summarize import NO_STATS, SummarizerBase, fill
from msprobe_core.dump.tensor_files import TensorFiles
from msprobe_core.mindspore import tensor_stats
from msprobe_core.mindspore.runtime import Tensor, dtype_name, numel, odd_tensor_reason, requires_grad


class Summarizer(SummarizerBase):
    """Summaries of one process's records. ``on_host``: statistics read from host memory at once (CPU
    backend) rather than deferred on the device. ``files``: where saved tensors go (the core's writer)."""

    tensor_types = (Tensor,)

    def __init__(self, statistics: bool, md5: bool, on_host: bool, read_pointers: bool = True,
                 files: Optional[TensorFiles] = None):
        super().__init__(statistics, md5, files if files is not None else TensorFiles())
        self.on_host = on_host
        self.read_pointers = read_pointers and on_host  # a device tensor's address is device memory

    def describe(self, obj: Any) -> dict:
        return describe_value(obj)

    def tensor(self, t: Tensor, file_base: Optional[str], save: bool) -> dict:
        """One tensor's summary (and its file when ``save``)."""
        reason = odd_tensor_reason(t)
        if reason is not None:  # nothing reads its memory; the record says why
            return self._unsupported(t, reason)
        summary: dict[str, Any] = {"type": "mindspore.Tensor", "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        count = numel(t)
        kind = tensor_stats.kind_of(t.dtype)
        array = None
        if count and (save or self.md5) and self.on_host:
            array = tensor_stats.host_array(t, self.read_pointers)
        if not self.statistics or not count:
            summary.update(NO_STATS)
        elif self.on_host:
            stats = tensor_stats.array_stats(array) if array is not None else tensor_stats.host_stats(t, self.read_pointers)
            fill(summary, stats, kind, count)
        else:
            summary.update(NO_STATS)
            self._pending.append((summary, tensor_stats.device_stats(t, kind), kind, count))
        summary["requires_grad"] = requires_grad(t)
        if self.md5:
            if array is not None or not count:
                summary["md5"] = tensor_stats.array_crc32(array if array is not None else np.empty(0))
            else:
                summary["md5"] = None
                self._pending_crc.append((summary, t))
        if save and file_base and self.tensor_dir is not None:
            try:
                name, path = self.file_path(file_base, ".npy")
                self.files.save_array(array if array is not None else tensor_stats.host_array(t, self.read_pointers), path)
                summary["data_name"] = name
            except Exception as e:  # a tensor that cannot be copied to the host: no file, the record stays
                summary["summary"] = f"unsupported: not saved ({type(e).__name__})"
        return summary

    def _unsupported(self, t: Tensor, reason: str) -> dict:
        """The record of a tensor the dump does not read (``runtime.odd_tensor_reason``)."""
        summary: dict[str, Any] = {"type": "mindspore.Tensor", "dtype": _safe(lambda: dtype_name(t.dtype)),
                                   "shape": _safe(lambda: [int(s) for s in t.shape]), **NO_STATS,
                                   "requires_grad": bool(_safe(lambda: requires_grad(t))),
                                   "summary": f"unsupported: {reason}"}
        if self.md5:
            summary["md5"] = None
        return summary

    # ------------------------------------------------------------------ device statistics
    def _rows_to_host(self, pending: list) -> list:
        """One transfer per dtype for all pending device statistics."""
        return tensor_stats.rows_to_host([row for _, row, _, _ in pending])

    def _checksums(self, pending: list) -> None:
        for summary, t in pending:
            summary["md5"] = tensor_stats.array_crc32(tensor_stats.host_array(t, read_pointer=False))


def _safe(read: Any) -> Any:
    """``read()``, or None where the tensor cannot answer."""
    try:
        return read()
    except Exception:
        return None


def describe_value(obj: Any) -> dict:
    """A non-tensor argument as msprobe writes it: ``{"type": ..., "value": ...}`` (``dump.summarize``'s,
    with NumPy scalars and MindSpore's dtypes)."""
    return core.describe_value(obj, _mindspore_value)


def _mindspore_value(obj: Any) -> Optional[dict]:
    if isinstance(obj, np.integer):
        return {"type": "int", "value": int(obj)}
    if isinstance(obj, np.floating):
        return {"type": "float", "value": float(obj)}
    if isinstance(obj, ms.dtype.Type):
        return {"type": "mindspore.dtype", "value": dtype_name(obj)}
    return None


def tensors_in(obj: Any) -> list:
    """Tensors inside a nested structure (lists, tuples, dicts), in the order the structure lists them."""
    return core.tensors_in(obj, Tensor)
