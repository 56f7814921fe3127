"""Wrap one optimizer instance's ``step`` with before/after callbacks, and undo it exactly.

Only the instance is patched (``optimizer.step = wrapper``), never the class, so other optimizers of
the same class are untouched. ``remove`` restores what was there before; if something else wrapped
``step`` on top of ours in the meantime (an LR scheduler created later), ours turns into a plain
pass-through instead of breaking that chain.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

_MISSING = object()


class StepPatch:
    """``before()`` runs just before the real ``step``, ``after()`` just after it returned."""

    def __init__(self, optimizer: Any, before: Callable[[], None], after: Callable[[], None]):
        self.optimizer = optimizer
        self._before = before
        self._after = after
        self._active = False
        self._original_attr: Any = _MISSING
        self._wrapper: Callable[..., Any] | None = None

    @property
    def installed(self) -> bool:
        return self._wrapper is not None

    def install(self) -> None:
        if self._wrapper is not None:
            return
        opt = self.optimizer
        self._original_attr = opt.__dict__.get("step", _MISSING)
        inner = opt.step
        patch = self

        @functools.wraps(inner)
        def step(*args: Any, **kwargs: Any) -> Any:
            if not patch._active:
                return inner(*args, **kwargs)
            patch._before()
            out = inner(*args, **kwargs)
            patch._after()
            return out

        step.__msprobe_monitor_patch__ = True  # type: ignore[attr-defined]
        opt.step = step
        self._wrapper = step
        self._active = True

    def remove(self) -> None:
        if self._wrapper is None:
            return
        opt = self.optimizer
        self._active = False
        if opt.__dict__.get("step") is self._wrapper:
            if self._original_attr is _MISSING:
                del opt.step
            else:
                opt.step = self._original_attr
        self._wrapper = None
