"""``StepTriggers``: what tells the monitor that a step begins and ends, installed once and removed together.

* ``optimizer.step`` wrapped: before the update ``pre_optimizer_step`` (with the framework's step label,
  when given), after it ``post_optimizer_step`` (with whether the framework skipped the update);
* ``optimizer.zero_grad`` wrapped and a forward pre-hook on the first model chunk: a loss scaler may skip
  an update without calling ``optimizer.step()`` (``skipped_updates``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, Sequence

from torch import nn

from msprobe_core.common.patch import wrap
from msprobe_core.monitor.skipped_updates import SkippedUpdates


class StepEvents(Protocol):
    """What the optimizer patch tells (``TrainerMon`` provides it)."""

    def pre_optimizer_step(self) -> Any: ...

    def post_optimizer_step(self, optimizer_step: int | None = None, skipped: bool | None = None) -> Any: ...


logger = logging.getLogger("msprobe_core.monitor")


class StepTriggers:
    """The hooks and patches that drive one monitor; ``remove()`` takes them all off."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def install(self, monitor: StepEvents, chunks: Sequence[nn.Module], optimizer: Any, *, patch_optimizer: bool,
                skips: SkippedUpdates, step_label: Callable[[], int] | None = None,
                step_skipped: Callable[[Any], bool | None] | None = None) -> None:
        """Hook the first chunk's forward (``skips``), and with ``patch_optimizer`` the optimizer's ``step``
        and ``zero_grad``."""
        self.remove()
        self._handles.append(chunks[0].register_forward_pre_hook(skips.on_forward_start, prepend=True))
        if optimizer is None or not patch_optimizer:
            return

        def before(*args: Any, **kwargs: Any) -> int | None:
            label = step_label() if step_label is not None else None
            monitor.pre_optimizer_step()
            return label

        def after(label: int | None, result: Any) -> None:
            monitor.post_optimizer_step(label, skipped=step_skipped(result) if step_skipped is not None else None)

        self._handles.append(wrap(optimizer, "step", before=before, after=after, where="monitor: optimizer.step",
                                  logger=logger))
        if callable(getattr(optimizer, "zero_grad", None)):
            self._handles.append(wrap(optimizer, "zero_grad", before=skips.on_zero_grad,
                                      where="monitor: optimizer.zero_grad", logger=logger))

    def remove(self) -> None:
        """Take every hook and patch off (the last installed first)."""
        while self._handles:
            self._handles.pop().remove()
