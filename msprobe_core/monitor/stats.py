"""Statistics of many tensors at once on their device (``StatsEngine``).

Every number goes through ``msprobe_core.pytorch.tensor_stats.batched_stats``. ``StatsEngine.compute``
skips the NaN count where it is provably zero: a tensor whose min, max, norm or mean is finite holds no
NaN (each of them propagates NaN), so on the CPU, where reading a few numbers back costs nothing, the NaN
count is only computed for rows where one of those is not finite. The result is exact. On accelerators
the count is computed with the rest (no host sync). Statistics of sharded tensors: ``shard_stats``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from msprobe_core.pytorch.tensor_stats import batched_stats, fast_cpu_stats

_NAN_PROXIES = ("min", "max", "norm", "mean")


class StatsEngine:
    """Computes the configured ``ops`` for a list of same-device tensors: a float32 [n, len(ops)] tensor."""

    def __init__(self, ops: Sequence[str], eps: float):
        self.ops = tuple(ops)
        self.eps = float(eps)
        self._lazy_nans = "nans" in self.ops and any(op in self.ops for op in _NAN_PROXIES)
        self._other_ops = tuple(op for op in self.ops if op != "nans")
        self._nans_at = self.ops.index("nans") if "nans" in self.ops else -1
        self._proxy_cols = [self._other_ops.index(op) for op in _NAN_PROXIES if op in self._other_ops]

    @torch.no_grad()
    def compute(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Statistics of ``tensors`` (all on one device, none empty), in ``ops`` order, on that device."""
        if not tensors:
            return torch.empty((0, len(self.ops)), dtype=torch.float32)
        if not (self._lazy_nans and tensors[0].device.type == "cpu") or fast_cpu_stats():
            # the one-pass CPU kernel counts NaNs for free
            return batched_stats(tensors, self.ops, self.eps)
        rest = batched_stats(tensors, self._other_ops, self.eps)
        nans = torch.zeros((len(tensors), 1), dtype=rest.dtype)
        proxies = rest[:, self._proxy_cols]
        if not bool(torch.isfinite(proxies).all()):  # CPU: reading the flag back costs no device sync
            bad = (~torch.isfinite(proxies).all(dim=1)).nonzero().flatten().tolist()
            nans[bad, 0] = batched_stats([tensors[i] for i in bad], ("nans",), self.eps)[:, 0]
        j = self._nans_at
        return torch.cat([rest[:, :j], nans, rest[:, j:]], dim=1)
