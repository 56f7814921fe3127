"""One step's statistics, kept until the step ends, then handed over as ``StepRows`` (columns) in call order.

Hooks and readers call ``record`` (or ``slot``/``compute`` and ``add_entry``/``add_entries``); statistics
are computed right away (so an in-place change made later in the step cannot alter them). Each computed
row lives in a *slot*:

* a CPU tensor the one-pass kernel reads gets its row of host floats appended to the step's buffer by the
  kernel (``StatsEngine.append_row`` for one tensor, ``StatsEngine.append_rows``, one kernel call, for a
  batch), no torch call and no tensor made: its slot is an ``int``, the index of its row, which stays the
  kernel's raw sums until ``finalize`` turns them into the ``ops`` for the whole step at once (a column at
  a time); a batch the kernel reads whole (the step's weights, gradients, moments) gets its rows and its
  entries in one kernel call (``record_plain``);
* an accelerator's tensor gets its row in that device's ``DeviceRows`` (``device_rows``: a snapshot now, the
  statistics of many snapshots at once, a fixed number of kernel launches for many tensors); a CPU tensor the
  kernel cannot read is summarised into a ``[n, len(ops)]`` block (the tensors of one call together), kept
  there too; its slot is ``(device, row)``. ``finalize`` copies every device's rows to the host in one transfer.

Every value is rounded to float32 at ``finalize`` (the blocks are float32), so the numbers do not depend
on the path a tensor took. A named row waits as ``MetricRow``'s fields in one flat list, with its slot in
place of ``values``, until ``finalize`` hands the step over as ``StepRows``: its ``RowLayout`` (the fields
as columns, made again only when the list differs from the last step's) and its values, one array.

Hooks call in here thousands of times a step while the model's activations are alive, so nothing here
makes an object Python's garbage collector tracks: host values go into one ``bytearray`` and entries' fields
into one flat list. (Each tracked object made counts towards the next collection; collections in the middle
of a forward promote the model's activations to older generations and so bring on full collections of
the whole heap.)
"""

from __future__ import annotations

from itertools import chain, compress, repeat
from typing import Iterable, Sequence, Union

import numpy as np
import torch

from msprobe_core.monitor.device_rows import DeviceRows
from msprobe_core.monitor.records import MetricRow, stage_of
from msprobe_core.monitor.step_rows import RowLayout, StepRows
from msprobe_core.monitor.stats import RAW_WIDTH, StatsEngine
from msprobe_core.pytorch.native_shards import local_view
from msprobe_core.stats.kernel import KERNEL

