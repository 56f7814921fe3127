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

from typing import Any, Sequence

import torch

from msprobe_core.pytorch.tensor_stats import batched_stats

_NAN_PROXIES = ("min", "max", "norm", "mean")
PARTIAL_FIELDS = ("sum", "sumsq", "min", "max", "nans", "zeros", "numel")
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
        if not (self._lazy_nans and tensors[0].device.type == "cpu"):
            return batched_stats(tensors, self.ops, self.eps)
        rest = batched_stats(tensors, self._other_ops, self.eps)
        finite = torch.isfinite(rest[:, self._proxy_cols]).all(dim=1)
        nans = torch.zeros((len(tensors), 1), dtype=rest.dtype)
        bad = (~finite).nonzero().flatten().tolist()  # CPU: no device sync involved
        if bad:
            nans[bad, 0] = batched_stats([tensors[i] for i in bad], ("nans",), self.eps)[:, 0]
        j = self._nans_at
        return torch.cat([rest[:, :j], nans, rest[:, j:]], dim=1)


@torch.no_grad()
def shard_partials(engine: StatsEngine, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-shard partial statistics, float64 [n, 7] in ``PARTIAL_FIELDS`` order, on the shards' device.

    Empty shards (a rank that holds no piece of a tensor) contribute nothing: sum 0, min +inf, max -inf.
    """
    device = shards[0].device if shards else torch.device("cpu")
    if not shards:
        return torch.empty((0, len(PARTIAL_FIELDS)), dtype=torch.float64, device=device)
    numel = torch.tensor([float(s.numel()) for s in shards], dtype=torch.float64, device=device)
    nonempty = [i for i, s in enumerate(shards) if s.numel() > 0]
    stats = torch.zeros((len(shards), len(_PARTIAL_OPS)), dtype=torch.float64, device=device)
    stats[:, 0] = float("inf")
    stats[:, 1] = float("-inf")
    if nonempty:
        sub = StatsEngine(_PARTIAL_OPS, engine.eps).compute([shards[i] for i in nonempty]).to(torch.float64)
        stats[nonempty] = sub
    col = {op: i for i, op in enumerate(_PARTIAL_OPS)}
    return torch.stack([
        stats[:, col["mean"]] * numel,
        stats[:, col["norm"]] ** 2,
        stats[:, col["min"]],
        stats[:, col["max"]],
        stats[:, col["nans"]],
        stats[:, col["zeros"]] * numel,
        numel,
    ], dim=1)


def combine_partials(partials: torch.Tensor | Sequence[torch.Tensor], group: Any = None) -> torch.Tensor:
    """Combine partial statistics of the same tensors held by several shards.

    ``partials`` is either this rank's [n, 7] block, all-reduced over ``group`` (every rank must call
    with the same rows in the same order), or a sequence of blocks combined locally (one per shard).
    Returns one [n, 7] float64 block of full-tensor partials.
    """
    if not isinstance(partials, torch.Tensor):
        blocks = torch.stack(list(partials))
        out = blocks.sum(dim=0)
        out[:, 2] = blocks[:, :, 2].amin(dim=0)
        out[:, 3] = blocks[:, :, 3].amax(dim=0)
        return _nan_minmax(out)
    out = partials.clone()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        sums = out[:, [0, 1, 4, 5, 6]].contiguous()
        extremes = torch.stack([-out[:, 2], out[:, 3]], dim=1).contiguous()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        out[:, [0, 1, 4, 5, 6]] = sums
        out[:, 2] = -extremes[:, 0]
        out[:, 3] = extremes[:, 1]
    return _nan_minmax(out)


def _nan_minmax(out: torch.Tensor) -> torch.Tensor:
    has_nan = out[:, 4] > 0
    out[:, 2] = torch.where(has_nan, torch.full_like(out[:, 2], float("nan")), out[:, 2])
    out[:, 3] = torch.where(has_nan, torch.full_like(out[:, 3], float("nan")), out[:, 3])
    return out


def partials_to_ops(partials: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """Full-tensor statistics in ``ops`` order (float32 [n, len(ops)]) from combined partials."""
    numel = partials[:, 6]
    safe = torch.where(numel > 0, numel, torch.ones_like(numel))
    empty = torch.full_like(numel, float("nan"))
    columns = {
        "min": torch.where(numel > 0, partials[:, 2], empty),
        "max": torch.where(numel > 0, partials[:, 3], empty),
        "norm": partials[:, 1].clamp_min(0).sqrt(),
        "mean": torch.where(numel > 0, partials[:, 0] / safe, empty),
        "zeros": torch.where(numel > 0, partials[:, 5] / safe, torch.zeros_like(numel)),
        "nans": partials[:, 4],
    }
    return torch.stack([columns[op] for op in ops], dim=1).to(torch.float32)
