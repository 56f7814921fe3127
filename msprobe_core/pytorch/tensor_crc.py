"""CRC of a tensor: msprobe's ``md5`` field (``summary_mode: md5``) is the CRC-32 of the tensor's bytes."""

from __future__ import annotations

import torch

from msprobe_core.common.crc32 import crc32
from msprobe_core.pytorch.tensor_stats import host_bytes

_contiguous = torch.Tensor.contiguous
_view = torch.Tensor.view


def tensor_crc32(t: torch.Tensor) -> str:
    """CRC-32 of a CPU tensor's bytes (row-major contiguous), as 8 hex digits (msprobe's "md5" field)."""
    if t.numel() == 0:
        return "00000000"
    raw = host_bytes(t)
    if raw is None:
        x = _contiguous(t.detach())
        if x.is_neg() or x.is_conj():
            x = x.resolve_neg().resolve_conj()
        raw = _view(x.reshape(-1), torch.uint8).numpy()
    return "%08x" % (crc32(raw) & 0xFFFFFFFF)