Slot = Union[int, "tuple[torch.device, int]"]
"""Where a computed row is: an index into the step's host rows, or (device, row of that device's blocks)."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_get_num_threads = torch.get_num_threads
_FIELDS = len(MetricRow._fields) - 1  # an entry: MetricRow's fields less call_id
_SLOT = 5  # where an entry's slot (in place of MetricRow.values) is
_ROW_BYTES = RAW_WIDTH * 8  # a host row in StepCollector._raw
_state_rows = getattr(KERNEL, "state_rows", None)


def is_float_tensor(x: object) -> bool:
    """A non-empty floating-point (or complex) tensor: what the monitor summarises."""
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and x.numel() > 0


class StepCollector:
    """Accumulates one step's statistics and names; ``finalize`` returns them as ``StepRows``."""

    def __init__(self, engine: StatsEngine):
        """``engine``: the statistics (at least one op, as the config requires)."""
        self.engine = engine
        self._raw = bytearray()
        """The host rows (``StatsEngine.append_row``), ``stats.RAW_WIDTH`` doubles a row."""
        self._devices: dict[torch.device, DeviceRows] = {}
        self._entries: list = []
        """``MetricRow``'s fields one entry after the other (all but ``call_id``, its position), the slot in
        place of ``values``."""
        self._named: set[tuple[str, Slot]] = set()
        self._last: list = []
        """The entries of the last step finalized, and its layout and host row of each row (made again only
        when the entries change)."""
        self._layout = RowLayout((), (), (), (), (), (), (), ())
        self._take: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._entries) // _FIELDS

    def slot(self, t: torch.Tensor) -> Slot:
        """Statistics of one non-empty tensor (a DTensor: its local tensor); returns its slot."""
        if type(t) not in _PLAIN:
            t = local_view(t)
        if self.engine.host_rows:
            row = self.engine.append_row(self._raw, t)
            if row is not None:
                return row
        return self._device_slots([t])[0]

    def compute(self, tensors: Sequence[torch.Tensor]) -> list[Slot]:
        """Statistics of non-empty ``tensors`` (any devices); returns the slot of each, in order. Those the
        kernel reads go through it in one call; the rest are summarised together, one block per device."""
        if not all(map(_PLAIN.__contains__, map(type, tensors))):
            tensors = [t if type(t) in _PLAIN else local_view(t) for t in tensors]
        if not self.engine.host_rows:
            return self._device_slots(tensors)
        base = len(self._raw) // _ROW_BYTES
        rest = self.engine.append_rows(self._raw, tensors)
        if not rest:
            return list(range(base, len(self._raw) // _ROW_BYTES))
        where: list[Slot] = []
        row = base
        skip = iter(rest)
        next_rest = next(skip, -1)
        for i in range(len(tensors)):
            if i == next_rest:
                where.append(0)
                next_rest = next(skip, -1)
            else:
                where.append(row)
                row += 1
        for i, w in zip(rest, self._device_slots([tensors[i] for i in rest])):
            where[i] = w
        return where

    def _device_slots(self, tensors: Sequence[torch.Tensor]) -> list[Slot]:
        where: list[Slot] = [0] * len(tensors)
        on_cpu: list[int] = []
        for i, t in enumerate(tensors):
            device = t.device
            if device.type == "cpu":
                on_cpu.append(i)
            else:
                where[i] = (device, self._rows_of(device).add(t))
        if on_cpu:
            device = tensors[on_cpu[0]].device
            base = self.add_block(self.engine.compute([tensors[i] for i in on_cpu]))
            for k, i in enumerate(on_cpu):
                where[i] = (device, base + k)
        return where

    def _rows_of(self, device: torch.device) -> DeviceRows:
        rows = self._devices.get(device)
        if rows is None:
            rows = self._devices[device] = DeviceRows(self.engine)
        return rows

    def add_block(self, block: torch.Tensor) -> int:
        """Store an already computed [n, len(ops)] block; returns the row of its first line (the slot of
        line k is ``(block.device, base + k)``)."""
        return self._rows_of(block.device).add_block(block)

    def add_entry(self, kind: str, name: str, module: str, micro_step: int | None, numel: int,
                  where: Slot, external: bool = False, alias: bool | None = None) -> None:
        """Name a computed row. A row may carry several names (the same tensor seen twice): all but the first
        name of a kind are aliases; ``alias`` says so when the caller knows (None: worked out here from the
        names given so far without it). ``external``: a tensor the model did not compute from its weights
        (see ``MetricRow.external``)."""
        if alias is None:
            key = (kind, where)
            alias = key in self._named
            self._named.add(key)
        self._entries.extend((kind, name, module, micro_step, numel, where, alias, external))

    def record_named(self, kind: str, names: Sequence[tuple[str, str]], micro_step: int | None, t: torch.Tensor,
                     external: bool = False) -> Slot | None:
        """Statistics of one tensor named ``names`` ((row name, module) pairs, the first not an alias, the others
        its aliases); returns its slot, or None (nothing recorded) for an empty or not floating-point tensor. The
        hooks' one call per tensor: a plain CPU float tensor the kernel reads goes to it directly (asking torch
        nothing else), anything else through ``slot``."""
        rows = self.engine.tensor_rows
        where = rows.row(self._raw, t, self.engine.count_eps, _get_num_threads()) if rows is not None else None
        if where is None:
            if not is_float_tensor(t):
                return None
            where = self.slot(t)
        numel, alias = t.numel(), False
        for name, module in names:
            self._entries.extend((kind, name, module, micro_step, numel, where, alias, external))
            alias = True
        return where

    def add_entries(self, kind: str, names: Sequence[str], modules: Sequence[str], micro_step: int | None,
                    numels: Sequence[int], where: Sequence[Slot]) -> None:
        """Name many computed rows of one kind at once, none of them an alias or external."""
        count = len(names)
        if not count:
            return
        self._entries.extend(chain.from_iterable(zip(repeat(kind, count), names, modules, repeat(micro_step, count),
                                                     numels, where, repeat(False, count), repeat(False, count))))

    def record(self, kind: str, named: Sequence[tuple[str, str, torch.Tensor]], micro_step: int | None = None) -> None:
        """Compute and name statistics of ``(name, module, tensor)`` triples; empty tensors are skipped."""
        if named:
            names, modules, tensors = zip(*named)
            self.record_columns(kind, names, modules, tensors, micro_step)

    def record_columns(self, kind: str, names: Sequence[str], modules: Sequence[str],
                       tensors: Sequence[torch.Tensor], micro_step: int | None = None) -> None:
        """``record`` of the triples ``zip(names, modules, tensors)``."""
        if self.record_plain(kind, names, modules, tensors, micro_step):
            return
        numels = [t.numel() for t in tensors]
        if 0 in numels:
            keep = list(map(bool, numels))
            names, modules, tensors, numels = (list(compress(column, keep))
                                               for column in (names, modules, tensors, numels))
        if numels:
            self.add_entries(kind, names, modules, micro_step, numels, self.compute(tensors))

    def record_plain(self, kind: str, names: Sequence[str], modules: Sequence[str], tensors: Sequence[object],
                     micro_step: int | None = None) -> bool:
        """``record_columns`` where every one of ``tensors`` is a non-empty plain CPU tensor the kernel reads: one
        kernel call (``state_rows``: the same rows and entries, no Python round per tensor); False, with nothing
        recorded, where one is not (or without the kernel)."""
        rows = self.engine.tensor_rows
        return bool(rows is not None and _state_rows is not None
                    and _state_rows(rows, self._raw, self._entries, kind, names, modules, tensors, micro_step,
                                    self.engine.count_eps, _get_num_threads()))

    def _values(self, slots: Sequence[Slot], take: np.ndarray | None = None) -> np.ndarray:
        """The values of the rows at ``slots``, ``[rows, ops]`` float64 (each rounded to float32): the host rows
        through ``StatsEngine.host_values`` at once, every device block copied to the host (one copy per
        device). ``take``: ``slots`` as an array, when known (host rows only)."""
        width = len(self.engine.ops)
        host = self.engine.host_values(self._raw) if self._raw else np.empty((0, width))
        if not self._devices:
            return host[take if take is not None else np.fromiter(slots, dtype=np.int64, count=len(slots))]
        devices = {device: rows.values() for device, rows in self._devices.items()}
        out = np.empty((len(slots), width))
        for i, w in enumerate(slots):
            out[i] = host[w] if w.__class__ is int else devices[w[0]][w[1]]
        return out

    def finalize(self) -> StepRows:
        """All rows of the step, in call order, with their values (``StepRows``: columns); then reset."""
        entries = self._entries
        if entries != self._last:  # names, kinds, slots: the same every step, as a rule
            n = len(entries) // _FIELDS
            self._layout = RowLayout(entries[0::_FIELDS], entries[1::_FIELDS], entries[2::_FIELDS],
                                     entries[3::_FIELDS], range(n), entries[4::_FIELDS], entries[6::_FIELDS],
                                     entries[7::_FIELDS])
            self._last, self._take = list(entries), None
        slots = entries[_SLOT::_FIELDS]
        if self._take is None and not self._devices:
            self._take = np.fromiter(slots, dtype=np.int64, count=len(slots))
        rows = StepRows(self._layout, self._values(slots, self._take if not self._devices else None))
        self.reset()
        return rows

    def recorded(self, stages: Iterable[str]) -> bool:
        """Whether a row of a kind of one of ``stages`` was recorded this step."""
        wanted = set(stages)
        return any(stage_of(kind) in wanted for kind in set(self._entries[0::_FIELDS]))

    def has_nonfinite(self, stages: Iterable[str]) -> bool:
        """Whether a row of a kind of one of ``stages`` (``records.STAGES``) recorded so far holds a NaN or Inf
        (one host read per device)."""
        wanted = set(stages)
        entries = self._entries
        slots = [w for kind, w in zip(entries[0::_FIELDS], entries[_SLOT::_FIELDS]) if stage_of(kind) in wanted]
        if not slots:
            return False
        values = self._values(slots)
        if not np.isfinite(values).all():
            return True
        ops = self.engine.ops
        return "nans" in ops and bool((values[:, ops.index("nans")] > 0).any())

    def reset(self) -> None:
        del self._raw[:]
        self._devices.clear()
        self._entries.clear()
        self._named.clear()

