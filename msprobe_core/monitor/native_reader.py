"""Weights, gradients and Adam moments under PyTorch's own sharding, per original parameter (``NativeShardReader``).

``TrainerMon.set_monitor`` picks this reader by itself (once, at install) when the model holds DTensor
parameters (FSDP2 ``fully_shard``, tensor parallel ``parallelize_module``) or FSDP1 units, unless a
``state_reader`` was given. Every parameter is named as in the model without wrappers; FSDP1's flat
parameters (``use_orig_params=False``) are split back into the original parameters.

Each rank reads only its own pieces (``msprobe_core.pytorch.native_shards``). ``partials`` turns them into
partial statistics (sum, sum of squares, NaN and zero counts, numel, min, max), each with the group its pieces
add up over; the monitor all-reduces them with two scalar all-reduces per process group per kind
(``shard_stats``): the statistics are those of the full tensors, never gathered. A tensor the reader cannot read (a ``Partial`` DTensor) is reported once
by name and left out on every rank alike.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from msprobe_core.monitor.selection import named_parameters
from msprobe_core.monitor.shard_stats import LOCAL, shard_partials
from msprobe_core.monitor.state_readers import STATE_KINDS, StateReader
from msprobe_core.monitor.stats import StatsEngine
from msprobe_core.pytorch.native_shards import FlatSlot, LocalPiece, dtensor_start, fsdp1_slots, is_dtensor, piece_of

logger = logging.getLogger("msprobe_core.monitor")

_NOT_COUNTED = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, float("inf"), float("-inf")], dtype=torch.float64)


def uses_native_sharding(chunks: Sequence[nn.Module]) -> bool:
    """Whether any parameter is a DTensor or any module an FSDP1 unit."""
    for chunk in chunks:
        if any(is_dtensor(p) for p in chunk.parameters()):
            return True
        if next(fsdp1_slots(chunk), None) is not None:
            return True
    return False


class NativeShardReader(StateReader):
    """Reads DTensor and FSDP1 pieces of every original parameter (see the module docstring)."""

    sharded = True

    def __init__(self, chunks: Sequence[nn.Module]):
        multi = len(chunks) > 1
        self._slots: dict[str, FlatSlot] = {}
        for c, chunk in enumerate(chunks):
            self._slots.update(fsdp1_slots(chunk, f"{c}:" if multi else ""))
        self._flats = {id(s.flat) for s in self._slots.values()}
        self._warned: set[str] = set()

    # ------------------------------------------------------------------------------ parameters
    def named_parameters(self, chunks: Sequence[nn.Module]) -> dict[str, nn.Parameter]:
        out: dict[str, nn.Parameter] = {}
        for name, p in named_parameters(chunks).items():
            if id(p) not in self._flats:
                out[name] = p
        for name, slot in self._slots.items():
            out[name] = slot.orig if slot.orig is not None else slot.flat
        return out

    def full_numel(self, name: str, param: Any) -> int:
        slot = self._slots.get(name)
        return slot.numel if slot is not None else int(param.numel())

    def full_shape(self, name: str, param: Any) -> tuple[int, ...]:
        slot = self._slots.get(name)
        return slot.shape if slot is not None else tuple(param.shape)

    def shard_start(self, name: str, param: Any) -> int | None:
        slot = self._slots.get(name)
        if slot is not None:
            return slot.start
        return dtensor_start(param) if is_dtensor(param) else 0

    # ------------------------------------------------------------------------------ readers
    def _skip(self, what: str, name: str) -> None:
        if (what, name) not in self._warned:
            self._warned.add((what, name))  # type: ignore[arg-type]
            logger.warning("monitor: the %s of %s is a pending sum (Partial DTensor) and cannot be read from its "
                           "shards; left out", what, name)

    def _pieces(self, what: str, params: Mapping[str, Any], read: Callable[[str, Any], Any]) -> dict[str, LocalPiece]:
        out: dict[str, LocalPiece] = {}
        for name, p in params.items():
            piece = read(name, p)
            if piece is False:
                continue  # nothing to read, on every rank
            if piece is None:
                self._skip(what, name)
                continue
            out[name] = piece
        return out

    def weights(self, params: Mapping[str, nn.Parameter]) -> dict[str, Any]:
        def read(name: str, p: Any) -> Any:
            slot = self._slots.get(name)
            return slot.cut(slot.flat) if slot is not None else piece_of(p)
        return self._pieces("weight", params, read)

    def grads(self, params: Mapping[str, nn.Parameter]) -> dict[str, Any]:
        def read(name: str, p: Any) -> Any:
            slot = self._slots.get(name)
            if slot is not None:
                return slot.cut(slot.flat.grad) if slot.flat.grad is not None else False
            return piece_of(p.grad) if p.grad is not None else False
        return self._pieces("gradient", params, read)

    def optimizer_states(self, optimizer: Any, params: Mapping[str, nn.Parameter]) -> dict[str, dict[str, Any]]:
        state = getattr(optimizer, "state", None)
        if not state:
            return {}
        held = {k for s in state.values() for k in s}  # the keys this optimizer keeps (the same on every rank)
        out: dict[str, dict[str, Any]] = {}
        for key, kind in STATE_KINDS.items():
            if key not in held:
                continue

            def read(name: str, p: Any, key: str = key) -> Any:
                slot = self._slots.get(name)
                if slot is None:
                    t = (state.get(p) or {}).get(key)
                    return piece_of(t) if isinstance(t, torch.Tensor) else False
                if slot.orig is not None:  # use_orig_params: state of the original parameter, already this rank's range
                    t = (state.get(slot.orig) or {}).get(key)  # none where this rank holds no piece of it
                    return slot.own(t if isinstance(t, torch.Tensor) else slot.flat.new_zeros(0))
                t = (state.get(slot.flat) or {}).get(key)
                return slot.cut(t) if isinstance(t, torch.Tensor) else False
            found = self._pieces(key, params, read)
            if found:
                out.setdefault(kind, {}).update(found)
        return out

    # ------------------------------------------------------------------------------ combining
    def partials(self, engine: StatsEngine, names: Sequence[str], tensors: Mapping[str, Any],
                 group: Any) -> tuple[torch.Tensor, list[Any]]:
        pieces: list[LocalPiece] = [tensors[n] for n in names]
        rows = shard_partials(engine, [p.tensor for p in pieces])
        for i, piece in enumerate(pieces):
            if not piece.counts:
                rows[i] = _NOT_COUNTED.to(rows.device)
        return rows, [piece.group if piece.sharded else LOCAL for piece in pieces]
