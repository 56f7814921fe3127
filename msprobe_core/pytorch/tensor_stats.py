"""Tensor statistics computed on the tensor's own device, shared by the dump service and the monitor.

Nothing here moves data to the host: each function returns small device tensors that callers stack and
copy once per record (dump) or once per step (monitor). All work runs under ``torch.no_grad()`` on
detached tensors, so autograd never sees it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from msprobe_core.pytorch.odd_tensors import unsupported_reason
from msprobe_core.stats.kernel import KERNEL

# the optional one-pass CPU kernel (msprobe_core/stats/_fast_stats.c; None when not built or MSPROBE_FAST_STATS=0)
_fast_stats = KERNEL

# Captured at import, before any API patching, so that the tool's own tensor work never goes through
# (and is never recorded by) its own wrappers.
_amax = torch.amax
_amin = torch.amin
_vector_norm = torch.linalg.vector_norm
_stack = torch.stack
_isnan = torch.isnan
_isinf = torch.isinf
_tensor_mean = torch.Tensor.mean
_tensor_to = torch.Tensor.to
_tensor_abs = torch.Tensor.abs
_tensor_sum = torch.Tensor.sum
_tensor_any = torch.Tensor.any
_tensor_all = torch.Tensor.all
_tensor_detach = torch.Tensor.detach
_foreach_norm = torch._foreach_norm

_tensor_contiguous = torch.Tensor.contiguous

# reduced in float32: half precision, and the float8 formats torch has no CPU reductions for
_LOW_PRECISION = (torch.float16, torch.bfloat16) + tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))
HOST_CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.int64: 3, torch.int32: 4,
              torch.int16: 5, torch.int8: 6, torch.uint8: 7, torch.bool: 8}
"""The one-pass C kernel's code of each dtype it reads on the host."""
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_strided = torch.strided
_get_num_threads = torch.get_num_threads
_PARALLEL_MIN = 1 << 17


def threads_for(n: int) -> int:
    """Large buffers are split over torch's own intra-op threads (the kernel shares torch's OpenMP pool)."""
    return _get_num_threads() if n >= _PARALLEL_MIN else 1


def fast_cpu_stats() -> bool:
    """Is the one-pass C kernel in use for CPU tensors (built, and not turned off)?"""
    return _fast_stats is not None


def _kernel_reads(t: torch.Tensor) -> bool:
    """Can the C kernel read ``t``'s memory as its values: a dense plain CPU tensor without a lazy
    negation or an all-zero placeholder?"""
    return (_fast_stats is not None and t.is_cpu and type(t) in _PLAIN_TYPES and t.layout is _strided
            and not t.is_neg() and not t._is_zerotensor())


def raw_values(t: torch.Tensor) -> bool:
    """Does ``t``'s memory, read from its data pointer, hold its values in row-major order (a contiguous,
    dense, plain CPU tensor without a lazy negation or conjugation)?"""
    return raw_real_values(t) and not t.is_conj()


def raw_real_values(t: torch.Tensor) -> bool:
    """``raw_values`` of a tensor of a real dtype (which never carries a lazy conjugation)."""
    return (t.is_cpu and type(t) in _PLAIN_TYPES and t.layout is _strided and t.is_contiguous()
            and not t.is_neg() and not t._is_zerotensor())


def copy_host_stats(dst_address: int, t: torch.Tensor, eps: float = -1.0) -> Optional[tuple[float, ...]]:
    """Copy ``t``'s bytes to ``dst_address`` and return ``host_stats(t, eps)`` from the same single read
    (for tensors saved to files); ``None``, with nothing copied, where the kernel does not apply."""
    if _fast_stats is None or not raw_values(t):
        return None
    code = HOST_CODES.get(t.dtype)
    if code is None:
        return None
    n = t.numel()
    return _fast_stats.copy_stats(dst_address, t.data_ptr(), n, code, eps, threads_for(n))


def host_bytes(t: torch.Tensor) -> Optional[memoryview]:
    """The bytes of a contiguous dense CPU tensor as a read-only memoryview without any torch call (keep
    ``t`` alive while using it); ``None`` where that does not apply."""
    if _fast_stats is None or not raw_values(t):
        return None
    return _fast_stats.buffer(t.data_ptr(), t.numel() * t.element_size())


