"""Statistics of tensors split over the ranks of a group, from per-shard scalars: no gather.

DeepSpeed ZeRO and Megatron's distributed optimizer keep each weight, gradient and optimizer state as
shards, one per data-parallel rank. ``shard_partials`` turns this rank's shards into partial statistics
(sum, sum of squares, NaN count, zero count, numel, min, max), ``combine_partials`` all-reduces them over
the group (two all-reduces of scalars) and ``partials_to_ops`` gives the statistics of the full tensors.
Which ranks take part in a step is ``msprobe_core.monitor.shard_agreement``'s business.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import torch

from msprobe_core.monitor.stats import StatsEngine

PARTIAL_FIELDS = ("sum", "sumsq", "nans", "zeros", "numel", "min", "max")
LOCAL = "local"
"""The group of a partial row that is already a whole tensor's (nothing to combine)."""
_SUMMED = 5  # the first five fields add up over shards; min and max reduce with min / max
_PARTIAL_OPS = ("min", "max", "norm", "mean", "zeros", "nans")


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


def combine_grouped(partials: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """``combine_partials`` of rows whose pieces add up over different process groups (``groups``: one per row,
    ``LOCAL`` for a whole tensor's row): two all-reduces per group, in the order of each group's first row (the
    same on every rank when every rank has the same rows)."""
    out = torch.empty_like(partials)
    by_group: dict[int, tuple[Any, list[int]]] = {}
    local: list[int] = []
    for i, g in enumerate(groups):
        if isinstance(g, str) and g == LOCAL:
            local.append(i)
        else:
            by_group.setdefault(id(g), (g, []))[1].append(i)
    if local:
        out[local] = combine_partials([partials[local]])
    for g, idx in by_group.values():
        out[idx] = combine_partials(partials[idx], g)
    return out


class ExtraPartials(NamedTuple):
    """Partial rows of something else to combine in the same all-reduces as a kind's whole-tensor rows (the
    per-expert rows of fused expert tensors): the rows, each row's group, and what to do with the combined rows
    (called only on a rank that collects the step)."""
    partials: torch.Tensor
    groups: Sequence[Any]
    deliver: Callable[[torch.Tensor], None]


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
