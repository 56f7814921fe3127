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
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from torch import nn

from msprobe_core.common.tool_guard import tool_work
from msprobe_core.monitor.detector import BACKWARD_STAGES
from msprobe_core.monitor.gc_pause import gc_paused
from msprobe_core.monitor.module_hooks import in_backward
from msprobe_core.monitor.step_state import StepState

if TYPE_CHECKING:
    import torch

    from msprobe_core.monitor.alerts import AlertCenter
    from msprobe_core.monitor.collector import StepCollector
    from msprobe_core.monitor.config import MonitorConfig
    from msprobe_core.monitor.detector import AnomalyDetector
    from msprobe_core.monitor.state_readers import StateReader
    from msprobe_core.monitor.state_recorder import StateRecorder


logger = logging.getLogger("msprobe_core.monitor")


class WatchedMonitor(Protocol):
    """What ``SkippedUpdates`` reads of its monitor (``TrainerMon`` provides it): its public parts, read when
    used, since a new config (``dynamic_on``) or a new state reader replaces them."""

    grad_acc_steps: int       # micro-batches per optimizer step (``set_monitor``)
    step_index: int           # the step being collected
    rank: int
    config: MonitorConfig
    collector: StepCollector  # the step's statistics so far
    recorder: StateRecorder   # weights and gradients through the state reader
    detector: AnomalyDetector
    alerts: AlertCenter

    @property
    def reader(self) -> StateReader:
        """Where weights, gradients and optimizer states are read (``sharded``: shards of them)."""
        ...


class SkippedUpdates:
    """Watches the steps of a monitor for an update skipped without ``optimizer.step()``.

    Given: the ``monitor`` (``WatchedMonitor``), the step in progress (``step``; ``new_step`` gives the next
    one), ``restart`` (begin the step over: the monitor makes a new ``StepState`` and passes it to
    ``new_step``) and ``record_weights`` (record the weights a skipped update ran with as the step's
    parameter statistics)."""

    def __init__(self, monitor: WatchedMonitor, step: StepState, restart: Callable[[], None],
                 record_weights: Callable[[Mapping[str, torch.Tensor]], None]) -> None:
        self.monitor = monitor
        self.step = step
        self._restart = restart
        self._record_weights = record_weights

    def new_step(self, step: StepState) -> None:
        """The monitor began a new step (or began this one over)."""
        self.step = step

    def on_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """``optimizer.zero_grad`` (before): the iteration's gradients are about to be cleared."""
        state = self.step
        mon = self.monitor
        if (state.collecting and not state.skip_checked and state.forwards >= mon.grad_acc_steps
                and mon.collector.recorded(BACKWARD_STAGES)):
            self.close_iteration()

    def on_forward_start(self, module: nn.Module, args: Any) -> None:
        """The first chunk's forward pre-hook: counts the training forwards of the step."""
        state = self.step
        if not module.training or not state.collecting or in_backward():
            return
        state.forwards += 1
        if state.forwards > self.monitor.grad_acc_steps and not state.skip_checked and self.close_iteration():
            self.step.forwards = 1  # this forward is the first of the step begun over

    def close_iteration(self) -> bool:
        """If this iteration's gradients hold Inf/NaN, judge it as a skipped update and start the step over."""
        mon = self.monitor
        try:
            with tool_work():
                overflow = mon.recorder.nonfinite_grads()  # the weight gradients, when not cleared yet
                skipped = bool(overflow) or mon.collector.has_nonfinite(BACKWARD_STAGES)
                if skipped:
                    if mon.config.param_distribution and not mon.reader.sharded:  # the weights it ran with
                        self._record_weights(mon.recorder.weights())
                    with gc_paused():
                        rows = mon.collector.finalize()
                        mon.alerts.publish(mon.detector.judge(mon.rank, mon.step_index, rows, skipped=True,
                                                              overflow=overflow))
                        del rows
        except Exception:
            logger.exception("monitor: judging a skipped update at step %d failed", mon.step_index)
            skipped = False
        if skipped:
            self._restart()
        else:
            self.step.skip_checked = True
        return skipped
