"""Tensors the dump cannot summarise, told apart before anything reads their memory.

A meta tensor has no data (models built with ``torch.device("meta")`` for deferred initialisation),
sparse and nested tensors have no single dense buffer, quantized tensors hold integers with a scale,
fake and functional tensors exist while ``torch.compile`` traces, an uninitialised parameter (lazy
modules) has no shape yet, and a tensor on a device the tool does not know may be lazy (reading it would
cut the device's graph). Reading any of them for statistics fails or changes the program, so their
records say why they carry none (``"summary": "unsupported: meta tensor"``) and the user's code runs on.

``unsupported_reason`` tells them apart with a handful of attribute reads; the dump's summaries first
test the few that single out a dense plain CPU or GPU tensor (``PLAIN_TYPES``, ``QUANTIZED_DTYPES``) and
call it only for the rest.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
QUANTIZED_DTYPES = frozenset(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                             if hasattr(torch, n))
_strided = torch.strided
KNOWN_DEVICES = frozenset({"cpu", "cuda", "npu", "xpu", "mps", "hpu", "mtia", "musa"})
"""Devices whose tensors are summarised with torch's reductions; anything else is reported, not read."""

try:  # torch.compile's tracing tensors (present in every torch this project supports; guarded all the same)
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor as _FunctionalTensor
except ImportError:  # pragma: no cover
    _FakeTensor = _FunctionalTensor = ()  # type: ignore[assignment,misc]
_Uninitialized = getattr(torch.nn.parameter, "UninitializedTensorMixin", ())


def unsupported_reason(t: torch.Tensor) -> Optional[str]:
    """None for a tensor the dump summarises; otherwise why it does not (``"meta tensor"``,
    ``"sparse_coo tensor"``, ``"nested tensor"``, ``"quantized tensor"``, ``"fake tensor (torch.compile
    tracing)"``, ``"tensor on device 'xla'"``, ...)."""
    if type(t) in PLAIN_TYPES and t.layout is _strided and not t.is_nested and not t.is_quantized:
        if t.is_cpu or t.is_cuda:
            return None
        return _device_reason(t)
    try:
        return _odd_reason(t)
    except Exception as e:  # a tensor type that cannot even answer these questions
        return f"{type(t).__name__} the tool cannot read ({type(e).__name__})"


def _device_reason(t: torch.Tensor) -> Optional[str]:
    if t.is_meta:
        return "meta tensor"
    device = t.device.type
    return None if device in KNOWN_DEVICES else f"tensor on device '{device}'"


def _odd_reason(t: torch.Tensor) -> Optional[str]:
    if isinstance(t, _Uninitialized):
        return "uninitialized parameter (lazy module)"
    if isinstance(t, _FakeTensor):
        return "fake tensor (torch.compile tracing)"
    if isinstance(t, _FunctionalTensor):
        return "functional tensor (torch.compile tracing)"
    if t.is_nested:
        return "nested tensor"
    if t.is_quantized:
        return "quantized tensor"
    if t.layout is not _strided:
        return f"{str(t.layout).replace('torch.', '')} tensor"
    return _device_reason(t)  # another subclass: summarised like its device's tensors


def known_shape(t: torch.Tensor) -> Optional[list[Any]]:
    """``t``'s shape as JSON values (a symbolic size as its text), or None where it has none."""
    try:
        return [s if type(s) is int else str(s) for s in t.shape]
    except Exception:  # nested tensors, uninitialised parameters
        return None
