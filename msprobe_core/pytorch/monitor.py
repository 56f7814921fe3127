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
the update, ``post_optimizer_step(optimizer_step=...)`` after it (or ``step(...)`` for both at once).

Nothing here changes the numbers: hooks return None and never touch tensors, statistics run under
``no_grad`` on detached tensors, and everything of a step is copied to the host once.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from msprobe_core.errors import ConfigError
from msprobe_core.monitor.anomaly import Anomaly, AnomalyDetector
from msprobe_core.monitor.anomaly_store import AnomalyFileWriter
from msprobe_core.monitor.collector import StepCollector
from msprobe_core.monitor.config import AlertConfig, MonitorConfig, load_monitor_config
from msprobe_core.monitor.module_hooks import ActivationHooks
from msprobe_core.monitor.optimizer_patch import StepPatch
from msprobe_core.monitor.records import ACTV, ACTV_GRAD, EXP_AVG, EXP_AVG_SQ, GRAD, PARAM
from msprobe_core.monitor.schedule import CollectionSchedule, ConfigWatcher, dynamic_requested
from msprobe_core.monitor.selection import Selection, model_structure, module_names, named_parameters, owner_module
from msprobe_core.monitor.state_readers import StateReader, TorchStateReader
from msprobe_core.monitor.stats import StatsEngine, combine_partials, partials_to_ops, shard_partials
from msprobe_core.monitor.writers import ApiWriter, MetricWriter, WriterContext, make_writers
from msprobe_core.pytorch.tool_guard import tool_work

logger = logging.getLogger("msprobe_core.monitor")

OUTPUT_DIR_ENV = "MONITOR_OUTPUT_DIR"
DEFAULT_OUTPUT_DIR = "./monitor_output"
MAX_LOG_LINES_PER_STEP = 10
"""At most this many anomaly lines are logged per step; the rest are summed up in one line."""

