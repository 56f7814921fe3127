"""The gradient hooks of one dumped step, kept for their removal at the step's end as (hook dict, id) pairs.

A torch hook handle (``RemovableHandle``) is two objects Python's garbage collector tracks (the handle and
its weak reference to the hook dict). Kept for the whole step, thousands of them (one per hooked call) add
to the objects that reach the collector's oldest generation and bring on full collections of the
training's whole heap. Here the handle is dropped at once; its hook dict and key go into one flat list, and
``remove`` deletes exactly those keys, as ``RemovableHandle.remove`` would.
"""

from __future__ import annotations

from typing import Any


class StepHooks:
    """Hook handles of one step, held without the handle objects."""

    __slots__ = ("_flat",)

    def __init__(self) -> None:
        self._flat: list[Any] = []  # hook dict, key, hook dict, key, ... (a handle and None where it has extra dicts)

    def __bool__(self) -> bool:
        return bool(self._flat)

    def keep(self, handle: Any) -> None:
        """Hold ``handle``'s hook (a ``torch.utils.hooks.RemovableHandle``) for ``remove``."""
        flat = self._flat
        if handle.extra_dict_ref:  # not the case of tensor and node hooks: keep the handle itself
            flat.append(handle)
            flat.append(None)
        else:
            flat.append(handle.hooks_dict_ref())
            flat.append(handle.id)

    def remove(self) -> None:
        """Remove every hook kept since the last ``remove``."""
        flat, self._flat = self._flat, []
        for i in range(0, len(flat), 2):
            held, key = flat[i], flat[i + 1]
            if key is None:
                held.remove()
            elif held is not None:
                held.pop(key, None)