def host_stats(t: torch.Tensor, eps: float = -1.0) -> Optional[tuple[float, ...]]:
    """(max, min, sum, sum_of_squares, zeros, nans) of a non-empty dense CPU tensor as host floats, read in
    one pass by the C kernel; ``None`` where it does not apply (no kernel, another device, a subclass,
    complex, sparse, ...) and the caller uses torch's reductions. ``zeros`` counts |x| <= eps when
    ``eps >= 0``. For bool tensors max/min are any/all. Call under ``torch.no_grad()``."""
    if not _kernel_reads(t):
        return None
    code = HOST_CODES.get(t.dtype)
    if code is None:
        if t.dtype is not torch.float16:
            return None
        t, code = _tensor_to(t, torch.float32), 0
    if not t.is_contiguous():
        t = _tensor_contiguous(t)
    n = t.numel()
    return _fast_stats.stats(t.data_ptr(), n, code, eps, threads_for(n))


_KINDS: dict[torch.dtype, str] = {}


def summary_kind(t: torch.Tensor) -> str:
    """How a tensor is summarised: 'float', 'int', 'bool', 'complex' or 'empty'."""
    if t.numel() == 0:
        return "empty"
    dtype = t.dtype
    kind = _KINDS.get(dtype)
    if kind is None:
        kind = _KINDS[dtype] = ("bool" if dtype == torch.bool else "complex" if dtype.is_complex
                                else "float" if dtype.is_floating_point else "int")
    return kind


def summary_stats(t: torch.Tensor, kind: str) -> tuple[torch.Tensor, ...]:
    """(Max, Min, Sum, Norm) of ``t`` as 0-dim tensors on ``t``'s device (no host sync); Mean = Sum / numel.

    Float tensors are reduced in their own precision (float16/bfloat16 in float32), integers in float64;
    bools give (any, all) only; complex tensors are summarised by magnitude. Call under
    ``torch.no_grad()`` and only for non-empty tensors (``summary_kind(t) != 'empty'``). The caller
    stacks many of these at once and copies them to the host in one transfer.
    """
    x = t
    if kind == "bool":
        return _tensor_to(_tensor_any(x), torch.float64), _tensor_to(_tensor_all(x), torch.float64)
    if kind == "complex":
        x = _tensor_abs(x)
        if x.dtype in _LOW_PRECISION:
            x = _tensor_to(x, torch.float32)
    elif kind == "int":
        x = _tensor_to(x, torch.float64)
    elif x.dtype in _LOW_PRECISION:
        x = _tensor_to(x, torch.float32)
    # amax/amin are ~3x faster than aminmax/max/min on CPU (no index bookkeeping); both propagate NaN
    return _amax(x), _amin(x), _tensor_sum(x), _vector_norm(x)


def row_summary(rows: torch.Tensor) -> torch.Tensor:
    """``summary_stats`` of each row of ``rows`` (a non-empty 2-D float tensor, its rows the tensors): [rows, 4]
    (max, min, sum, norm) on its device, in five launches whatever the count of rows. Max and Min are exactly
    ``summary_stats``'; Sum and Norm are reduced in another order, so they may differ in the last bits."""
    return _stack((_amax(rows, dim=1), _amin(rows, dim=1), _tensor_sum(rows, dim=1), _vector_norm(rows, dim=1)), dim=1)


