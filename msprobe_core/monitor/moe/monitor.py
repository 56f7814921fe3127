"""``MoEMonitor``: what ``TrainerMon`` calls for mixture-of-experts models (nothing when the model has none).

``TrainerMon`` holds one (or None) and calls it at five places: ``attach`` when it attaches to a model,
``rename``/``record`` when it records weights, gradients and optimizer states (``shard_partials`` for a
sharded reader's, on every rank that joins the sharded all-reduces), ``new_step`` when a step
begins, ``finish`` when a monitored step is written (router series written, MoE rules judged; the returned
``StepVerdict`` goes to the rank's ``AlertCenter``) and ``remove`` when it detaches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from msprobe_core.monitor.collector import StepCollector
from msprobe_core.monitor.config import MonitorConfig
from msprobe_core.monitor.detector import StepVerdict
from msprobe_core.monitor.events import EventTracker
from msprobe_core.monitor.moe.experts import ExpertPlan
from msprobe_core.monitor.moe.router_writer import RouterWriter
from msprobe_core.monitor.moe.routers import SUMMED, RouterStep, RouterTap, find_routers
from msprobe_core.monitor.records import EXP_AVG, EXP_AVG_SQ, GRAD, PARAM
from msprobe_core.monitor.rules.moe import MoERules
from msprobe_core.monitor.shard_stats import LOCAL, ExtraPartials
from msprobe_core.monitor.state_readers import StateReader
from msprobe_core.pytorch.native_shards import LocalPiece

_PARAM_KINDS = (PARAM, GRAD, EXP_AVG, EXP_AVG_SQ)


class MoEMonitor:
    """Per-expert rows, router taps, router series and MoE rules of one rank."""

    def __init__(self, config: MonitorConfig, plan: ExpertPlan, taps: Sequence[RouterTap], rank_dir: Path,
                 pp_stage: int = 0):
        self.config = config
        self.plan = plan
        self.taps = list(taps)
        self.rules = MoERules(config.alert.moe_rules, pp_stage)
        self.writer = RouterWriter(rank_dir, config.formats, config.ndigits)

    @classmethod
    def attach(cls, config: MonitorConfig, chunks: Sequence[nn.Module], reader: StateReader,
               rank_dir: Path, is_active: Callable[[], bool], pp_stage: int = 0) -> "MoEMonitor | None":
        """The MoE monitor of a model whose parameters ``reader`` reads, or None when it has no experts and no
        routers (``ConfigError`` for a ``moe.routers`` entry that names nothing usable)."""
        moe = config.moe
        plan = ExpertPlan.build(chunks, reader.named_parameters(chunks), reader.full_shape) if moe.per_expert \
            else ExpertPlan({}, {})
        taps = find_routers(chunks, moe.routers, is_active, config.source) if moe.router_stats else []
        if not plan and not taps:
            return None
        return cls(config, plan, taps, rank_dir, pp_stage)

    def rename(self, kind: str, tensors: Mapping[str, torch.Tensor],
               sharded: bool = False) -> Mapping[str, torch.Tensor]:
        """Per-expert module parameters under names that end in the expert index (``sharded``: the reader's
        weights, gradients and moments are shards to be combined, see ``ExpertPlan.rename``)."""
        return self.plan.rename(tensors, sharded) if kind in _PARAM_KINDS else tensors

    def record(self, collector: StepCollector, kind: str, tensors: Mapping[str, torch.Tensor],
               micro_step: int | None = None) -> None:
        """Per-expert rows of the fused expert tensors among ``tensors``."""
        if kind in _PARAM_KINDS and self.plan.fused:
            self.plan.record(collector, self.config.ops, self.config.eps, kind, tensors, micro_step)

    def shard_partials(self, collector: StepCollector, kind: str, tensors: Mapping[str, Any], reader: StateReader,
                       params: Mapping[str, nn.Parameter], group: Any) -> ExtraPartials | None:
        """Per-expert partial rows of the fused expert tensors among a sharded reader's ``tensors`` (its pieces:
        flat shards over ``group``, or ``LocalPiece``s that carry their own group), for ``StateRecorder.record``
        to combine in the whole-tensor rows' all-reduces; every rank that joins those calls it. A tensor whose
        start the reader cannot tell keeps only its whole-tensor row."""
        if kind not in _PARAM_KINDS or not self.plan.fused:
            return None
        shards: dict[str, tuple[torch.Tensor, int, Any]] = {}
        for name, value in tensors.items():
            if name not in self.plan.fused:
                continue
            start = reader.shard_start(name, params.get(name))
            if isinstance(value, LocalPiece):
                if not value.sharded:  # the whole tensor is here: nothing to combine
                    shards[name] = (value.tensor, 0, LOCAL)
                elif start is not None:
                    piece = value.tensor if value.counts else value.tensor[:0]  # a replica another rank counts
                    shards[name] = (piece, start, value.group)
            elif isinstance(value, torch.Tensor) and start is not None:
                shards[name] = (value, start, group)
        return self.plan.shard_partials(collector, self.config.ops, self.config.eps, kind, shards)

    def new_step(self) -> None:
        for t in self.taps:
            t.reset()

    @torch.no_grad()
    def finish(self, rank: int, step: int, events: EventTracker, latest: dict[str, Any] | None = None) -> StepVerdict:
        """Write this step's router series (one host copy for every router) and judge them; what the rules find
        is grouped into events by the rank's ``events`` (shared with the other rules, so event numbers stay
        one sequence). Expert-parallel routers are summed over their group first (``sum_over_groups``)."""
        verdict = StepVerdict(step)
        flats = []
        for t in self.taps:
            group = t.group if not self.config.module_ranks else None  # every rank of the group collects the step
            f = t.flat(_device(t) if group is not None else None)
            if f is not None:
                flats.append((t, group, f))
        if not flats:
            return verdict
        sum_over_groups(flats)
        device = flats[0][2].device
        host = torch.cat([f.to(device) for _, _, f in flats]).cpu().tolist()
        steps: list[RouterStep] = []
        at = 0
        for t, _, f in flats:
            s = t.step(host[at:at + f.numel()])
            at += f.numel()
            if s is not None:
                steps.append(s)
        self.writer.write(step, steps, latest)
        if self.rules and steps:
            found = self.rules.judge(rank, step, steps)
            if found:
                verdict.opened, verdict.grew = events.add(step, found, ())
        return verdict

    def remove(self) -> None:
        for t in self.taps:
            t.remove()
        self.taps = []
        self.writer.close()


def _device(tap: RouterTap) -> torch.device:
    p = next(tap.module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def sum_over_groups(flats: Sequence[tuple[RouterTap, Any, torch.Tensor]]) -> None:
    """Sums, in place, the additive part of each expert-parallel router's step (loads, tokens, entropy sums,
    dropped tokens) over its group: one all-reduce per group and step for all its routers. Every rank of a
    group has the same routers in the same order (the same model)."""
    by_group: dict[int, tuple[Any, list[tuple[torch.Tensor, int]]]] = {}
    for t, group, f in flats:
        if group is not None:
            by_group.setdefault(id(group), (group, []))[1].append((f, t.num_experts + SUMMED))
    for group, items in by_group.values():
        block = torch.cat([f[:n] for f, n in items])
        torch.distributed.all_reduce(block, group=group)
        at = 0
        for f, n in items:
            f[:n] = block[at:at + n]
            at += n
