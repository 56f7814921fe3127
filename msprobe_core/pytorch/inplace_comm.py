"""``torch.distributed`` calls that write into tensors they are given: which argument, and whether the
result is there when the call returns.

``all_reduce(t)`` returns None (or a ``Work``) and leaves its result in ``t``; the dump records the written
tensors as the call's ``output``, so a NaN arriving from another rank is seen in the call itself. c10d's
in-place collectives do not bump the tensor's version counter (torch 2.13), so the statistics the dump
caches per tensor version must be dropped for that memory (``Summarizer.forget``). With ``async_op=True``
(and ``irecv`` / ``batch_isend_irecv``, always asynchronous) the values arrive only at ``wait()``: such a
call records no output.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

# API -> the parameter the call writes into
WRITTEN_PARAMETER: dict[str, str] = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "scatter": "tensor", "recv": "tensor",
    "irecv": "tensor", "all_reduce_coalesced": "tensors", "all_gather": "tensor_list",
    "all_gather_into_tensor": "output_tensor", "_all_gather_base": "output_tensor", "reduce_scatter": "output",
    "reduce_scatter_tensor": "output", "_reduce_scatter_base": "output", "all_to_all": "output_tensor_list",
    "all_to_all_single": "output", "gather": "gather_list", "batch_isend_irecv": "p2p_op_list",
}
ALWAYS_ASYNC = frozenset({"irecv", "batch_isend_irecv"})

_SIGNATURES: dict[str, Optional[inspect.Signature]] = {}


def _arguments(api: str, original: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    sig = _SIGNATURES.get(api, False)
    if sig is False:
        try:
            sig = inspect.signature(original)
        except (TypeError, ValueError):
            sig = None
        _SIGNATURES[api] = sig
    if sig is None:
        return dict(kwargs)
    try:
        return sig.bind_partial(*args, **kwargs).arguments
    except TypeError:  # a call torch itself will refuse
        return {}


def written_tensors(api: str, original: Callable, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """``(what the call writes, asynchronous?)``: a tensor or list of tensors (None for an API that writes
    nothing), and whether the values arrive only later (``async_op=True``, ``irecv``...)."""
    parameter = WRITTEN_PARAMETER.get(api)
    if parameter is None:
        return None, False
    bound = _arguments(api, original, args, kwargs)
    target = bound.get(parameter)
    if api == "batch_isend_irecv":  # the receiving operations' tensors
        target = [op.tensor for op in target or () if getattr(op.op, "__name__", "") == "irecv"]
    return target, api in ALWAYS_ASYNC or bool(bound.get("async_op", False))