@torch.no_grad()
def has_inf_or_nan(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool device tensor: does ``t`` hold any Inf or NaN? (False for non-float tensors.)"""
    x = _tensor_detach(t)
    if unsupported_reason(x) is not None:  # a meta, sparse, fake... tensor: nothing to read (a CPU False)
        return torch.zeros((), dtype=torch.bool)
    if not (x.is_floating_point() or x.is_complex()) or x.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=x.device)
    return _tensor_any(~torch.isfinite(x))


MONITOR_OPS = ("min", "max", "norm", "mean", "zeros", "nans")


@torch.no_grad()
def batched_stats(tensors: Sequence[torch.Tensor], ops: Sequence[str], eps: float = 1e-8) -> torch.Tensor:
    """Statistics of many tensors at once: a float32 tensor [len(tensors), len(ops)] on their device.

    ``ops`` are taken from ``MONITOR_OPS``: min, max, L2 norm, mean, zeros (share of elements with
    |x| <= eps) and nans (count of NaN elements). Norms use ``torch._foreach_norm`` (one fused call for the
    whole list); each statistic is computed once even if asked twice; everything stays on the device and the
    caller copies the result to the host once. Empty tensors give NaN for min/max/mean and 0 for the rest.
    """
    for op in ops:
        if op not in MONITOR_OPS:
            raise ValueError(f"unknown statistic '{op}'; allowed: {', '.join(MONITOR_OPS)}")
    if not tensors:
        return torch.empty((0, len(ops)), dtype=torch.float32)
    rows = _host_rows(tensors, ops, eps)
    if rows is not None:
        return torch.tensor(rows, dtype=torch.float32)
    xs = [_readable(_tensor_detach(t)) for t in tensors]
    xs = [_tensor_to(x, torch.float32) if x.dtype != torch.float32 else x for x in xs]
    device = xs[0].device
    nan = torch.full((), float("nan"), device=device)
    zero = torch.zeros((), device=device)
    done: dict[str, torch.Tensor] = {}
    for op in ops:
        if op in done:
            continue
        if op in ("min", "max"):
            done["min"] = _stack([_amin(x) if x.numel() else nan for x in xs])
            done["max"] = _stack([_amax(x) if x.numel() else nan for x in xs])
        elif op == "norm":
            done[op] = _stack(_foreach_norm(xs))
        elif op == "mean":
            done[op] = _stack([_tensor_mean(x) if x.numel() else nan for x in xs])
        elif op == "zeros":
            # |x| <= eps written in place as 0./1. floats and summed (a bool tensor is far slower on CPU)
            counts = _stack([_tensor_sum(_tensor_abs(x).le_(eps)) if x.numel() else zero for x in xs])
            numel = torch.tensor([max(x.numel(), 1) for x in xs], dtype=torch.float32, device=device)
            done[op] = counts / numel
        elif op == "nans":
            done[op] = _tensor_to(_stack([torch.count_nonzero(_isnan(x)) for x in xs]), torch.float32)
    return _stack([done[op] for op in ops], dim=1)



@torch.no_grad()
def row_stats(rows: torch.Tensor, ops: Sequence[str], eps: float = 1e-8) -> torch.Tensor:
    """``batched_stats`` of each row of ``rows`` (a non-empty 2-D float32 tensor, its rows the tensors): a float32
    tensor [rows, len(ops)] on its device, in a fixed number of reductions along the rows whatever their count
    (``batched_stats`` makes a few per tensor). min, max, zeros and nans are exactly ``batched_stats``'; norm
    and mean are reduced in another order, so they may differ in the last bits."""
    done: dict[str, torch.Tensor] = {}
    for op in ops:
        if op in done:
            continue
        if op in ("min", "max"):
            done["min"], done["max"] = torch.aminmax(rows, dim=1)
        elif op == "norm":
            done[op] = _vector_norm(rows, dim=1)
        elif op == "mean":
            done[op] = rows.mean(dim=1)
        elif op == "zeros":
            done[op] = _tensor_to(torch.count_nonzero(_tensor_abs(rows) <= eps, dim=1), torch.float32) / rows.shape[1]
        elif op == "nans":
            done[op] = _tensor_to(torch.count_nonzero(_isnan(rows), dim=1), torch.float32)
        else:
            raise ValueError(f"unknown statistic '{op}'; allowed: {', '.join(MONITOR_OPS)}")
    return _stack([done[op] for op in ops], dim=1)

_NAN = float("nan")


def _readable(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a dense tensor with the same values, for the monitor's statistics: a sparse gradient
    (``nn.Embedding(sparse=True)``) densified, a quantized tensor dequantized, a nested tensor's
    components in one flat tensor. Meta, fake and other unreadable tensors are left as they are (their
    statistics fail, and the monitor reports it)."""
    if type(x) in _PLAIN_TYPES and x.layout is _strided and not x.is_nested and not x.is_quantized:
        return x
    if x.is_nested:
        parts = [c.reshape(-1) for c in x.unbind()]
        return torch.cat(parts) if parts else torch.empty(0, dtype=x.dtype, device=x.device)
    if x.is_quantized:
        return x.dequantize()
    if x.layout is not _strided:
        return x.to_dense()
    return x


def _host_rows(tensors: Sequence[torch.Tensor], ops: Sequence[str], eps: float) -> Optional[list[list[float]]]:
    """``batched_stats`` rows from the one-pass CPU kernel, or ``None`` if any tensor needs torch's path."""
    if _fast_stats is None:
        return None
    count_eps = float(eps) if "zeros" in ops else -1.0
    rows = []
    for t in tensors:
        n = t.numel()
        if n == 0:
            done = {"min": _NAN, "max": _NAN, "norm": 0.0, "mean": _NAN, "zeros": 0.0, "nans": 0.0}
        else:
            h = host_stats(t, count_eps)
            if h is None:
                return None
            mx, mn, total, sumsq, zeros, nans = h
            done = {"min": mn, "max": mx, "norm": sumsq ** 0.5, "mean": total / n, "zeros": zeros / n, "nans": nans}
        rows.append([done[op] for op in ops])
    return rows
