"""Tensor statistics computed on the tensor's own device, shared by the dump service and the monitor.

Nothing here moves data to the host: each function returns small device tensors that callers stack and
copy once per record (dump) or once per step (monitor). All work runs under ``torch.no_grad()`` on
detached tensors, so autograd never sees it.
"""

from __future__ import annotations

from typing import Sequence

import torch

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

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def summary_kind(t: torch.Tensor) -> str:
    """How a tensor is summarised: 'float', 'int', 'bool', 'complex' or 'empty'."""
    if t.numel() == 0:
        return "empty"
    if t.dtype == torch.bool:
        return "bool"
    if t.is_complex():
        return "complex"
    if t.is_floating_point():
        return "float"
    return "int"


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


@torch.no_grad()
def has_inf_or_nan(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool device tensor: does ``t`` hold any Inf or NaN? (False for non-float tensors.)"""
    x = _tensor_detach(t)
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
    if not tensors:
        return torch.empty((0, len(ops)), dtype=torch.float32)
    xs = [_tensor_detach(t) for t in tensors]
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
        else:
            raise ValueError(f"unknown statistic '{op}'; allowed: {', '.join(MONITOR_OPS)}")
    return _stack([done[op] for op in ops], dim=1)
