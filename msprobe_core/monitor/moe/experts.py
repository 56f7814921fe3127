"""Per-expert statistics: fused expert tensors split by expert, per-expert modules named by expert.

Found once, when the monitor attaches (``ExpertPlan.build``):

* **Fused expert tensors** hold every expert of a layer in one parameter (a router's ``[E, hidden]`` weight,
  megatron-core ``TopKRouter`` or HF ``*TopKRouter``, is not one: its whole-tensor row stays). HF transformers 5
  (``Qwen3MoeExperts``, ``MixtralExperts``, any module with ``num_experts`` whose parameter's first
  dimension is that count): ``experts.gate_up_proj`` ``[E, 2f, h]``, ``experts.down_proj`` ``[E, h, f]``.
  megatron-core ``GroupedMLP``: ``weight1`` ``[h, E*f1]`` and ``weight2`` ``[E*f2, h]``, whose memory its
  forward reads as ``[E, h, f1]`` and ``[E, f2, h]`` (expert ``e`` is the ``e``-th contiguous chunk). Their rows are
  ``{parameter}.{expert}`` (e.g. ``model.layers.0.mlp.experts.down_proj.3``), written beside the
  whole-tensor row; every statistic of every expert comes from one reduction over the non-expert
  dimensions (no Python loop over experts).
* **Per-expert modules** (megatron-core ``SequentialMLP`` ``experts.local_experts.N.*``, ``TEGroupedMLP``
  ``experts.linear_fc1.weightN``, DeepSpeed MoE ``deepspeed_moe.experts.deepspeed_experts.N.*``, older HF
  ``experts.N.*``): their rows are renamed so that the name ends in the (global) expert index,
  ``...experts.linear_fc1.weight.3``: no extra work. Their optimizer states are renamed the same way.

With expert parallelism (megatron-core ``ep_group`` of more than one rank) each rank holds the experts
``offset .. offset + local - 1``; per-expert partial statistics are placed at their global rows and combined
over the expert-parallel group like any other shard (``shard_stats``: two all-reduces per kind and step),
so every rank writes every expert. Per-expert modules (megatron-core ``SequentialMLP``, DeepSpeed
``MOELayer``, whose ``ep_group`` spans several ranks) keep each expert whole on its rank: each rank writes
its own experts' rows under their global indices. Under a sharded state reader (ZeRO, a distributed
optimizer) every rank must hand the same names to the combining all-reduce, so ``rename(..., sharded=True)``
adds an empty shard under the name of every expert held elsewhere: the combine then adds each expert's
shards from the ranks that hold it, and every rank writes every expert.

A sharded reader's shards of a fused tensor are contiguous pieces of the flattened parameter: ZeRO-1/2
fragments and Megatron's distributed-optimizer ranges (cut anywhere), ZeRO-3 partitions, FSDP1 flat-parameter
ranges (cut anywhere), FSDP2 ``Shard(0)`` pieces (whole rows of dim 0, the expert dim of ``[E, ...]``). The reader
tells where this rank's piece starts (``StateReader.shard_start``); each element is given to its expert by index
(``index_add`` / ``scatter_reduce``; a piece that starts and ends on expert boundaries is reshaped instead), with
no loop over experts, and the per-expert partials of all fused tensors of a kind are combined in the same two
all-reduces per shard group and kind as the whole-tensor rows (``shard_partials``: ``StateRecorder.record``'s
``extra``), whatever the number of tensors and experts. The parameter's full shape comes from the reader
(``StateReader.full_shape``: ZeRO-3's ``ds_shape``, FSDP1's original shapes), since a sharded parameter's own
shape is its piece's. Under expert parallelism the experts' global rows are filled by the ranks that hold them:
a shard group that spans the expert-parallel ranks (Megatron's data-parallel group, over which the expert
optimizer's shards are combined too) gives every rank every expert.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from msprobe_core.monitor.collector import StepCollector
from msprobe_core.monitor.moe.routers import is_router
from msprobe_core.monitor.shard_stats import ExtraPartials, combine_partials, partials_to_ops
from msprobe_core.monitor.state_readers import param_shape
from msprobe_core.pytorch.wrapper_names import unwrapped_name

_GROUPED = ("weight1", "weight2")
_SEQUENTIAL = re.compile(r"^(?P<head>.*\.experts)\.local_experts\.(?P<idx>\d+)\.(?P<rest>.+)$")
_DEEPSPEED = re.compile(r"^(?P<head>.*\.experts)\.deepspeed_experts\.(?P<idx>\d+)\.(?P<rest>.+)$")
_HF_PER_EXPERT = re.compile(r"^(?P<head>.*\.experts)\.(?P<idx>\d+)\.(?P<rest>.+)$")
_TE_GROUPED = re.compile(r"^(?P<head>.*\.experts)\.(?P<rest>.+\.weight)(?P<idx>\d+)$")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_PLAIN = (torch.Tensor, nn.Parameter)
"""Tensor types split by expert (a DTensor or another subclass could run collectives when reshaped)."""


@dataclass(frozen=True)
class FusedExperts:
    """One parameter that holds several experts, and how to split it."""

    name: str
    module: str
    local: int
    """Experts held here: the tensor's memory is ``local`` contiguous chunks, one per expert."""
    shape: tuple[int, ...]
    offset: int = 0
    total: int = 0
    group: Any = None
    """The expert-parallel process group its experts are spread over (None: all experts are here)."""

    @property
    def row_names(self) -> list[str]:
        return [f"{self.name}.{e}" for e in range(self.total)]

    def split(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as ``[local experts, elements of one expert]`` (a view of a contiguous tensor)."""
        return t.reshape(self.local, -1)


def _ep(module: nn.Module, local: int) -> tuple[int, int, Any]:
    """(offset, total experts, group) of a megatron-core experts module under expert parallelism."""
    group = getattr(module, "ep_group", None)
    size = _group_size(group)
    if size <= 1:
        return 0, local, None
    return group.rank() * local, size * local, group


def _group_size(group: Any) -> int:
    if group is None:
        return 1
    size = getattr(group, "size", None)
    try:
        return int(size()) if callable(size) else 1
    except Exception:  # pragma: no cover - a group of an uninitialised backend
        return 1


class ExpertPlan:
    """What to split and what to rename, decided once for a model."""

    def __init__(self, fused: Mapping[str, FusedExperts], renames: Mapping[str, str],
                 elsewhere: Mapping[str, Sequence[str]] | None = None):
        self.fused = dict(fused)
        self.renames = dict(renames)
        self.elsewhere = {k: tuple(v) for k, v in (elsewhere or {}).items()}
        """Expert-parallel per-expert modules: the new name of this rank's first expert's parameter -> the names
        of the same parameter of the experts other ranks hold."""

    def __bool__(self) -> bool:
        return bool(self.fused or self.renames)

    @classmethod
    def build(cls, chunks: Sequence[nn.Module], params: Mapping[str, nn.Parameter],
              full_shape: Callable[[str, Any], tuple[int, ...]] | None = None) -> "ExpertPlan":
        """Find the fused expert tensors and per-expert module parameters among ``params``; ``full_shape(name,
        param)`` gives a sharded parameter's full shape (default: ``ds_shape`` or its own shape)."""
        shape_of = full_shape or (lambda _name, p: param_shape(p))
        owners: dict[int, tuple[str, nn.Module]] = {}
        by_name: dict[str, nn.Module] = {}  # unwrapped module name -> module (FSDP1 flat parameters replaced its own)
        layouts: dict[str, tuple[int, int, int]] = {}  # experts module name -> (offset, local, total) of its experts
        multi = len(chunks) > 1
        for c, chunk in enumerate(chunks):
            for wrapped, module in chunk.named_modules():
                mname = unwrapped_name(wrapped)
                by_name[(f"{c}:" if multi else "") + mname] = module
                head = _experts_head(mname, module)
                if head is not None:
                    local = int(module.num_local_experts)
                    offset, total, _ = _ep(module, local)
                    layouts[(f"{c}:" if multi else "") + head] = (offset, local, total)
                for pname, p in module.named_parameters(recurse=False):
                    owners.setdefault(id(p), ((f"{c}:" if multi else "") + (f"{mname}." if mname else ""), module))
        fused: dict[str, FusedExperts] = {}
        renames: dict[str, str] = {}
        elsewhere: dict[str, list[str]] = {}
        for name, p in params.items():
            prefix, module = owners.get(id(p), ("", None))
            if module is None and name.rpartition(".")[0] in by_name:
                prefix, module = name.rpartition(".")[0] + ".", by_name[name.rpartition(".")[0]]
            spec = _fused_spec(name, prefix, module, shape_of(name, p)) if module is not None else None
            if spec is not None:
                fused[name] = spec
                continue
            found = _per_expert_name(name, module, layouts)
            if found is not None:
                renames[name], head, rest, idx = found
                offset, local, total = layouts.get(head, (0, 0, 0))
                if total > local and idx == offset:
                    elsewhere[renames[name]] = [f"{head}.{rest}.{g}" for g in range(total)
                                                if not offset <= g < offset + local]
        return cls(fused, renames, elsewhere)

    def rename(self, tensors: Mapping[str, torch.Tensor], sharded: bool = False) -> Mapping[str, torch.Tensor]:
        """``tensors`` with per-expert module parameters under their expert-indexed names; ``sharded`` (the
        tensors are shards to be combined over the ranks): plus an empty shard for each expert-parallel expert
        held by another rank."""
        if not self.renames:
            return tensors
        get = self.renames.get
        out = {get(n, n): t for n, t in tensors.items()}
        if sharded and self.elsewhere:
            for name, others in self.elsewhere.items():
                t = out.get(name)
                if isinstance(t, torch.Tensor):
                    out.update((o, t.new_empty(0)) for o in others)
        return out

    @torch.no_grad()
    def record(self, collector: StepCollector, ops: Sequence[str], eps: float, kind: str,
               tensors: Mapping[str, torch.Tensor], micro_step: int | None = None) -> None:
        """Per-expert rows of the fused expert tensors among ``tensors`` (skipped where a tensor is a shard
        that does not have the parameter's shape)."""
        todo = [(self.fused[n], t) for n, t in tensors.items()
                if n in self.fused and type(t) in _PLAIN and tuple(t.shape) == self.fused[n].shape]
        if not todo:
            return
        by_place: dict[tuple[torch.device, int], list[tuple[FusedExperts, torch.Tensor]]] = {}
        for spec, t in todo:
            by_place.setdefault((t.device, id(spec.group)), []).append((spec, t))
        for items in by_place.values():
            partials = torch.cat([expert_partials(spec, t, ops, eps) for spec, t in items])
            group = items[0][0].group
            if group is not None:
                partials = combine_partials(partials, group)
            block = partials_to_ops(partials, ops)
            _add_rows(collector, kind, [spec for spec, _ in items], block, micro_step)

    @torch.no_grad()
    def shard_partials(self, collector: StepCollector, ops: Sequence[str], eps: float, kind: str,
                       shards: Mapping[str, tuple[torch.Tensor, int, Any]]) -> ExtraPartials | None:
        """Per-expert partial rows of the fused expert tensors among a sharded reader's pieces, to be combined in
        the whole-tensor rows' all-reduces (``StateRecorder.record``'s ``extra``); their rows go to ``collector``
        once combined. ``shards``: name -> (this rank's piece, flattened; where it starts among the parameter's
        elements; the group over which the pieces add up, ``shard_stats.LOCAL`` for a whole tensor). Every rank
        of a group hands the same names (a rank without a piece hands an empty one)."""
        names = sorted(shards)
        if not names:
            return None
        specs = [self.fused[n] for n in names]
        partials = torch.cat([shard_expert_partials(s, shards[n][0], shards[n][1], eps) for s, n in zip(specs, names)])
        groups = [shards[n][2] for s, n in zip(specs, names) for _ in range(s.total)]

        def deliver(combined: torch.Tensor) -> None:
            _add_rows(collector, kind, specs, partials_to_ops(combined, ops), None)
        return ExtraPartials(partials, groups, deliver)


def _add_rows(collector: StepCollector, kind: str, specs: Sequence[FusedExperts], block: torch.Tensor,
              micro_step: int | None) -> None:
    """The per-expert rows of ``specs`` (``spec.total`` rows each, in order) from ``block``."""
    base = collector.add_block(block)
    for spec in specs:
        numel = math.prod(spec.shape) // spec.local
        for e, row_name in enumerate(spec.row_names):
            collector.add_entry(kind, row_name, spec.module, micro_step, numel, (block.device, base + e))
        base += spec.total


@torch.no_grad()
def shard_expert_partials(spec: FusedExperts, shard: torch.Tensor, start: int, eps: float) -> torch.Tensor:
    """Partial statistics of each expert (``shard_stats.PARTIAL_FIELDS`` order, float64 ``[spec.total, 7]``) of
    a flat shard holding the parameter's elements ``start .. start + shard.numel() - 1`` (row-major, this rank's
    experts ``spec.offset ..``); experts it does not touch are empty rows. A shard aligned on expert boundaries
    is reduced as ``[experts, elements]`` rows; any other is given to its experts element by element."""
    x = shard.detach().reshape(-1)
    x = x.double() if x.is_floating_point() else x.to(torch.float64)
    e = spec.total
    per = math.prod(spec.shape) // spec.local
    zeros = torch.zeros(e, dtype=torch.float64, device=x.device)
    inf = torch.full_like(zeros, math.inf)
    if start % per == 0 and x.numel() % per == 0:
        first = start // per + spec.offset
        rows = x.reshape(-1, per)
        n = rows.shape[0]
        local = torch.stack([rows.sum(1), (rows * rows).sum(1), torch.isnan(rows).sum(1).double(),
                             (rows.abs() <= eps).sum(1).double(), torch.full_like(rows[:, 0], float(per)),
                             rows.amin(1), rows.amax(1)], dim=1)
        out = torch.stack([zeros, zeros, zeros, zeros, zeros, inf, -inf], dim=1)
        out[first:first + n] = local
        return out
    ids = torch.arange(start, start + x.numel(), device=x.device) // per + spec.offset

    def per_expert(v: torch.Tensor) -> torch.Tensor:
        return zeros.index_add(0, ids, v)

    return torch.stack([per_expert(x), per_expert(x * x), per_expert(torch.isnan(x).double()),
                        per_expert((x.abs() <= eps).double()), torch.bincount(ids, minlength=e)[:e].double(),
                        inf.scatter_reduce(0, ids, x, "amin"), (-inf).scatter_reduce(0, ids, x, "amax")], dim=1)


def _fused_spec(name: str, prefix: str, module: nn.Module, shape: tuple[int, ...]) -> FusedExperts | None:
    leaf = name[len(prefix):] if name.startswith(prefix) else name.rpartition(".")[2]
    owner = prefix[:-1] if prefix.endswith(".") else prefix
    cls = type(module).__name__
    if cls == "GroupedMLP" and leaf in _GROUPED:
        local = int(getattr(module, "num_local_experts", 0) or 0)
        if local > 1 and len(shape) == 2 and math.prod(shape) % local == 0:
            offset, total, group = _ep(module, local)
            return FusedExperts(name, owner, local, shape, offset, total, group)
        return None
    local = getattr(module, "num_experts", None)
    if isinstance(local, int) and local > 1 and len(shape) >= 2 and shape[0] == local and not is_router(module):
        return FusedExperts(name, owner, local, shape, 0, local, None)
    return None


def _experts_head(mname: str, module: nn.Module) -> str | None:
    """The name under which a per-expert container's experts are named: megatron-core ``SequentialMLP``
    (itself, ``...experts``) or DeepSpeed's ``MOELayer`` (its ``experts``); None for any other module."""
    cls = type(module).__name__
    if cls == "SequentialMLP":
        return mname
    if cls == "MOELayer" and type(module).__module__.startswith("deepspeed.") and hasattr(module, "num_local_experts"):
        return f"{mname}.experts" if mname else "experts"
    return None


def _per_expert_name(name: str, module: nn.Module | None,
                     layouts: Mapping[str, tuple[int, int, int]]) -> tuple[str, str, str, int] | None:
    """(``...experts.rest.N``, head, rest, global N) for a parameter of one expert's module, or None."""
    cls = type(module).__name__ if module is not None else ""
    m = _SEQUENTIAL.match(name) or _DEEPSPEED.match(name)
    if m is not None:
        idx = int(m["idx"]) + layouts.get(m["head"], (0, 0, 0))[0]
    else:
        m = _TE_GROUPED.match(name) if cls.startswith("TE") or "Grouped" in cls else None
        m = m or _HF_PER_EXPERT.match(name)
        if m is None:
            return None
        idx = int(m["idx"])
    return f"{m['head']}.{m['rest']}.{idx}", m["head"], m["rest"], idx


@torch.no_grad()
def expert_partials(spec: FusedExperts, t: torch.Tensor, ops: Sequence[str], eps: float) -> torch.Tensor:
    """Partial statistics of each expert of ``t`` (``shard_stats.PARTIAL_FIELDS`` order, float64
    ``[spec.total, 7]``; experts held by other ranks are empty rows). Only the reductions ``ops`` need run;
    on the CPU the NaN count runs only where a reduction is not finite (reading that back costs nothing)."""
    x = spec.split(t.detach())
    if x.dtype in _LOW_PRECISION or not x.is_floating_point():
        x = x.float()
    n, per = x.shape
    want = set(ops)
    zeros64 = torch.zeros(n, dtype=torch.float64, device=x.device)
    cols: dict[str, torch.Tensor] = {}
    # reduced in the tensor's precision (float32 at least), as the whole-tensor statistics are; float64
    # accumulation is several times slower on the CPU
    cols["sum"] = x.sum(1).double() if "mean" in want else zeros64
    cols["sumsq"] = torch.linalg.vector_norm(x, 2, 1).double() ** 2 if "norm" in want else zeros64
    cols["min"] = x.amin(1).double() if "min" in want else torch.full_like(zeros64, math.inf)
    cols["max"] = x.amax(1).double() if "max" in want else torch.full_like(zeros64, -math.inf)
    # |x| <= eps written in place as 0./1. floats and summed (a bool tensor is far slower on the CPU)
    cols["zeros"] = x.abs().le_(eps).sum(1).double() if "zeros" in want else zeros64
    if "nans" in want:
        probe = [cols[k] for k, op in (("sum", "mean"), ("sumsq", "norm"), ("min", "min"), ("max", "max"))
                 if op in want]
        if x.device.type != "cpu" or not probe or not all(bool(torch.isfinite(c).all()) for c in probe):
            cols["nans"] = torch.isnan(x).sum(1).double()
        else:
            cols["nans"] = zeros64
    else:
        cols["nans"] = zeros64
    numel = torch.full_like(zeros64, float(per))
    local = torch.stack([cols["sum"], cols["sumsq"], cols["nans"], cols["zeros"], numel, cols["min"], cols["max"]],
                        dim=1)
    if spec.total == n:
        return local
    out = torch.zeros((spec.total, 7), dtype=torch.float64, device=x.device)
    out[:, 5] = math.inf
    out[:, 6] = -math.inf
    out[spec.offset:spec.offset + n] = local
    return out
