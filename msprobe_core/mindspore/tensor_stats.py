"""Max, Min, Sum and sum of squares of MindSpore tensors, without the kernels MindSpore's CPU backend lacks.

- Host memory (the CPU backend): one read of the tensor's memory, found by its address and strides (no
  MindSpore kernel runs, not even for a transposed view), by the core's statistics kernel
  (``msprobe_core.stats.kernel``), or by NumPy without it.
- Device memory (Ascend, GPU): four reductions stacked into one small device tensor per tensor; the caller
  copies many of them to the host in one transfer (no host sync per tensor).

Norm is ``sqrt(sum(x * x))`` on either path, never ``LinalgVectorNorm``: ``mint.norm`` and
``mint.linalg.vector_norm`` have no CPU kernel (msprobe 26.2's own MindSpore dump crashes on CPU there and
writes an empty dump.json). Every MindSpore function used here is captured at import, before any API is
wrapped, so the tool's own work never goes through (or shows up in) its wrappers.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Optional

import numpy as np
import mindspore as ms
from mindspore import ops

from msprobe_core.common.crc32 import crc32
from msprobe_core.mindspore.runtime import MS_VERSION, Tensor, numel
from msprobe_core.stats.kernel import KERNEL

Stats = tuple  # (max, min, sum, sum of squares) as host floats

_NP_CODES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int64): 3, np.dtype(np.int32): 4,
             np.dtype(np.int16): 5, np.dtype(np.int8): 6, np.dtype(np.uint8): 7, np.dtype(np.bool_): 8}
_np_dtypes: dict[Any, np.dtype] = {}
# MindSpore 2.10 gives every CPU tensor a host address; older releases have none for tensors made from NumPy
# (and log an error when asked), so they are read through ``asnumpy``.
_READ_POINTERS = MS_VERSION >= (2, 10)

_stack = ops.stack
_mul = ops.mul
_isfinite = ops.isfinite
_astype = Tensor.astype
_asnumpy = Tensor.asnumpy
_t_max = Tensor.max
_t_min = Tensor.min
_t_sum = Tensor.sum
_t_all = Tensor.all
_t_any = Tensor.any
_as_strided = np.lib.stride_tricks.as_strided


def _np_dtype(dtype: Any) -> Optional[np.dtype]:
    """The NumPy dtype of a MindSpore dtype (bfloat16: the one ``asnumpy`` gives, ml_dtypes')."""
    if not _np_dtypes:
        _np_dtypes.update({getattr(ms, name): np.dtype(name) for name in (
            "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
            "uint64", "complex64", "complex128")})
        _np_dtypes[ms.bool_] = np.dtype(np.bool_)
        _np_dtypes[ms.bfloat16] = _asnumpy(Tensor(np.zeros(1, np.float32)).astype(ms.bfloat16)).dtype
    return _np_dtypes.get(dtype)


def kind_of(dtype: Any) -> str:
    """How a dtype is summarised: 'float', 'int', 'bool' or 'complex'."""
    if dtype == ms.bool_:
        return "bool"
    if dtype in _COMPLEX:
        return "complex"
    return "float" if dtype in _FLOATS else "int"


_FLOATS = (ms.float16, ms.float32, ms.float64, ms.bfloat16)
_COMPLEX = (ms.complex64, ms.complex128)


def host_array(t: Tensor, read_pointer: bool = True) -> np.ndarray:
    """The tensor's values as a NumPy array, without a copy on the CPU backend: a view of the tensor's own
    memory with its shape and strides (no MindSpore kernel runs, also for transposed or sliced views), or
    ``asnumpy`` where MindSpore gives no host address. bfloat16 comes as ml_dtypes' bfloat16. Read it while
    ``t`` lives; never write to it. ``read_pointer``: ``data_ptr`` is MindSpore's (mindtorch replaces it)."""
    if read_pointer and _READ_POINTERS:
        view = _memory_view(t)
        if view is not None:
            return view
    return _asnumpy(t)


def _memory_view(t: Tensor) -> Optional[np.ndarray]:
    dtype = _np_dtype(t.dtype)
    if dtype is None:
        return None
    address = t.data_ptr()
    if not address:
        return None
    shape = tuple(t.shape)
    if t.is_contiguous():
        count = numel(t)
        return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(address), dtype, count).reshape(shape)
    strides = tuple(t.stride())
    if 0 in shape or min(strides, default=0) < 0:
        return None
    extent = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
    flat = np.frombuffer((ctypes.c_char * (extent * dtype.itemsize)).from_address(address), dtype, extent)
    return _as_strided(flat, shape, tuple(s * dtype.itemsize for s in strides), writeable=False)