AnomalyCallback = Callable[[Anomaly], None]


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
        self.reader: StateReader = state_reader or TorchStateReader(params_have_main_grad)
        self.rank, self.pp_stage = _rank_info(process_group)
        self.output_dir = Path(output_dir if output_dir is not None else os.environ.get(OUTPUT_DIR_ENV, DEFAULT_OUTPUT_DIR))
        self.rank_dir = self.output_dir / f"rank{self.rank}"
        self.dynamic = dynamic_requested(self.config) and self.config_file_path is not None
        self._watcher = ConfigWatcher(self.config_file_path) if self.dynamic else None

        self.step_index = 0
        self.grad_acc_steps = 1
        self.dp_group: Any = None
        self.tp_group: Any = None
        self._chunks: list[nn.Module] = []
        self._optimizer: Any = None
        self._patch: StepPatch | None = None
        self._hooks: ActivationHooks | None = None
        self._params: dict[str, nn.Parameter] = {}
        self._callbacks: list[AnomalyCallback] = []
        self._anomalies: list[Anomaly] = []
        self._anomaly_file: AnomalyFileWriter | None = None
        self._writers: list[MetricWriter] | None = None
        self._latest: dict[str, Any] = {}
        self._token = 0
        self._collecting = False
        self._pre_done = False
        self._grads_done = False
        self._closed = False
        self._configure(self.config, not_before=0)
        atexit.register(self.close)

    # ------------------------------------------------------------------------------------ set up
    def set_monitor(self, model: nn.Module | Sequence[nn.Module], grad_acc_steps: int = 1, optimizer: Any = None,
                    dp_group: Any = None, tp_group: Any = None, start_iteration: int = 0, *,
                    patch_optimizer: bool = True) -> "TrainerMon":
        """Attach to a model (a module or a list of chunks) and an optimizer, and start monitoring.

        With ``patch_optimizer`` (the default) the optimizer instance's ``step`` is wrapped so every
        ``optimizer.step()`` is a monitor step; otherwise call ``step()`` (or the pre/post pair)
        yourself. msprobe's older argument order ``(model, optimizer, grad_acc_steps, ...)`` is accepted.
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
        self._uninstall()
        self._chunks = chunks
        self.grad_acc_steps = grad_acc_steps
        self.dp_group, self.tp_group = dp_group, tp_group
        self.step_index = start_iteration
        self._optimizer = optimizer
        if optimizer is not None and patch_optimizer:
            self._patch = StepPatch(optimizer, self.pre_optimizer_step, self.post_optimizer_step)
            self._patch.install()
        if optimizer is None and self.config.mv_distribution:
            logger.warning("monitor: mv_distribution is on but set_monitor got no optimizer; moments are not read")
        self._apply_selection()
        if self.schedule.enabled:
            self._ensure_writers()  # fail now (e.g. tensorboardX missing), not inside the training loop
        if self.config.print_struct:
            self._write_structure()
        return self

    def _configure(self, config: MonitorConfig, not_before: int) -> None:
        self.config = config
        self.engine = StatsEngine(config.ops, config.eps)
        self.collector = StepCollector(self.engine)
        enabled = config.selects_rank(self.rank) and (config.dynamic_on if self.dynamic else True)
        self.schedule = CollectionSchedule.from_config(config, enabled=enabled, not_before=not_before)
        self.detector = AnomalyDetector(self._alert_config(), config.ops, self.pp_stage)
        if config.alert.dump and self._anomaly_file is None:
            self._anomaly_file = AnomalyFileWriter(self.rank_dir)
        elif not config.alert.dump:
            self._anomaly_file = None
        self._close_writers()

    def _alert_config(self) -> AlertConfig:
        alert = self.config.alert
        if not alert.enabled and self._callbacks:
            return AlertConfig(enabled=True, nan=alert.nan)
        return alert

    def _apply_selection(self) -> None:
        """(Re)build the monitored parameter set and activation hooks for the current config."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        selection = Selection(self.config, len(self._chunks))
        self._params = {n: p for n, p in named_parameters(self._chunks).items() if selection.selects_param(n)}
        if self._chunks:
            selection.warn_unmatched(module_names(self._chunks))
        self._selection = selection
        self._begin_step()

    def _sync_hooks(self) -> None:
        want = (self.config.xy_distribution and bool(self._chunks) and not self.schedule.exhausted
                and not self._closed)
        if want and self._hooks is None:
            self._hooks = ActivationHooks(self.collector, forward=self.config.xy_forward,
                                          backward=self.config.xy_backward,
                                          is_active=lambda: self._collecting, step_token=lambda: self._token)
            self._hooks.install(self._chunks, self._selection.module_spec)
        elif not want and self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def _begin_step(self) -> None:
        self._token += 1
        self._collecting = self.schedule.selects(self.step_index) and not self._closed
        self._pre_done = False
        self._grads_done = False
        self.collector.reset()
        if hasattr(self, "_selection"):
            self._sync_hooks()
        if self._hooks is not None:
            self._hooks.new_step()

    # ------------------------------------------------------------------------- explicit entry points
    @property
    def collecting(self) -> bool:
        """Whether the current optimizer step is monitored."""
        return self._collecting

    def collect_grads(self, grads: Mapping[str, torch.Tensor] | None = None) -> None:
        """Record this step's weight gradients now, e.g. before gradient clipping.

        Without ``grads`` the state reader supplies them (``main_grad``/``grad``); an integration may pass
        ``{parameter name: gradient}`` itself. Later calls in the same step (including the one the
        optimizer-step hook makes) do nothing.
        """
        if not self._collecting or self._grads_done or not self.config.wg_distribution:
            return
        with tool_work():
            if grads is None:
                grads = self.reader.grads(self._params)
            order = [n for n in reversed(list(self._params)) if n in grads] + [n for n in grads if n not in self._params]
            self._record_mapping(GRAD, {n: grads[n] for n in order})
        self._grads_done = True

    def record(self, kind: str, tensors: Mapping[str, torch.Tensor], micro_step: int | None = None,
               module: str | None = None) -> None:
        """Record statistics of arbitrary named tensors under ``kind`` at the current step.

        For integrations that see tensors the monitor cannot (unreduced gradients, a framework's own
        buffers). Does nothing when the current step is not monitored.
        """
        if not self._collecting:
            return
        with tool_work():
            self._record_mapping(kind, tensors, micro_step, module)

    def pre_optimizer_step(self) -> None:
        """Before the optimizer update: record weights (as used by this step) and gradients."""
        if self._pre_done:
            return
        self._pre_done = True
        if not self._collecting:
            return
        try:
            with tool_work():
                if self.config.param_distribution:
                    self._record_mapping(PARAM, self.reader.weights(self._params))
                self.collect_grads()
        except Exception:
            logger.exception("monitor: reading weights/gradients failed at step %d", self.step_index)

    def post_optimizer_step(self, optimizer_step: int | None = None) -> dict[str, Any] | None:
        """After the optimizer update: record optimizer state, then write and check the whole step.

        ``optimizer_step`` relabels the step just finished (a framework's own counter). Returns the
        step's metrics dict (``api`` format, see ``get_metrics``) or None.
        """
        if optimizer_step is not None:
            self.step_index = int(optimizer_step)
        result = None
        if self._collecting:
            try:
                with tool_work():
                    if not self._pre_done:
                        self.pre_optimizer_step()
                    if self.config.mv_distribution and self._optimizer is not None:
                        states = self.reader.optimizer_states(self._optimizer, self._params)
                        for kind in (EXP_AVG, EXP_AVG_SQ):
                            if kind in states:
                                self._record_mapping(kind, states[kind])
                    result = self._finish_step()
            except Exception:
                logger.exception("monitor: finishing step %d failed", self.step_index)
        self.step_index += 1
        self._poll_config()
        self._begin_step()
        return result

    def step(self, optimizer_step: int | None = None) -> dict[str, Any] | None:
        """One whole monitor step, for frameworks that own the optimizer: call it after the update."""
        self.pre_optimizer_step()
        return self.post_optimizer_step(optimizer_step)

    # ------------------------------------------------------------------------------------ results
    def get_metrics(self) -> dict[str, Any]:
        """The latest monitored step: ``{"step": s, "metrics": {kind: {name: {op: value}}}}`` (``api`` format)."""
        return self._latest

    @property
    def anomalies(self) -> list[Anomaly]:
        """Every anomaly found so far on this rank, in order."""
        return list(self._anomalies)

    def register_anomaly_callback(self, callback: AnomalyCallback) -> Callable[[], None]:
        """Call ``callback(anomaly)`` for each new anomaly (turns NaN/Inf checks on); returns an unregister function."""
        self._callbacks.append(callback)
        if not self.detector.alert.enabled:
            self.detector = AnomalyDetector(self._alert_config(), self.config.ops, self.pp_stage)

        def unregister() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return unregister

    def close(self) -> None:
        """Remove every hook, restore ``optimizer.step``, flush and close all files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._collecting = False
        self._uninstall()
        self._close_writers()
        try:
            atexit.unregister(self.close)
        except Exception:  # pragma: no cover
            pass

    def __enter__(self) -> "TrainerMon":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- internals
    def _uninstall(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self._patch is not None:
            self._patch.remove()
            self._patch = None

    def _record_mapping(self, kind: str, tensors: Mapping[str, torch.Tensor], micro_step: int | None = None,
                        module: str | None = None) -> None:
        if not tensors:
            return
        if self.reader.sharded and kind in (GRAD, EXP_AVG, EXP_AVG_SQ, PARAM):
            self._record_sharded(kind, tensors)
            return
        items = [(name, module if module is not None else owner_module(name), t) for name, t in tensors.items()
                 if isinstance(t, torch.Tensor)]
        self.collector.record(kind, items, micro_step)

    def _record_sharded(self, kind: str, tensors: Mapping[str, torch.Tensor]) -> None:
        names = sorted(tensors)
        partials = shard_partials(self.engine, [tensors[n] for n in names])
        group = self.reader.group if self.reader.group is not None else self.dp_group
        block = partials_to_ops(combine_partials(partials, group), self.config.ops)
        base = self.collector.add_block(block)
        for i, name in enumerate(names):
            p = self._params.get(name)
            numel = int(getattr(p, "ds_numel", 0) or (p.numel() if p is not None else 0))
            self.collector.add_entry(kind, name, owner_module(name), None, numel, (block.device, base + i))

    def _ensure_writers(self) -> list[MetricWriter]:
        if self._writers is None:
            cfg = self.config
            ctx = WriterContext(rank_dir=self.rank_dir, ops=cfg.ops, ndigits=cfg.ndigits,
                                with_micro=self.grad_acc_steps > 1, step_count_per_record=cfg.step_count_per_record,
                                step_interval=cfg.step_interval)
            self._writers = make_writers(cfg.formats, ctx)
        return self._writers

    def _close_writers(self) -> None:
        if self._writers:
            for w in self._writers:
                try:
                    w.close()
                except Exception:  # pragma: no cover
                    logger.exception("monitor: closing a writer failed")
        self._writers = None

    def _finish_step(self) -> dict[str, Any] | None:
        rows = self.collector.finalize()  # the step's one host copy
        self.schedule.collected += 1
        step = self.step_index
        result = None
        for w in self._ensure_writers():
            w.write(step, rows)
            if isinstance(w, ApiWriter):
                self._latest = result = w.latest
        found = self.detector.check(self.rank, step, rows)
        if found:
            self._report(found)
        return result

    def _report(self, found: list[Anomaly]) -> None:
        self._anomalies.extend(found)
        for a in found[:MAX_LOG_LINES_PER_STEP]:
            logger.warning("monitor: %s", a.describe())
        if len(found) > MAX_LOG_LINES_PER_STEP:
            where = f" (all in {self._anomaly_file.path})" if self._anomaly_file else ""
            logger.warning("monitor: ... and %d more anomalies at step %d%s",
                           len(found) - MAX_LOG_LINES_PER_STEP, found[0].step, where)
        if self._anomaly_file is not None:
            self._anomaly_file.add(found)
        for cb in list(self._callbacks):
            for a in found:
                try:
                    cb(a)
                except Exception:
                    logger.exception("monitor: anomaly callback %r failed", cb)

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


def _rank_info(process_group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        pp = dist.get_rank(group=process_group) if process_group is not None else 0
        return rank, max(pp, 0)
    return 0, 0


def _looks_like_optimizer(obj: Any) -> bool:
    return not isinstance(obj, int) and hasattr(obj, "step") and (hasattr(obj, "param_groups") or hasattr(obj, "state"))


__all__ = ["TrainerMon", "ACTV", "ACTV_GRAD", "GRAD", "EXP_AVG", "EXP_AVG_SQ", "PARAM"]
