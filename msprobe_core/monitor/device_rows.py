"""One device's statistics rows of a step (``DeviceRows``), the small tensors' in batches.

A small real floating-point tensor waits as a snapshot (``pytorch/snapshot_rows``: one launch now, about ten for
all the step's tensors of its size later, where ``batched_stats`` of one tensor takes about fifteen); any other
tensor (large, complex, a subclass) is summarised at once by ``StatsEngine.compute``. Rows are numbered in the
order tensors arrive (a tensor's row is known at once, as ``Collector``'s slots need); ``values`` puts every row
in its place on the host, one transfer for the device. Nothing reads back to the host before ``values``.
"""

from __future__ import annotations

from functools import partial
from itertools import chain
from typing import Sequence

import numpy as np
import torch

from msprobe_core.monitor.stats import StatsEngine
from msprobe_core.pytorch import snapshot_rows
from msprobe_core.pytorch.tensor_stats import row_stats


class DeviceRows:
    """The rows of one device in one step: ``add`` (a tensor), ``add_block`` (rows computed elsewhere),
    ``values`` (all of them on the host, in row order)."""

    def __init__(self, engine: StatsEngine):
        self.engine = engine
        self.count = 0
        """Rows given out so far."""
        self._snapshots = snapshot_rows.SnapshotRows(partial(row_stats, ops=engine.ops, eps=engine.eps))
        self._done: list[tuple[Sequence[int], torch.Tensor]] = self._snapshots.done
        """(rows, their [len(rows), ops] block): the summarised snapshots' and every other tensor's."""

    def add(self, t: torch.Tensor) -> int:
        """The row of one non-empty tensor on this device (its statistics taken now, or its snapshot)."""
        row = self.count
        self.count += 1
        if snapshot_rows.takes(t):
            self._snapshots.add(t, row)
        else:
            self._done.append(((row,), self.engine.compute([t])))
        return row

    def add_block(self, block: torch.Tensor) -> int:
        """Rows computed elsewhere (an [n, len(ops)] block): the row of its first line."""
        base = self.count
        self.count += block.shape[0]
        self._done.append((range(base, self.count), block))
        return base

    def values(self) -> np.ndarray:
        """Every row's values, ``[count, ops]`` float64 (float32 values), in row order: one copy to the host."""
        self._snapshots.summarise()
        out = np.empty((self.count, len(self.engine.ops)))
        if self._done:
            blocks = [block for _, block in self._done]
            host = (blocks[0] if len(blocks) == 1 else torch.cat(blocks)).detach().cpu().double().numpy()
            out[np.fromiter(chain.from_iterable(rows for rows, _ in self._done), dtype=np.int64, count=len(host))] = host
        return out
