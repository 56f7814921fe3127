"""Statistics and a hash per tensor: what the weights and dataset checks record and compare.

Statistics (max, min, mean, L2 norm) are computed on the tensor's device for all tensors of a call and
brought to the host in one transfer per device. The hash (``pack.HASH_ALGORITHM`` over dtype, shape and
the raw bytes) needs the bytes on the host: device tensors are copied once each. Both only read the
tensors (no autograd, no in-place change, no random numbers), so training is unchanged.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from msprobe_core.config_check.pack import HASH_ALGORITHM

STATS = ("max", "min", "mean", "norm")


def _torch():
    import torch

    return torch


def is_tensor(value: Any) -> bool:
    torch = _torch()
    return isinstance(value, torch.Tensor)


def _hash(dtype: str, shape: tuple, data: memoryview | bytes) -> str:
    h = hashlib.new(HASH_ALGORITHM)
    h.update(f"{dtype}|{shape}|".encode())
    h.update(data)
    return h.hexdigest()


def torch_digests(named: Iterable[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{name: {"dtype", "shape", "max", "min", "mean", "norm", "hash"}}`` for torch tensors."""
    torch = _torch()
    out: dict[str, dict[str, Any]] = {}
    pending: dict[Any, list[tuple[str, Any]]] = {}
    with torch.no_grad():
        for name, tensor in named:
            t = tensor.detach()
            entry: dict[str, Any] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
            out[name] = entry
            if t.is_sparse or t.device.type == "meta" or not hasattr(t, "untyped_storage"):
                entry["hash"] = None
                continue
            flat = t.contiguous().reshape(-1)
            entry["hash"] = _hash(entry["dtype"], tuple(t.shape), flat.view(torch.uint8).cpu().numpy().data)
            if flat.numel() == 0 or t.is_complex():
                continue
            x = flat.to(torch.float64) if not t.is_floating_point() else flat if flat.dtype in (
                torch.float32, torch.float64) else flat.to(torch.float32)
            row = torch.stack([x.max(), x.min(), x.mean(), torch.linalg.vector_norm(x)]).to(torch.float64)
            pending.setdefault(t.device, []).append((name, row))
        for rows in pending.values():
            values = torch.stack([r for _, r in rows]).cpu().tolist()
            for (name, _), stats in zip(rows, values):
                out[name].update(zip(STATS, stats))
    return out


def numpy_digests(named: Iterable[tuple[str, np.ndarray]]) -> dict[str, dict[str, Any]]:
    """The same record for host arrays (MindSpore tensors arrive here through ``asnumpy()``)."""
    out: dict[str, dict[str, Any]] = {}
    for name, array in named:
        a = np.ascontiguousarray(array)
        entry: dict[str, Any] = {"dtype": str(a.dtype), "shape": list(a.shape),
                                 "hash": _hash(str(a.dtype), tuple(a.shape), a.reshape(-1).view(np.uint8).data)}
        if a.size and np.issubdtype(a.dtype, np.number) and not np.iscomplexobj(a):
            x = a.astype(np.float64, copy=False)
            entry.update(zip(STATS, (float(x.max()), float(x.min()), float(x.mean()), float(np.linalg.norm(x)))))
        out[name] = entry
    return out


def leaves(prefix: str, value: Any, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of nested args/kwargs (tuples, lists, dicts, BatchEncoding)."""
    if depth > 6:
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from leaves(f"{prefix}.{key}", item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from leaves(f"{prefix}.{i}", item, depth + 1)
    else:
        yield prefix, value
