"""``TrainerMon``: msprobe-compatible training monitor for PyTorch.

Per optimizer step it records statistics (config ``ops``) of activations and their gradients
(``xy_distribution``), weight gradients (``wg_distribution``), optimizer moments (``mv_distribution``)
and weights (``param_distribution``), writes them to TensorBoard / CSV / an in-memory dict, and checks
them for anomalies (NaN/Inf, ``AnomalyTurbulence``)::

    mon = TrainerMon("monitor_config.json")
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    ...  # train as usual: optimizer.step() drives the monitor
    mon.close()  # also runs at interpreter exit

Frameworks that own the optimizer pass ``patch_optimizer=False`` (or no optimizer) and call the explicit
entry points themselves: ``collect_grads()`` before clipping (optional), ``pre_optimizer_step()`` before
the update, ``post_optimizer_step(optimizer_step=..., skipped=...)`` after it (or ``step(...)`` for both at
once). ``skipped=True`` says the framework's loss scaler skipped that update (fp16 overflow): the step is
written as usual and judged as a skipped step, its overflowed gradients are not an anomaly.

Its parts, each with one responsibility (one a file); ``TrainerMon`` sequences them:

* ``StepState`` (``step_state``): the step in progress, made new at each step boundary, so no step
  inherits a flag of the one before; ``CollectionSchedule`` (``schedule``): which steps are monitored;
* ``StepTriggers`` (``step_triggers``): the optimizer patches and hooks that begin and end steps;
  ``SkippedUpdates`` (``skipped_updates``): an update a loss scaler skipped without ``optimizer.step()``;
* ``ActivationHooks`` (``module_hooks``): activations and their gradients; ``StateRecorder``
  (``state_recorder``): weights, gradients and optimizer moments through a ``StateReader`` (sharded or
  not); ``StepCollector`` (``collector``): the step's statistics, one host copy;
* ``MetricOutput`` (``step_output``): the writers; ``AnomalyDetector`` and ``AlertCenter``: judging and
  publishing; ``AnomalyCapture`` and ``MoEMonitor``.

Nothing here changes the numbers: hooks return None and never touch tensors, statistics run under
``no_grad`` on detached tensors, and everything of a step is copied to the host once.
"""

from __future__ import annotations

import json
import logging
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from msprobe_core.common.exit_close import cancel_close_at_exit, close_at_exit
from msprobe_core.errors import ConfigError
from msprobe_core.monitor.alerts import AlertCenter, AnomalyCallback
from msprobe_core.monitor.anomaly import Anomaly
from msprobe_core.monitor.capture import AnomalyCapture
from msprobe_core.monitor.detector import AnomalyDetector, SkippedStep
from msprobe_core.monitor.collector import StepCollector
from msprobe_core.monitor.gc_pause import gc_paused
from msprobe_core.monitor.config import AlertConfig, MonitorConfig, load_monitor_config
from msprobe_core.monitor.compiled_hooks import CompiledActivationHooks
from msprobe_core.monitor.module_hooks import ActivationHooks
from msprobe_core.monitor.native_reader import NativeShardReader, uses_native_sharding
from msprobe_core.monitor.moe.monitor import MoEMonitor
from msprobe_core.monitor.records import ACTV, ACTV_GRAD, EXP_AVG, EXP_AVG_SQ, GRAD, PARAM
from msprobe_core.monitor.rules.learning_rate import learning_rates
from msprobe_core.monitor.shard_agreement import contributes
from msprobe_core.monitor.schedule import CollectionSchedule, ConfigWatcher, dynamic_requested
from msprobe_core.monitor.selection import Selection, model_structure, module_names
from msprobe_core.monitor.skipped_updates import SkippedUpdates
from msprobe_core.monitor.state_readers import StateReader, TorchStateReader
from msprobe_core.monitor.state_recorder import SHARDED_KINDS, StateRecorder
from msprobe_core.monitor.stats import StatsEngine
from msprobe_core.monitor.step_output import MetricOutput
from msprobe_core.monitor.step_state import StepState
from msprobe_core.monitor.step_triggers import StepTriggers
from msprobe_core.monitor.writers import WriterContext
from msprobe_core.pytorch.compiled_taps import compiled_as_a_whole
from msprobe_core.pytorch.ranks import current_rank, rank_in
from msprobe_core.common.output_dir import check_output_dir
from msprobe_core.common.rank_folder import rank_folder_name
from msprobe_core.common.tool_guard import tool_work

logger = logging.getLogger("msprobe_core.monitor")

