"""A checkpoint as a lazy list of parameters: name -> shape, dtype and a function that loads it.

Nothing is read until ``Entry.load()`` is called, and each call returns one (merged) parameter, so a
comparison holds at most one parameter per side (plus the shards it is merged from) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

EXTRA_STATE = "_extra_state"


@dataclass
class Entry:
    """One parameter: its full shape and dtype, and how to load it (on the CPU)."""

    shape: tuple[int, ...]
    dtype: str
    load: Callable[[], torch.Tensor]
    note: str = ""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


@dataclass
class Checkpoint:
    """The parameters of one checkpoint, in storage order, with what is known about the model."""

    path: str
    kind: str
    entries: dict[str, Entry] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class LastTensor:
    """Keeps the last loaded source tensor, so parameters split from one stored tensor (q/k/v, gate/up)
    load it once when they are compared one after the other."""

    def __init__(self) -> None:
        self._key: Optional[Any] = None
        self._value: Optional[torch.Tensor] = None

    def get(self, key: Any, load: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self._key != key:
            self._value = None  # release first: at most one source tensor is held
            self._value = load()
            self._key = key
        return self._value


def tensor_entry(tensor: torch.Tensor, note: str = "") -> Entry:
    """An entry for a tensor that is already (lazily, e.g. memory-mapped) loaded."""
    return Entry(tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""), lambda: tensor, note)


def state_dict_entries(state: dict[str, Any], prefix: str = "") -> dict[str, Entry]:
    """Entries for the tensors of a (nested) state dict; ``_extra_state`` and non-tensors are skipped."""
    out: dict[str, Entry] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            if not name.endswith(EXTRA_STATE):
                out[name] = tensor_entry(value)
        elif isinstance(value, dict):
            out.update(state_dict_entries(value, f"{name}."))
    return out
