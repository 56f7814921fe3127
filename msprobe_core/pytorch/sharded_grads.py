"""``parameters_grad`` records of DTensor parameters (FSDP2 ``fully_shard``, tensor parallel): the statistics
of the full gradient, combined from every rank's shard once the backward pass is over.

A DTensor parameter's gradient is never one rank's to summarise: FSDP2 assigns each rank its reduced
shard after the reduce-scatter (no tensor hook fires for it), tensor parallel accumulates a sharded
gradient. ``ShardedGrads`` keeps the step's DTensor parameters and, at the end of each backward pass (an
autograd final callback, queued by a gradient hook on the parameter for tensor parallel and after FSDP2's
own end-of-backward callback for FSDP2), reads their gradients, all-reduces per-shard sums, sums of
squares, element counts, minima and maxima (two all-reduces per process group) and hands each gradient
with its full statistics to the record's hook. Every rank of a group must dump the step (the dump's
``rank`` list names all of them); otherwise each rank records its local shard and says so.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from msprobe_core.pytorch.native_shards import FlatSlot, LocalPiece, piece_of
from msprobe_core.pytorch.ranks import group_ranks

logger = logging.getLogger("msprobe_core.dump")

FullStats = tuple[float, float, float, float, int]
"""Max, Min, Mean, Norm of the full tensor and the number of ranks whose shards were combined."""
Combined = tuple[FullStats, list[int]]
"""Full statistics and the full tensor's shape."""


@torch.no_grad()
def full_statistics(pieces: Sequence[LocalPiece]) -> list[FullStats]:
    """Statistics of the full tensors from this rank's pieces: two all-reduces per process group. Every rank
    of each group calls it with the pieces of the same tensors in the same order."""
    rows = []
    for piece in pieces:
        t = piece.tensor.detach().reshape(-1).double()
        if t.numel() and piece.counts:
            rows.append(torch.stack([t.sum(), t.dot(t), t.new_tensor(float(t.numel())), -t.min(), t.max()]))
        else:
            rows.append(torch.tensor([0.0, 0.0, 0.0, -math.inf, -math.inf], dtype=torch.float64, device=t.device))
    block = torch.stack(rows) if rows else torch.empty((0, 5), dtype=torch.float64)
    shards = [1] * len(pieces)
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, piece in enumerate(pieces):
        if piece.sharded:
            groups.setdefault(id(piece.group), (piece.group, []))[1].append(i)
    for group, idx in groups.values():
        sums = block[idx, :3].contiguous()
        extremes = block[idx, 3:].contiguous()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        block[idx, :3] = sums
        block[idx, 3:] = extremes
        for i in idx:
            shards[i] = dist.get_world_size(group)
    out = []
    for (total, sumsq, numel, neg_min, hi), n in zip(block.tolist(), shards):
        if not numel:
            out.append((math.nan, math.nan, math.nan, 0.0, n))
            continue
        nan = math.isnan(total)
        out.append((math.nan if nan else hi, math.nan if nan else -neg_min, total / numel, math.sqrt(sumsq), n))
    return out


class ShardedGrads:
    """The step's DTensor parameters and their record hooks (see the module docstring)."""

    def __init__(self, deliver: Callable[[Callable, torch.Tensor, Combined | None], None],
                 all_ranks_dump: Callable[[Any], bool]):
        self._deliver = deliver
        self._all_ranks_dump = all_ranks_dump
        self._params: list[_Entry] = []
        self._queued = False
        self._warned: set[str] = set()

    def add(self, param: "torch.Tensor | FlatSlot", hook: Callable) -> "_Entry":
        """Record the gradient of ``param`` (a DTensor parameter, or an FSDP1 original parameter's slot) with
        ``hook`` at the end of each backward; returns a removable handle."""
        entry = _Entry(self, param, hook)
        self._params.append(entry)
        return entry

    def arm(self, *_: Any) -> None:
        """Queue ``flush`` to run when the current backward pass ends (once per pass)."""
        if not self._queued and self._params:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def after_fsdp_backward(self, state: Any) -> None:
        """Run ``flush`` after an FSDP2 state's end-of-backward callback (the sharded gradients are set then)."""
        original = state._root_post_backward_final_callback
        if getattr(original, "_msprobe_sharded_grads", None) is self:
            return

        def callback() -> None:
            original()
            self.flush()

        callback._msprobe_sharded_grads = self  # type: ignore[attr-defined]
        state._root_post_backward_final_callback = callback

    def flush(self) -> None:
        self._queued = False
        todo = [found for found in (e.read() for e in self._params) if found is not None]
        if not todo:
            return
        readable = [i for i, (_, _, piece, _) in enumerate(todo) if piece is not None
                    and (not piece.sharded or self._all_ranks_dump(piece.group))]
        try:
            stats = dict(zip(readable, full_statistics([todo[i][2] for i in readable])))  # type: ignore[misc]
        except Exception as e:  # never break the backward pass
            logger.warning("msprobe: combining sharded gradient statistics failed (%r); local shards recorded", e)
            stats = {}
        for i, (hook, grad, _, shape) in enumerate(todo):
            self._deliver(hook, grad, (stats[i], shape) if i in stats else None)

    def discard(self, entry: "_Entry") -> None:
        self._params = [e for e in self._params if e is not entry]


class _Entry:
    """Removable handle of one parameter in ``ShardedGrads`` (removed with the step's gradient hooks)."""

    def __init__(self, owner: ShardedGrads, param: "torch.Tensor | FlatSlot", hook: Callable):
        self.owner = owner
        self.param = param
        self.hook = hook

    def read(self) -> tuple[Callable, torch.Tensor, LocalPiece | None, list[int]] | None:
        """(hook, what the hook gets, this rank's piece or None where unreadable, full shape), or None
        without a gradient (the same on every rank)."""
        if isinstance(self.param, FlatSlot):
            grad = self.param.flat.grad
            if grad is None:
                return None
            piece = self.param.cut(grad)
            return self.hook, piece.tensor, piece, list(self.param.flat._shapes[self.param.index])
        grad = self.param.grad
        return None if grad is None else (self.hook, grad, piece_of(grad), list(grad.shape))

    def remove(self) -> None:
        self.owner.discard(self)


def every_rank_dumps(rank_filter: Any) -> Callable[[Any], bool]:
    """Whether every rank of a group is in the dump's ``rank`` list (``StepFilter``: empty means all)."""
    def check(group: Any) -> bool:
        return all(r in rank_filter for r in group_ranks(group))
    return check
