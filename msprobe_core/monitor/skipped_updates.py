"""``SkippedUpdates``: an update a loss scaler skipped without calling ``optimizer.step()``.

A loss scaler (``torch.amp.GradScaler``, a framework's own) that finds Inf/NaN gradients does not call
``optimizer.step()``, so no monitor step ends. The iteration is noticed when its gradients are cleared
(``optimizer.zero_grad`` after a backward) or, failing that, when the first chunk's forward runs more than
``grad_acc_steps`` times; if its gradients hold Inf/NaN it is judged on its own as a skipped update (its
overflowed gradients are not an anomaly) and the step starts over. Without Inf/NaN gradients nothing
changes (statistics keep accumulating).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from msprobe_core.common.tool_guard import tool_work
from msprobe_core.monitor.detector import BACKWARD_STAGES
from msprobe_core.monitor.gc_pause import gc_paused
from msprobe_core.monitor.module_hooks import in_backward
from msprobe_core.monitor.records import PARAM


logger = logging.getLogger("msprobe_core.monitor")


class SkippedUpdates:
    """Watches the steps of ``monitor`` (the ``TrainerMon`` it belongs to: typed ``Any`` here, as
    ``trainer_mon`` imports this file) for an update skipped without ``optimizer.step()``."""

    def __init__(self, monitor: Any):
        self.monitor = monitor

    def on_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """``optimizer.zero_grad`` (before): the iteration's gradients are about to be cleared."""
        mon = self.monitor
        state = mon._step
        if (state.collecting and not state.skip_checked and state.forwards >= mon.grad_acc_steps
                and mon.collector.recorded(BACKWARD_STAGES)):
            self.close_iteration()

    def on_forward_start(self, module: nn.Module, args: Any) -> None:
        """The first chunk's forward pre-hook: counts the training forwards of the step."""
        mon = self.monitor
        state = mon._step
        if not module.training or not state.collecting or in_backward():
            return
        state.forwards += 1
        if state.forwards > mon.grad_acc_steps and not state.skip_checked and self.close_iteration():
            mon._step.forwards = 1  # this forward is the first of the step begun over

    def close_iteration(self) -> bool:
        """If this iteration's gradients hold Inf/NaN, judge it as a skipped update and start the step over."""
        mon = self.monitor
        try:
            with tool_work():
                overflow = mon.recorder.nonfinite_grads()  # the weight gradients, when not cleared yet
                skipped = bool(overflow) or mon.collector.has_nonfinite(BACKWARD_STAGES)
                if skipped:
                    if mon.config.param_distribution and not mon.reader.sharded:  # the weights it ran with
                        mon._record_mapping(PARAM, mon.recorder.weights())
                    with gc_paused():
                        rows = mon.collector.finalize()
                        mon.alerts.publish(mon.detector.judge(mon.rank, mon.step_index, rows, skipped=True,
                                                              overflow=overflow))
                        del rows
        except Exception:
            logger.exception("monitor: judging a skipped update at step %d failed", mon.step_index)
            skipped = False
        if skipped:
            mon._begin_step()
        else:
            mon._step.skip_checked = True
        return skipped
