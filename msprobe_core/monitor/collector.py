"""One step's statistics, kept on the device until the step ends, then copied to the host once.

Hooks and readers call ``record``; statistics are computed right away (so an in-place change made later
in the step cannot alter them) as small device tensors. ``finalize`` concatenates every block of the
step per device, copies it to the host in one transfer and returns ``MetricRow``s in call order.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch

from msprobe_core.monitor.records import MetricRow, stage_of
from msprobe_core.monitor.stats import StatsEngine
from msprobe_core.pytorch.native_shards import local_view


class _Entry(NamedTuple):
    """A named row of the step: the fields of its ``MetricRow`` (built once, with the values, in ``finalize``)
    and where the values are. A plain tuple: one is made per record, so it must be cheap."""
    kind: str
    name: str
    module: str
    micro_step: int | None
    call_id: int
    numel: int
    alias: bool
    external: bool
    device: torch.device
    row: int


class StepCollector:
    """Accumulates one step's statistics blocks and names; ``finalize`` copies them to the host once."""

    def __init__(self, engine: StatsEngine):
        self.engine = engine
        self._blocks: dict[torch.device, list[torch.Tensor]] = {}
        self._rows: dict[torch.device, int] = {}
        self._entries: list[_Entry] = []
        self._named: set[tuple[str, torch.device, int]] = set()
        self._call_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def compute(self, tensors: Sequence[torch.Tensor]) -> list[tuple[torch.device, int]]:
        """Statistics of ``tensors`` (any devices); returns the (device, row) of each, in order. A DTensor
        (a tensor-parallel activation) is summarised by this rank's local tensor."""
        tensors = [local_view(t) for t in tensors]
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        where: list[tuple[torch.device, int]] = [(torch.device("cpu"), 0)] * len(tensors)
        for device, idx in by_device.items():
            block = self.engine.compute([tensors[i] for i in idx])
            base = self.add_block(block)
            for k, i in enumerate(idx):
                where[i] = (device, base + k)
        return where

    def add_block(self, block: torch.Tensor) -> int:
        """Store an already computed [n, len(ops)] block; returns the row of its first line."""
        device = block.device
        base = self._rows.get(device, 0)
        self._blocks.setdefault(device, []).append(block)
        self._rows[device] = base + block.shape[0]
        return base

    def add_entry(self, kind: str, name: str, module: str, micro_step: int | None, numel: int,
                  where: tuple[torch.device, int], external: bool = False) -> None:
        """Name a computed row (a row may carry several names: the same tensor seen twice). ``external``:
        a tensor the model did not compute from its weights (see ``MetricRow.external``)."""
        device, row = where
        key = (kind, device, row)
        alias = key in self._named
        self._named.add(key)
        self._entries.append(_Entry(kind, name, module, micro_step, self._call_id, numel, alias, external, device, row))
        self._call_id += 1

    def record(self, kind: str, named: Sequence[tuple[str, str, torch.Tensor]], micro_step: int | None = None) -> None:
        """Compute and name statistics of ``(name, module, tensor)`` triples; empty tensors are skipped."""
        named = [item for item in named if item[2].numel() > 0]
        if not named:
            return
        where = self.compute([t for _, _, t in named])
        for (name, module, t), w in zip(named, where):
            self.add_entry(kind, name, module, micro_step, t.numel(), w)

    @torch.no_grad()
    def finalize(self) -> list[MetricRow]:
        """All rows of the step, in call order, after one host copy per device; then reset."""
        host: dict[torch.device, list[list[float]]] = {}
        for device, blocks in self._blocks.items():
            stacked = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
            host[device] = stacked.cpu().tolist()
        rows = [MetricRow(e.kind, e.name, e.module, e.micro_step, e.call_id, e.numel, host[e.device][e.row],
                          e.alias, e.external) for e in self._entries]
        self.reset()
        return rows

    def recorded(self, stages: Iterable[str]) -> bool:
        """Whether a row of a kind of one of ``stages`` was recorded this step."""
        wanted = set(stages)
        return any(stage_of(e.kind) in wanted for e in self._entries)

    @torch.no_grad()
    def has_nonfinite(self, stages: Iterable[str]) -> bool:
        """Whether a row of a kind of one of ``stages`` (``records.STAGES``) recorded so far holds a NaN or Inf
        (one host read per device)."""
        wanted = set(stages)
        rows: dict[torch.device, list[int]] = {}
        for e in self._entries:
            if stage_of(e.kind) in wanted:
                rows.setdefault(e.device, []).append(e.row)
        for device, idx in rows.items():
            blocks = self._blocks[device]
            stacked = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
            values = stacked[idx]
            bad = ~torch.isfinite(values).all(dim=1)
            if "nans" in self.engine.ops:
                bad |= values[:, self.engine.ops.index("nans")] > 0
            if bool(bad.any()):
                return True
        return False

    def reset(self) -> None:
        self._blocks.clear()
        self._rows.clear()
        self._entries.clear()
        self._named.clear()
        self._call_id = 0