def host_stats(t: Tensor, read_pointer: bool = True) -> Stats:
    """Statistics of a non-empty tensor in host memory, read from its memory once."""
    return array_stats(host_array(t, read_pointer))


def array_stats(a: np.ndarray) -> Stats:
    """Statistics of a non-empty NumPy array (bools: any, all, count, count), by the statistics kernel in
    one read where it applies: a contiguous array, or a permutation of one (a transposed view: the same
    elements, so the same statistics); else one contiguous copy first."""
    if a.dtype.kind == "c":
        a = np.abs(a)
    code = 2 if a.dtype.name == "bfloat16" else _NP_CODES.get(a.dtype)  # (ml_dtypes' bfloat16)
    if code is None and a.dtype.kind == "f" and a.dtype.itemsize == 2:  # float16
        a, code = a.astype(np.float32), 0
    if KERNEL is not None and code is not None:
        if not (a.flags.c_contiguous or _dense(a)):
            a = np.ascontiguousarray(a)
        return KERNEL.stats(a.ctypes.data, a.size, code, -1.0, 1)[:4]
    if a.dtype == np.bool_:
        n = float(np.count_nonzero(a))
        return float(a.any()), float(a.all()), n, n
    if a.dtype.kind != "f" or a.dtype.itemsize == 2:
        a = a.astype(np.float64 if a.dtype.kind in "iub" else np.float32)
    flat = a.ravel()
    return float(flat.max()), float(flat.min()), float(flat.sum(dtype=np.float64)), float(np.dot(flat, flat))


def _dense(a: np.ndarray) -> bool:
    """Do ``a``'s elements fill the memory from its first element on without gaps (positive strides whose
    extent is its size)?"""
    if a.size == 0 or min(a.strides, default=0) <= 0:
        return False
    return sum((d - 1) * s for d, s in zip(a.shape, a.strides)) == (a.size - 1) * a.itemsize


def device_stats(t: Tensor, kind: str) -> Tensor:
    """(max, min, sum, sum of squares) of a non-empty tensor as one 4-element tensor on its device, with no
    host sync; the caller stacks many and copies them at once (``rows_to_host``)."""
    if kind == "bool":
        x = _astype(t, ms.float32)
        return _stack([_t_any(t).astype(ms.float32), _t_all(t).astype(ms.float32), _t_sum(x), _t_sum(x)])
    x = t if t.dtype in (ms.float32, ms.float64) else _astype(t, ms.float32)
    return _stack([_t_max(x), _t_min(x), _t_sum(x), _t_sum(_mul(x, x))])


def rows_to_host(rows: list[Tensor]) -> list[Stats]:
    """Host values of many ``device_stats`` results: one stack and one copy per dtype."""
    out: list[Stats] = [()] * len(rows)
    by_dtype: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        by_dtype.setdefault(row.dtype, []).append(i)
    for idxs in by_dtype.values():
        values = _asnumpy(_stack([rows[i] for i in idxs])).tolist()
        for i, v in zip(idxs, values):
            out[i] = tuple(v)
    return out


def overflowed(stats: Stats) -> bool:
    """Does a tensor with these statistics hold an Inf or a NaN (Max and Min then are not finite)?"""
    return not (math.isfinite(stats[0]) and math.isfinite(stats[1]))


def device_all_finite(t: Tensor) -> Tensor:
    """A 0-dim bool tensor on ``t``'s device: are all of its values finite?"""
    return _t_all(_isfinite(t))


def array_crc32(a: np.ndarray) -> str:
    """CRC-32 of an array's bytes in row-major order, as 8 hex digits (msprobe's ``md5`` field)."""
    if a.size == 0:
        return "00000000"
    return "%08x" % (crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) & 0xFFFFFFFF)
