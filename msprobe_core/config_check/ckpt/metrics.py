"""L2 distance and cosine similarity of two tensors, in float64, chunk by chunk.

``l2 = ||a - b||_2`` and ``cos = <a, b> / (||a||_2 ||b||_2)``. Tensors of one dtype that are equal
(``torch.equal``: one pass, no conversion) give exactly ``l2 = 0`` and ``cos = 1``. Otherwise each chunk
is converted into reused float64 buffers (a bf16/fp32 pair compares by value, the sums keep their digits,
and no memory is allocated per chunk) and four dot products are taken; the extra memory is three chunks
whatever the tensor's size. A cosine with an all-zero side is ``None`` (undefined).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

CHUNK = 1 << 22
_buffers: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None


def _scratch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    global _buffers
    if _buffers is None:
        _buffers = tuple(torch.empty(CHUNK, dtype=torch.float64) for _ in range(3))
    return _buffers


def similarity(a: torch.Tensor, b: torch.Tensor) -> tuple[float, Optional[float]]:
    """``(l2, cos)`` of two tensors with the same number of elements."""
    x_all, y_all = a.detach().reshape(-1), b.detach().reshape(-1)
    if x_all.dtype == y_all.dtype and torch.equal(x_all, y_all):
        return 0.0, 1.0
    bx, by, bd = _scratch()
    dot = xx = yy = dd = 0.0
    for start in range(0, x_all.numel(), CHUNK):
        x = bx[:min(CHUNK, x_all.numel() - start)]
        y, d = by[:x.numel()], bd[:x.numel()]
        x.copy_(x_all[start:start + CHUNK])
        y.copy_(y_all[start:start + CHUNK])
        torch.sub(x, y, out=d)
        dot += float(torch.dot(x, y))
        xx += float(torch.dot(x, x))
        yy += float(torch.dot(y, y))
        dd += float(torch.dot(d, d))
    l2 = math.sqrt(dd)
    if dd == 0.0:
        return 0.0, 1.0
    if xx == 0.0 or yy == 0.0 or not math.isfinite(dot):
        return l2, None
    return l2, max(-1.0, min(1.0, dot / math.sqrt(xx * yy)))
