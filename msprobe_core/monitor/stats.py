"""Statistics of many tensors at once on their device (``StatsEngine``).

Every number goes through ``msprobe_core.pytorch.tensor_stats.batched_stats``. ``StatsEngine.compute``
skips the NaN count where it is provably zero: a tensor whose min, max, norm or mean is finite holds no
NaN (each of them propagates NaN), so on the CPU, where reading a few numbers back costs nothing, the NaN
count is only computed for rows where one of those is not finite. The result is exact. On accelerators
the count is computed with the rest (no host sync). Statistics of sharded tensors: ``shard_stats``.

``StatsEngine.host_row`` is the per-tensor path for CPU tensors the one-pass kernel reads: host floats
straight from the kernel, no tensor made (the monitor calls it thousands of times a step).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Sequence

import torch

from msprobe_core.pytorch.tensor_stats import (HOST_CODES, MONITOR_OPS, batched_stats, fast_cpu_stats, host_stats,
                                               raw_values, threads_for)
from msprobe_core.stats.kernel import KERNEL

_NAN_PROXIES = ("min", "max", "norm", "mean")
# the float types tensor_stats.host_stats hands the kernel without a conversion, with their dtype codes
_KERNEL_FLOATS = {dtype: HOST_CODES[dtype] for dtype in (torch.float32, torch.float64, torch.bfloat16)}


class StatsEngine:
    """Computes the configured ``ops`` for a list of same-device tensors: a float32 [n, len(ops)] tensor."""

    def __init__(self, ops: Sequence[str], eps: float):
        self.ops = tuple(ops)
        self.eps = float(eps)
        self._lazy_nans = "nans" in self.ops and any(op in self.ops for op in _NAN_PROXIES)
        self._other_ops = tuple(op for op in self.ops if op != "nans")
        self._nans_at = self.ops.index("nans") if "nans" in self.ops else -1
        self._proxy_cols = [self._other_ops.index(op) for op in _NAN_PROXIES if op in self._other_ops]
        self._count_eps = self.eps if "zeros" in self.ops else -1.0
        pick = tuple(MONITOR_OPS.index(op) for op in self.ops)
        self._project = (None if pick == tuple(range(len(MONITOR_OPS)))
                         else itemgetter(*pick) if len(pick) > 1 else lambda full: tuple(full[i] for i in pick))
        """``ops`` out of a row in ``MONITOR_OPS`` order (None: the same order)."""
        self.host_rows = fast_cpu_stats()
        """CPU tensors are summarised on the host by the one-pass kernel (``host_row``)."""

    def host_row(self, t: torch.Tensor) -> tuple[float, ...] | None:
        """The statistics of one non-empty CPU tensor as host floats in ``ops`` order (float64; the same
        numbers ``compute`` gives before its float32 rounding), read by the one-pass kernel; None where the
        kernel does not apply (no kernel, another device, a subclass, ...). Called once per tensor: a dense
        float CPU tensor goes straight to the kernel, anything else through ``host_stats``."""
        code = _KERNEL_FLOATS.get(t.dtype)
        if code is not None and raw_values(t) and not t._is_zerotensor():
            n = t.numel()
            h = KERNEL.stats(t.data_ptr(), n, code, self._count_eps, threads_for(n))
        else:
            h = host_stats(t, self._count_eps)
            if h is None:
                return None
            n = t.numel()
        mx, mn, total, sumsq, zeros, nans = h
        full = (mn, mx, sumsq ** 0.5, total / n, zeros / n, nans)  # MONITOR_OPS order
        return full if self._project is None else self._project(full)

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
