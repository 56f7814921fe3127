"""Statistics of an accelerator's small tensors in batches (``SnapshotRows``), shared by the dump and the monitor.

On an accelerator every kernel launch costs the host microseconds, and a tensor's statistics one at a time take
several of them (the dump's four reductions, the monitor's fifteen or so): on a model of many small modules the
launches, not the arithmetic, make the tool's cost. So a small real floating-point tensor (up to
``SNAPSHOT_ELEMENTS`` elements) is copied at once into a snapshot (one launch: a later in-place change cannot
alter its statistics) and waits with the others of its size and precision; ``summarise`` stacks each group and
reduces it along the rows (a handful of launches for the lot) when the caller reads the values, or by itself
once the waiting snapshots hold ``PENDING_ELEMENTS``. Larger tensors, whose launches are cheap beside their
arithmetic, and any other tensor stay with the caller's usual path (``takes``). Nothing reads back to the host.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

SNAPSHOT_ELEMENTS = 1 << 22
"""The largest tensor (elements) that waits as a snapshot: 16 MiB in float32."""
PENDING_ELEMENTS = 1 << 24
"""The snapshots (elements) kept waiting before they are summarised: 64 MiB in float32."""
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_contiguous = torch.contiguous_format
_strided = torch.strided
_float32, _float64 = torch.float32, torch.float64


def takes(t: torch.Tensor) -> bool:
    """Does ``t`` (non-empty, on an accelerator) wait as a snapshot: a plain dense real float tensor of at most
    ``SNAPSHOT_ELEMENTS`` elements?"""
    return (type(t) in _PLAIN and t.layout is _strided and t.is_floating_point() and not t.is_nested
            and t.numel() <= SNAPSHOT_ELEMENTS)


class SnapshotRows:
    """Snapshots waiting for their statistics, grouped by size and precision (read in float32; float64 stays
    float64 where ``keep_float64``, as the dump's ``summary_stats`` reduces it); ``reduce(rows)`` gives the
    statistics of each row of a stacked group, ``done`` holds what ``summarise`` made: (the keys ``add`` was
    given, their block)."""

    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor], keep_float64: bool = False):
        self._reduce = reduce
        self._float64 = _float64 if keep_float64 else _float32
        self.done: list[tuple[list[Any], torch.Tensor]] = []
        self._waiting: dict[tuple, tuple[list[Any], list[torch.Tensor]]] = {}
        self._pending = 0

    def add(self, t: torch.Tensor, key: Any) -> None:
        """Snapshot ``t`` (``takes(t)``) now; its row of statistics will follow ``key`` into ``done``."""
        dtype = self._float64 if t.dtype is _float64 else _float32
        snapshot = t.detach().to(dtype, memory_format=_contiguous, copy=True).view(-1)
        n = snapshot.numel()
        keys, snapshots = self._waiting.setdefault((n, dtype, snapshot.device), ([], []))
        keys.append(key)
        snapshots.append(snapshot)
        self._pending += n
        if self._pending >= PENDING_ELEMENTS:
            self.summarise()

    def summarise(self) -> None:
        """Reduce every waiting group (one stack and one ``reduce`` each) into ``done``."""
        for keys, snapshots in self._waiting.values():
            self.done.append((keys, self._reduce(torch.stack(snapshots))))
        self._waiting.clear()
        self._pending = 0
