"""The hooks the dump installs for a step (gradient hooks) or between start() and stop() (module hooks), kept
for their removal as hook dicts and keys instead of torch's handle objects.

A torch hook handle (``RemovableHandle``) is two to four objects Python's garbage collector tracks (the
handle and its weak references to the hook dicts). Kept for the whole step, thousands of them (one per
hooked call, two per module) add to the objects that reach the collector's oldest generation and bring on
full collections of the training's whole heap. Here the handle is dropped at once; its key and hook dicts
go into one flat list, and ``remove`` deletes exactly those keys, as ``RemovableHandle.remove`` would.
"""

from __future__ import annotations

from typing import Any


class StepHooks:
    """Hook handles, held without the handle objects."""

    __slots__ = ("_flat",)

    def __init__(self) -> None:
        self._flat: list[Any] = []  # key, number of dicts, the dicts, key, number of dicts, ...

    def __bool__(self) -> bool:
        return bool(self._flat)

    def keep(self, handle: Any) -> None:
        """Hold ``handle``'s hook (a ``torch.utils.hooks.RemovableHandle``) for ``remove``."""
        flat = self._flat
        extra = handle.extra_dict_ref or ()
        flat.append(handle.id)
        flat.append(1 + len(extra))
        flat.append(handle.hooks_dict_ref())
        for ref in extra:
            flat.append(ref())

    def remove(self) -> None:
        """Remove every hook kept since the last ``remove``."""
        flat, self._flat = self._flat, []
        i = 0
        while i < len(flat):
            key, n = flat[i], flat[i + 1]
            for hooks in flat[i + 2:i + 2 + n]:
                if hooks is not None:
                    hooks.pop(key, None)
            i += 2 + n
