"""Statistics of many tensors at once on their device, and the shard combine helper for sharded states.

Every number goes through ``msprobe_core.pytorch.tensor_stats.batched_stats``. Two things are added:

* ``StatsEngine.compute`` skips the NaN count where it is provably zero. A tensor whose min, max, norm
  or mean is finite holds no NaN (each of them propagates NaN), so on the CPU, where reading a few
  numbers back costs nothing, the NaN count is only computed for rows where one of those is not
  finite. The result is exact. On accelerators the count is computed with the rest (no host sync).
* ``shard_partials`` / ``combine_partials`` / ``partials_to_ops``: statistics of a tensor split over the
  ranks of a data-parallel group (DeepSpeed ZeRO, Megatron's distributed optimizer) from per-shard
  scalars (sum, sum of squares, min, max, NaN count, zero count, numel) all-reduced over the group.
  An adapter supplies its rank's shards and gets the statistics of the full tensors, without gathering.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from msprobe_core.pytorch.tensor_stats import batched_stats, fast_cpu_stats

_NAN_PROXIES = ("min", "max", "norm", "mean")
PARTIAL_FIELDS = ("sum", "sumsq", "nans", "zeros", "numel", "min", "max")
_SUMMED = 5  # the first five fields add up over shards; min and max reduce with min / max
_PARTIAL_OPS = ("min", "max", "norm", "mean", "zeros", "nans")


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


@torch.no_grad()
def shard_partials(engine: StatsEngine, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-shard partial statistics, float64 [n, 7] in ``PARTIAL_FIELDS`` order, on the shards' device.

    Empty shards (a rank that holds no piece of a tensor) contribute nothing: sum 0, min +inf, max -inf.
    Pure device work: no host synchronisation.
    """
    if not shards:
        return torch.empty((0, len(PARTIAL_FIELDS)), dtype=torch.float64)
    device = shards[0].device
    stats = StatsEngine(_PARTIAL_OPS, engine.eps).compute(list(shards)).to(torch.float64)
    numel = torch.tensor([float(s.numel()) for s in shards], dtype=torch.float64).to(device, non_blocking=True)
    col = {op: i for i, op in enumerate(_PARTIAL_OPS)}
    present = numel > 0
    zero = torch.zeros_like(numel)
    return torch.stack([
        torch.where(present, stats[:, col["mean"]] * numel, zero),
        stats[:, col["norm"]] ** 2,
        stats[:, col["nans"]],
        torch.where(present, stats[:, col["zeros"]] * numel, zero),
        numel,
        torch.where(present, stats[:, col["min"]], torch.full_like(numel, math.inf)),
        torch.where(present, stats[:, col["max"]], torch.full_like(numel, -math.inf)),
    ], dim=1)


def combine_partials(partials: torch.Tensor | Sequence[torch.Tensor], group: Any = None) -> torch.Tensor:
    """Combine partial statistics of the same tensors held by several shards.

    ``partials`` is either this rank's [n, 7] block, all-reduced over ``group`` (every rank must call
    with the same rows in the same order), or a sequence of blocks combined locally (one per shard).
    Returns one [n, 7] float64 block of full-tensor partials (two all-reduces, no host sync).
    """
    if not isinstance(partials, torch.Tensor):
        blocks = torch.stack(list(partials))
        sums = blocks[:, :, :_SUMMED].sum(dim=0)
        lo = blocks[:, :, _SUMMED].amin(dim=0)
        hi = blocks[:, :, _SUMMED + 1].amax(dim=0)
        return _nan_minmax(torch.cat([sums, lo[:, None], hi[:, None]], dim=1))
    import torch.distributed as dist

    sums = partials[:, :_SUMMED].contiguous()
    extremes = torch.stack([-partials[:, _SUMMED], partials[:, _SUMMED + 1]], dim=1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    return _nan_minmax(torch.cat([sums, -extremes[:, :1], extremes[:, 1:]], dim=1))


def _nan_minmax(out: torch.Tensor) -> torch.Tensor:
    """min and max are NaN where any shard held a NaN (a MAX all-reduce does not propagate NaN reliably)."""
    nan = torch.full_like(out[:, 0], math.nan)
    has_nan = out[:, 2] > 0
    out[:, _SUMMED] = torch.where(has_nan, nan, out[:, _SUMMED])
    out[:, _SUMMED + 1] = torch.where(has_nan, nan, out[:, _SUMMED + 1])
    return out


def partials_to_ops(partials: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """Full-tensor statistics in ``ops`` order (float32 [n, len(ops)]) from combined partials."""
    numel = partials[:, 4]
    present = numel > 0
    safe = torch.where(present, numel, torch.ones_like(numel))
    empty = torch.full_like(numel, math.nan)
    columns = {
        "min": torch.where(present, partials[:, _SUMMED], empty),
        "max": torch.where(present, partials[:, _SUMMED + 1], empty),
        "norm": partials[:, 1].clamp_min(0).sqrt(),
        "mean": torch.where(present, partials[:, 0] / safe, empty),
        "zeros": torch.where(present, partials[:, 3] / safe, torch.zeros_like(numel)),
        "nans": partials[:, 2],
    }
    return torch.stack([columns[op] for op in ops], dim=1).to(torch.float32)