OUTPUT_DIR_ENV = "MONITOR_OUTPUT_DIR"
DEFAULT_OUTPUT_DIR = "./monitor_output"


class TrainerMon:
    """The training monitor of one rank. See the module docstring for the call sequence."""

    def __init__(self, config_file_path: str | os.PathLike | Mapping[str, Any], process_group: Any = None,
                 params_have_main_grad: bool = True, *, output_dir: str | os.PathLike | None = None,
                 state_reader: StateReader | None = None):
        """Load and validate the config (``ConfigError`` on invalid values); nothing is hooked yet.

        ``process_group`` is the pipeline group (its rank orders anomalies across pipeline stages);
        ``params_have_main_grad`` reads ``param.main_grad`` where present (Megatron). ``output_dir``
        overrides ``MONITOR_OUTPUT_DIR``; ``state_reader`` replaces where gradients/optimizer states are
        read from (see ``msprobe_core.monitor.state_readers``).
        """
        # a mapping works too (integrations accept dicts); dynamic_on then has no file to watch
        self.config_file_path = None if isinstance(config_file_path, Mapping) else os.fspath(config_file_path)
        self.config: MonitorConfig = load_monitor_config(config_file_path)
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        self.recorder = StateRecorder(state_reader or TorchStateReader(params_have_main_grad))
        self._own_reader = state_reader is None  # replaced by NativeShardReader for FSDP / DTensor models
        self.rank = current_rank() or 0
        self.pp_stage = rank_in(process_group) if process_group is not None else 0
        self.output_dir = Path(output_dir if output_dir is not None else os.environ.get(OUTPUT_DIR_ENV, DEFAULT_OUTPUT_DIR))
        self.rank_dir = self.output_dir / rank_folder_name(self.rank)
        self.dynamic = dynamic_requested(self.config) and self.config_file_path is not None
        self._watcher = ConfigWatcher(self.config_file_path) if self.dynamic else None

        self.step_index = 0
        self.grad_acc_steps = 1
        self.dp_group: Any = None
        self.tp_group: Any = None
        self._chunks: list[nn.Module] = []
        self._optimizer: Any = None
        self._triggers = StepTriggers()
        self._hooks: ActivationHooks | CompiledActivationHooks | None = None
        self._moe: MoEMonitor | None = None
        self.alerts = AlertCenter(self.rank, self.rank_dir, self.output_dir)
        self.capture: AnomalyCapture | None = None
        self.output: MetricOutput | None = None
        self._latest: dict[str, Any] = {}
        self._step = StepState(token=0, collecting=False)  # replaced at each step boundary (_begin_step)
        self._skips = SkippedUpdates(self, self._step, restart=self._begin_step,
                                     record_weights=partial(self._record_mapping, PARAM))
        self._closed = False
        self._configure(self.config, not_before=0)
        close_at_exit(self.close)

    # ------------------------------------------------------------------------------------ set up
    def set_monitor(self, model: nn.Module | Sequence[nn.Module], grad_acc_steps: int = 1, optimizer: Any = None,
                    dp_group: Any = None, tp_group: Any = None, start_iteration: int = 0, *,
                    patch_optimizer: bool = True, step_label: Callable[[], int] | None = None,
                    step_skipped: Callable[[Any], bool | None] | None = None) -> "TrainerMon":
        """Attach to a model (a module or a list of chunks) and an optimizer, and start monitoring.

        With ``patch_optimizer`` (the default) the optimizer instance's ``step`` is wrapped so every
        ``optimizer.step()`` is a monitor step (labelled ``step_label()``, read just before the update,
        when given; ``step_skipped(result)``, called with what it returned, says whether the framework
        skipped the update),
        and its ``zero_grad`` to notice an update a loss scaler skipped without calling ``optimizer.step()``;
        otherwise call ``step()`` (or the pre/post pair) yourself. msprobe's older argument order
        ``(model, optimizer, grad_acc_steps, ...)`` is accepted.
        """
        if _looks_like_optimizer(grad_acc_steps) and (optimizer is None or isinstance(optimizer, int)):
            grad_acc_steps, optimizer = (optimizer if optimizer is not None else 1), grad_acc_steps
        if isinstance(grad_acc_steps, bool) or not isinstance(grad_acc_steps, int) or grad_acc_steps < 1:
            raise ConfigError("grad_acc_steps", grad_acc_steps, "an int >= 1 (micro-batches per optimizer step)")
        if isinstance(start_iteration, bool) or not isinstance(start_iteration, int) or start_iteration < 0:
            raise ConfigError("start_iteration", start_iteration, "an int >= 0 (the optimizer step training resumes at)")
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if not chunks or not all(isinstance(m, nn.Module) for m in chunks):
            raise ConfigError("model", model, "a torch.nn.Module or a non-empty list of them (model chunks)")
        check_output_dir(self.output_dir, OUTPUT_DIR_ENV)  # a file or an unwritable place fails here, not mid-training
        self._uninstall()
        if self._own_reader and uses_native_sharding(chunks):
            self.reader = NativeShardReader(chunks)
        self._moe = MoEMonitor.attach(self.config, chunks, self.reader, self.rank_dir,
                                      lambda: self._step.collecting, self.pp_stage)  # a bad moe.routers fails here
        self._chunks = chunks
        self.grad_acc_steps = grad_acc_steps
        self.dp_group, self.tp_group = dp_group, tp_group
        self.step_index = start_iteration
        self._optimizer = optimizer
        self._triggers.install(self, chunks, optimizer, patch_optimizer=patch_optimizer, skips=self._skips,
                               step_label=step_label, step_skipped=step_skipped)
        if optimizer is None and self.config.mv_distribution:
            logger.warning("monitor: mv_distribution is on but set_monitor got no optimizer; moments are not read")
        self._apply_selection()
        if self.schedule.enabled:
            self.output.open()  # fail now (e.g. tensorboardX missing), not inside the training loop
        if self.config.print_struct:
            self._write_structure()
        return self

    @property
    def reader(self) -> StateReader:
        """Where gradients, weights and optimizer states are read from (``state_readers``)."""
        return self.recorder.reader

    @reader.setter
    def reader(self, reader: StateReader) -> None:
        self.recorder.reader = reader

    def set_state_reader(self, reader: StateReader, dp_group: Any = None) -> None:
        """Read gradients, weights and optimizer states through ``reader`` from now on (an integration that
        finds the engine only once training runs); ``dp_group`` replaces the data-parallel group."""
        self.reader = reader
        self._own_reader = False
        if dp_group is not None:
            self.dp_group = dp_group

    def _configure(self, config: MonitorConfig, not_before: int) -> None:
        self.config = config
        self.engine = StatsEngine(config.ops, config.eps)
        self.collector = StepCollector(self.engine)
        enabled = config.selects_rank(self.rank) and (config.dynamic_on if self.dynamic else True)
        self.schedule = CollectionSchedule.from_config(config, enabled=enabled, not_before=not_before)
        self.detector = AnomalyDetector(self._alert_config(), config.ops, self.pp_stage, events=self.alerts.events)
        self.alerts.configure(config.alert)
        if self.capture is not None:
            self.capture.close()
        self.capture = AnomalyCapture(config.on_anomaly, self.output_dir, self.rank) if config.on_anomaly else None
        self.alerts.evidence = self.capture.folder_for if self.capture is not None else None
        if self.output is not None:
            self.output.close()
        self.output = MetricOutput(config.formats, self._writer_context)

    def _alert_config(self) -> AlertConfig:
        alert = self.config.alert
        if not alert.enabled and self.alerts.callbacks:
            return AlertConfig(enabled=True, nan=alert.nan)
        return alert

    def _apply_selection(self) -> None:
        """(Re)build the monitored parameter set and activation hooks for the current config."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        selection = Selection(self.config, len(self._chunks))
        self.recorder.select(self._chunks, selection.selects_param)
        if self._chunks:
            selection.warn_unmatched(module_names(self._chunks))
        self._selection = selection
        self._begin_step()

    def _sync_hooks(self) -> None:
        want = (self.config.xy_distribution and bool(self._chunks) and not self.schedule.exhausted
                and not self._closed)
        if want and self._hooks is None:
            # a model compiled as a whole: statistics inside its graph (no graph break), rows at flush()
            hooks = CompiledActivationHooks if compiled_as_a_whole(self._chunks) else ActivationHooks
            self._hooks = hooks(self.collector, forward=self.config.xy_forward,
                                backward=self.config.xy_backward, state=self._step)
            self._hooks.install(self._chunks, self._selection.module_spec)
        elif not want and self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def _begin_step(self) -> None:
        self._step = StepState(token=self._step.token + 1,
                               collecting=self.schedule.selects(self.step_index) and not self._closed)
        self._skips.new_step(self._step)
        self.collector.reset()
        if hasattr(self, "_selection"):
            self._sync_hooks()
        if self._hooks is not None:
            self._hooks.new_step(self._step)
        if self._moe is not None:
            self._moe.new_step()

    # ------------------------------------------------------------------------- explicit entry points
    @property
    def collecting(self) -> bool:
        """Whether the current optimizer step is monitored."""
        return self._step.collecting

    def collect_grads(self, grads: Mapping[str, torch.Tensor] | None = None) -> None:
        """Record this step's weight gradients now, e.g. before gradient clipping.

        Without ``grads`` the state reader supplies them (``main_grad``/``grad``); an integration may pass
        ``{parameter name: gradient}`` itself. Later calls in the same step (including the one the
        optimizer-step hook makes) do nothing.
        """
        self._agree()
        if not self._step.reading or self._step.grads_done or not self.config.wg_distribution:
            return
        with tool_work():
            self._record_mapping(GRAD, self.recorder.grads(grads))
        self._step.grads_done = True

    def record(self, kind: str, tensors: Mapping[str, torch.Tensor], micro_step: int | None = None,
               module: str | None = None) -> None:
        """Record statistics of arbitrary named tensors under ``kind`` at the current step.

        For integrations that see tensors the monitor cannot (unreduced gradients, a framework's own
        buffers). Does nothing when the current step is not monitored.
        """
        if not self._step.collecting:
            return
        with tool_work():
            self._record_mapping(kind, tensors, micro_step, module)

    def pre_optimizer_step(self) -> None:
        """Before the optimizer update: record weights (as used by this step) and gradients."""
        if self._step.pre_done:
            return
        self._step.pre_done = True
        self._agree()
        if not self._step.reading:
            return
        try:
            with tool_work():
                self._step.lrs = learning_rates(self._optimizer)
                if self.config.param_distribution:
                    self._record_mapping(PARAM, self.recorder.weights())
                self.collect_grads()
        except Exception:
            logger.exception("monitor: reading weights/gradients failed at step %d", self.step_index)

    def post_optimizer_step(self, optimizer_step: int | None = None,
                            skipped: bool | None = None) -> dict[str, Any] | None:
        """After the optimizer update: record optimizer state, then write and check the whole step.

        ``optimizer_step`` relabels the step just finished (a framework's own counter). ``skipped``: the
        framework's loss scaler skipped this update (Inf/NaN gradients): the step is judged as a skipped
        step (``skipped_steps``) instead of its overflowed gradients being anomalies; None or False: an
        update. Returns the step's metrics dict (``api`` format, see ``get_metrics``) or None.
        """
        if optimizer_step is not None:
            self.step_index = int(optimizer_step)
        result = None
        self._agree()
        if self._step.reading:
            try:
                with tool_work():
                    if not self._step.pre_done:
                        self.pre_optimizer_step()
                    if self.config.mv_distribution and self._optimizer is not None:
                        for kind, tensors in self.recorder.moments(self._optimizer).items():
                            self._record_mapping(kind, tensors)
                    if self._step.collecting:
                        with gc_paused():  # the step's rows are made, used and freed in here
                            result = self._finish_step(skipped=bool(skipped))
            except Exception:
                logger.exception("monitor: finishing step %d failed", self.step_index)
        self.step_index += 1
        self._poll_config()
        self._begin_step()
        if self.capture is not None:  # on_anomaly.dump: the step after an alert is dumped
            self.capture.between_steps(self._chunks, self.step_index)
        return result

    def step(self, optimizer_step: int | None = None, skipped: bool | None = None) -> dict[str, Any] | None:
        """One whole monitor step, for frameworks that own the optimizer: call it after the update
        (``skipped``: see ``post_optimizer_step``)."""
        self.pre_optimizer_step()
        return self.post_optimizer_step(optimizer_step, skipped)

    # ------------------------------------------------------------------------------------ results
    def get_metrics(self) -> dict[str, Any]:
        """The latest monitored step: ``{"step": s, "metrics": {kind: {name: {op: value}}}}`` (``api`` format)."""
        return self._latest

    @property
    def anomalies(self) -> list[Anomaly]:
        """Every anomaly event found so far on this rank, in order (its origin; ``reached``: how far it spread)."""
        return self.alerts.anomalies

    @property
    def skipped_steps(self) -> list[SkippedStep]:
        """Updates a loss scaler skipped for Inf/NaN gradients (not anomalies): step and the gradient seen
        overflowing first."""
        return list(self.alerts.skipped_steps)

    def register_anomaly_callback(self, callback: AnomalyCallback) -> Callable[[], None]:
        """Call ``callback(anomaly)`` for each new anomaly (turns NaN/Inf checks on); returns an unregister function."""
        self.alerts.callbacks.append(callback)
        if not self.detector.alert.enabled:
            self.detector = AnomalyDetector(self._alert_config(), self.config.ops, self.pp_stage,
                                            events=self.alerts.events)

        def unregister() -> None:
            if callback in self.alerts.callbacks:
                self.alerts.callbacks.remove(callback)

        return unregister

    def close(self) -> None:
        """Remove every hook, restore ``optimizer.step``, flush and close all files, and let go of the model,
        the optimizer, the state reader and the process groups (nothing of the run stays alive through a
        closed monitor). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._step.collecting = False
        if self.capture is not None:
            self.capture.close()
        self._uninstall()
        if self.output is not None:
            self.output.close()
        self.alerts.close()
        self._chunks, self._optimizer = [], None
        self.recorder = StateRecorder(TorchStateReader(self.params_have_main_grad))
        self.process_group = self.dp_group = self.tp_group = None
        try:
            cancel_close_at_exit(self.close)
        except Exception:  # pragma: no cover
            pass

    def __enter__(self) -> "TrainerMon":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- internals
    def _shard_group(self) -> Any:
        return self.reader.group if self.reader.group is not None else self.dp_group

    def _agree(self) -> None:
        """Once per step, before its first sharded all-reduce: whether this rank contributes its shards to a
        step other ranks collect (``shard_agreement``). The entry points call it in the same order on every
        rank, so the ranks meet in the agreement's all-reduce."""
        state = self._step
        if isinstance(self._hooks, CompiledActivationHooks):
            self._hooks.flush()  # activation rows of a compiled model come before the step's other rows
        if state.agreed:
            return
        state.agreed = True
        if self.reader.sharded and not self._closed:
            state.contributing = contributes(state.collecting, self.config, self.dynamic, self._shard_group())

    def _uninstall(self) -> None:
        self._triggers.remove()
        for attr in ("_hooks", "_moe"):  # each has remove(); None once removed
            handle = getattr(self, attr)
            if handle is not None:
                handle.remove()
                setattr(self, attr, None)

    def _record_mapping(self, kind: str, tensors: Mapping[str, torch.Tensor], micro_step: int | None = None,
                        module: str | None = None) -> None:
        if not tensors:
            return
        if self._moe is not None:
            tensors = self._moe.rename(kind, tensors, self.reader.sharded)
        collecting = self._step.collecting
        sharded = self.reader.sharded and kind in SHARDED_KINDS
        extra = None
        if self._moe is not None and sharded:  # per-expert rows of fused expert tensors from their shards
            extra = self._moe.shard_partials(self.collector, kind, tensors, self.reader, self.recorder.params,
                                             self._shard_group())
        self.recorder.record(self.collector, kind, tensors, collecting=collecting, group=self._shard_group(),
                             micro_step=micro_step, module=module, extra=extra)
        if self._moe is not None and collecting and not sharded:
            self._moe.record(self.collector, kind, tensors, micro_step)

    def _writer_context(self) -> WriterContext:
        cfg = self.config
        return WriterContext(rank_dir=self.rank_dir, ops=cfg.ops, ndigits=cfg.ndigits, with_micro=self.grad_acc_steps > 1,
                             step_count_per_record=cfg.step_count_per_record, step_interval=cfg.step_interval)

    def _finish_step(self, skipped: bool = False) -> dict[str, Any] | None:
        rows = self.collector.finalize()  # the step's one host copy
        self.schedule.collected += 1
        step = self.step_index
        result = self.output.write(step, rows)
        if result is not None:
            self._latest = result
        self.alerts.publish(self.detector.judge(self.rank, step, rows, lrs=self._step.lrs, skipped=skipped))
        if self._moe is not None:
            self.alerts.publish(self._moe.finish(self.rank, step, self.alerts.events, result))
        return result

    def _poll_config(self) -> None:
        if self._watcher is None:
            return
        new = self._watcher.poll()
        if new is None:
            return
        self._configure(new, not_before=self.step_index)
        if self._chunks:
            self._apply_selection()
        logger.info("monitor: collection %s from step %d", "on" if self.schedule.enabled else "off", self.step_index)

    def _write_structure(self) -> None:
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        path = self.rank_dir / "module_struct.json"
        with open(path, "w", encoding="utf-8") as f:
            json.dump(model_structure(self._chunks), f, indent=1)
        logger.info("monitor: module structure of rank %d written to %s", self.rank, path)


def _looks_like_optimizer(obj: Any) -> bool:
    return not isinstance(obj, int) and hasattr(obj, "step") and (hasattr(obj, "param_groups") or hasattr(obj, "state"))


__all__ = ["TrainerMon", "ACTV", "ACTV_GRAD", "GRAD", "EXP_AVG", "EXP_AVG_SQ", "PARAM"]
