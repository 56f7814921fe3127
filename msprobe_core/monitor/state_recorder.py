"""``StateRecorder``: the monitored parameters, and the statistics of their weights, gradients and optimizer
moments at each monitored step.

The parameter set is decided once, when the monitor attaches (and again when a config change reselects it):
names, owner modules and the backward order of the gradients are worked out then, so recording a step is a
lookup per tensor and one batch of statistics per kind. Where the tensors live is the ``StateReader``'s
business (``state_readers``): plain tensors are summarised here; a sharded reader's shards go through
partial statistics combined over the shard group (``shard_stats``), so every rank records the full tensors;
other partial rows (per-expert rows of fused expert tensors) ride in the same all-reduces.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from msprobe_core.monitor.collector import StepCollector
from msprobe_core.monitor.records import EXP_AVG, EXP_AVG_SQ, GRAD, PARAM
from msprobe_core.monitor.selection import owner_module
from msprobe_core.monitor.shard_stats import ExtraPartials, combine_grouped, partials_to_ops
from msprobe_core.monitor.state_readers import StateReader

SHARDED_KINDS = (GRAD, EXP_AVG, EXP_AVG_SQ, PARAM)
"""The kinds a sharded reader returns as shards."""


class StateRecorder:
    """Reads the monitored parameters' states through ``reader`` and records them into a step's collector."""

    def __init__(self, reader: StateReader):
        self.reader = reader
        self.params: dict[str, nn.Parameter] = {}
        """The monitored parameters under their qualified names, in model order."""
        self._owners: dict[str, str] = {}
        self._backward: list[str] = []
        self._last_names: tuple[str, ...] = ()
        self._last_modules: list[str] = []

    def select(self, chunks: Sequence[nn.Module], selects: Callable[[str], bool]) -> None:
        """Monitor the parameters of ``chunks`` that ``selects(name)`` keeps (names, owners and order decided now)."""
        self.params = {n: p for n, p in self.reader.named_parameters(chunks).items() if selects(n)}
        self._owners = {n: owner_module(n) for n in self.params}
        self._backward = list(reversed(list(self.params)))

    def clear(self) -> None:
        """Let go of the parameters."""
        self.params, self._owners, self._backward = {}, {}, []

    # ------------------------------------------------------------------------------------ reading
    def weights(self) -> Mapping[str, torch.Tensor]:
        return self.reader.weights(self.params)

    def grads(self, grads: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The weight gradients (``grads``, or the reader's) in backward order, then any the monitor does not
        know (an integration's own), in their order."""
        if grads is None:
            grads = self.reader.grads(self.params)
        if grads.keys() == self.params.keys():  # the usual step: every parameter has a gradient, nothing else
            return dict(zip(self._backward, map(grads.__getitem__, self._backward)))
        order = [n for n in self._backward if n in grads] + [n for n in grads if n not in self.params]
        return {n: grads[n] for n in order}

    def moments(self, optimizer: Any) -> dict[str, Mapping[str, torch.Tensor]]:
        """``{kind: {name: tensor}}`` of the optimizer's moments, ``exp_avg`` first."""
        states = self.reader.optimizer_states(optimizer, self.params)
        return {kind: states[kind] for kind in (EXP_AVG, EXP_AVG_SQ) if kind in states}

    def nonfinite_grads(self) -> list[str]:
        """The weight gradients, not cleared yet, that hold a NaN or Inf, in backward order (one host read per
        device); none for a sharded reader (its shards are judged by their rows)."""
        if self.reader.sharded:
            return []
        grads = self.reader.grads(self.params)
        return _nonfinite_names([(n, grads[n]) for n in self._backward if n in grads])

    # ---------------------------------------------------------------------------------- recording
    def record(self, collector: StepCollector, kind: str, tensors: Mapping[str, torch.Tensor], *,
               collecting: bool, group: Any = None, micro_step: int | None = None,
               module: str | None = None, extra: ExtraPartials | None = None) -> None:
        """Record ``tensors`` under ``kind``. A sharded reader's shards are combined over ``group`` even when
        this rank does not collect the step (``collecting`` False: it only contributes to the all-reduces);
        ``extra`` partial rows (per-expert rows) are combined in the same all-reduces."""
        if self.reader.sharded and kind in SHARDED_KINDS:
            self._record_sharded(collector, kind, tensors, collecting, group, extra)
        elif collecting:
            names = tuple(tensors)
            modules = [module] * len(names) if module is not None else self._modules_of(names)
            if collector.record_plain(kind, names, modules, list(tensors.values()), micro_step):
                return  # plain CPU tensors, all of them: the usual batch
            if not all(map(isinstance, tensors.values(), repeat(torch.Tensor))):
                tensors = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
                names = tuple(tensors)
                modules = [module] * len(names) if module is not None else self._modules_of(names)
            collector.record_columns(kind, names, list(modules), list(tensors.values()), micro_step)

    def _modules_of(self, names: tuple[str, ...]) -> list[str]:
        """The owner module of each of ``names`` (the last list asked for is kept: the same every step)."""
        if self._last_names != names:
            owners = self._owners
            self._last_names, self._last_modules = names, [owners.get(n) or owner_module(n) for n in names]
        return self._last_modules

    def _record_sharded(self, collector: StepCollector, kind: str, tensors: Mapping[str, torch.Tensor],
                        collecting: bool, group: Any, extra: ExtraPartials | None) -> None:
        names = sorted(tensors)
        rows, groups = self.reader.partials(collector.engine, names, tensors, group)
        if extra is not None:
            rows = torch.cat([rows.to(extra.partials.device), extra.partials])
            groups = [*groups, *extra.groups]
        combined = combine_grouped(rows, groups)
        if not collecting:  # contributing only: the all-reduces are made, nothing is recorded
            return
        block = partials_to_ops(combined[:len(names)], collector.engine.ops)
        base = collector.add_block(block)
        for i, name in enumerate(names):
            numel = self.reader.full_numel(name, self.params.get(name))
            collector.add_entry(kind, name, self._owners.get(name) or owner_module(name), None, numel,
                                (block.device, base + i))
        if extra is not None:
            extra.deliver(combined[len(names):])


def _nonfinite_names(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names whose tensors hold a NaN or Inf, in order (one host read per device)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    bad: list[int] = []
    for idx in by_device.values():
        finite = torch.isfinite(torch.stack(torch._foreach_norm([named[i][1] for i in idx]))).tolist()
        bad.extend(i for i, ok in zip(idx, finite) if not ok)
    return [named[i][0] for i in sorted(bad)]
