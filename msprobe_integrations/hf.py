"""Hugging Face ``Trainer`` integration: one callback for dump, monitor, alerts and hyperparameters.

    from msprobe_integrations.hf import MsprobeCallback
    trainer = Trainer(..., callbacks=[MsprobeCallback(config_path="dump.json", monitor_config_path="monitor.json")])

- Dump: one dump step per optimizer step, named by the Trainer's global step (``step1`` is the first
  optimizer step, as in the Trainer's logs), covering every micro-batch of gradient accumulation.
- Monitor: driven at the optimizer step (TensorBoard/CSV steps = global steps). Weight gradients are
  read *before* gradient clipping (the callback wraps ``Accelerator.clip_grad_norm_`` while training, as
  Lightning reports them in ``on_before_optimizer_step``); without clipping, at ``on_pre_optimizer_step``.
  Under DeepSpeed the engine steps inside ``backward()``, so gradients and optimizer states are read
  where the engine keeps them: the session follows the engine (``ProbeSession.follow_engine``), which the
  DeepSpeed integration serves through the core. An update the loss scaler skipped (fp16 overflow: the
  GradScaler under Accelerate's optimizer lowered its scale, or the DeepSpeed engine's ``skipped_steps``
  grew) is reported as a skipped step, not as NaN/Inf anomalies of its gradients.
- Alerts: anomalies go to the Trainer's logs (``msprobe/anomalies`` in ``on_log`` and ``log_history``);
  ``stop_on_nan=True`` stops training after a step with a NaN/Inf and says why.
- Hyperparameters: captured at ``on_train_begin`` into ``hyperparameters.json`` at the top of the dump
  path and the monitor folder, and into TensorBoard as text and hparams.

Everything here is glue: statistics, files and rules live in ``msprobe_core``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional

from msprobe_core import hparams
from msprobe_core.common.patch import PatchHandle, wrap
from msprobe_core.errors import require
from msprobe_core.log import setup_logging
from msprobe_core.session import NAN_RULE, ConfigLike, ProbeSession

TrainerCallback = require("transformers", "hf", "msprobe_integrations.hf").TrainerCallback

setup_logging()
logger = logging.getLogger("msprobe_core.hf")


_WRAPPER_NAMES = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "PipelineEngine")


def unwrap_model(model: Any) -> Any:
    """The module really being trained (DDP/DataParallel ``.module``, a DeepSpeed engine's ``.module``)."""
    while type(model).__name__ in _WRAPPER_NAMES and hasattr(model, "module"):
        model = model.module
    return model


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under Accelerate's ``AcceleratedOptimizer`` (and similar wrappers)."""
    seen = set()
    while hasattr(optimizer, "optimizer") and id(optimizer) not in seen and not hasattr(optimizer, "state_dict_hook"):
        seen.add(id(optimizer))
        inner = optimizer.optimizer
        if inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


def using_deepspeed(args: Any) -> bool:
    return bool(getattr(args, "deepspeed", None) or getattr(args, "hf_deepspeed_config", None))


def capture_hyperparameters(args: Any, state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> dict:
    """TrainingArguments, model config, PEFT config, optimizer, scheduler, seed, world size, precision."""
    sections: dict[str, Any] = {"training_args": args.to_dict()}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        sections["model_config"] = config.to_dict()
    peft = getattr(model, "peft_config", None)
    if isinstance(peft, Mapping):
        sections["peft_config"] = {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in peft.items()}
    ds_config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if ds_config:
        sections["ds_config"] = ds_config
    precision = hparams.mixed_precision(getattr(args, "bf16", False), getattr(args, "fp16", False))
    extra = {"world_size": getattr(args, "world_size", 1), "mixed_precision": precision, "seed": getattr(args, "seed", None),
             "global_batch_size": getattr(args, "per_device_train_batch_size", 1) * getattr(args, "world_size", 1)
             * getattr(args, "gradient_accumulation_steps", 1),
             "max_steps": getattr(state, "max_steps", None) or getattr(args, "max_steps", None)}
    if ds_config:
        extra["zero_stage"] = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    return hparams.capture("transformers.Trainer", sections, unwrap_optimizer(optimizer), lr_scheduler, extra)


class MsprobeCallback(TrainerCallback):
    """Dump, monitor, alerts and hyperparameter capture for ``transformers.Trainer`` (and subclasses
    such as TRL's ``SFTTrainer``). Either config may be omitted; a dict works in place of a path.

    ``stop_on_nan``: stop training after the step in which the monitor saw a NaN/Inf.
    ``capture_hyperparameters``: write ``hyperparameters.json`` (default True).
    ``monitor_output_dir``: overrides ``MONITOR_OUTPUT_DIR`` for the monitor's output.
    ``config_check_path``: also write msprobe's config_check pack (a zip) there, for
    ``python -m msprobe_core config_check -c A.zip B.zip``.
    """

    def __init__(self, config_path: ConfigLike = None, monitor_config_path: ConfigLike = None, *,
                 stop_on_nan: bool = False, capture_hyperparameters: bool = True,
                 monitor_output_dir: Optional[str] = None, config_check_path: Optional[str] = None):
        self.config_path = config_path
        self.config_check_path = config_check_path
        self.monitor_config_path = monitor_config_path
        self.stop_on_nan = stop_on_nan
        self.capture = capture_hyperparameters
        self.monitor_output_dir = monitor_output_dir
        self.session: Optional[ProbeSession] = None
        self.hyperparameter_files: list = []
        self._undo: list[Callable[[], None]] = []
        self._new_anomalies: list = []
        self._step_anomalies: list = []
        self._deepspeed = False
        self._scale_before: Optional[float] = None

    # ------------------------------------------------------------------------------ training
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        session = ProbeSession(self.config_path, self.monitor_config_path, monitor_output_dir=self.monitor_output_dir,
                               config_check_path=self.config_check_path)
        self.session = session
        module = unwrap_model(model)
        self._deepspeed = using_deepspeed(args)
        session.attach(module, unwrap_optimizer(optimizer), grad_acc_steps=max(1, args.gradient_accumulation_steps),
                       start_iteration=state.global_step + 1)
        if session.monitor is not None:
            self._undo.append(session.on_anomaly(self._on_anomaly))
            if self._deepspeed:
                session.follow_engine("deepspeed", lambda: self._current_step)
            else:
                hook = _clip_hook(session.gradients_ready)
                if hook is not None:
                    self._undo.append(hook.remove)
        self._current_step = state.global_step + 1
        if self.capture:
            doc = capture_hyperparameters(args, state, module, optimizer, lr_scheduler)
            self.hyperparameter_files = session.write_hyperparameters(doc)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._current_step = state.global_step + 1
        self._step_anomalies = []
        if self.session is not None:
            self.session.begin_step(self._current_step)
        return control

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.session is not None and not self._deepspeed:
            self._scale_before = grad_scaler_scale(optimizer)
            self.session.before_optimizer_step()
        return control

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.session is not None and not self._deepspeed:
            before, after = self._scale_before, grad_scaler_scale(optimizer)
            skipped = None if before is None or after is None else after < before
            self.session.after_optimizer_step(self._current_step, skipped=skipped)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.session is None:
            return control
        self.session.end_step()
        if self.stop_on_nan:
            nans = [a for a in self._step_anomalies if a.rule == NAN_RULE]
            if nans:
                first = nans[0]
                control.should_training_stop = True
                logger.warning("stopping training after step %d: %s %s has %s=%s (stop_on_nan=True)",
                               state.global_step, first.kind, first.name, first.metric, first.value)
                state.log_history.append({"msprobe/stopped_on_nan": first.describe(), "step": state.global_step})
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._new_anomalies:
            found, self._new_anomalies = self._new_anomalies, []
            summary = {"msprobe/anomalies": len(found), "msprobe/first_anomaly": found[0].describe()}
            if logs is not None:
                logs.update(summary)
            if state.log_history:
                state.log_history[-1].update(summary)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._finish()
        return control

    # ------------------------------------------------------------------------------ internals
    def _on_anomaly(self, anomaly) -> None:
        self._new_anomalies.append(anomaly)
        self._step_anomalies.append(anomaly)

    def _finish(self) -> None:
        for undo in reversed(self._undo):
            if undo is not None:
                undo()
        self._undo.clear()
        if self.session is not None:
            self.session.close()


def grad_scaler_scale(optimizer: Any) -> Optional[float]:
    """The loss scale of the GradScaler under Accelerate's optimizer (fp16 native AMP), or None without one.

    The scaler lowers it exactly when it skips an update for Inf/NaN gradients. (Accelerate's own
    ``step_was_skipped`` misses the skips of fused optimizers, which the scaler steps every time.)"""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None or not callable(getattr(scaler, "get_scale", None)) or not scaler.is_enabled():
        return None
    return float(scaler.get_scale())


def _clip_hook(before_clip: Callable[[], None]) -> Optional[PatchHandle]:
    """Wrap ``Accelerator.clip_grad_norm_`` so gradients are recorded before they are clipped."""
    try:
        from accelerate import Accelerator
    except ImportError:  # pragma: no cover
        return None
    return wrap(Accelerator, "clip_grad_norm_", before=lambda *args, **kwargs: before_clip(),
                where="recording gradients before clipping", logger=logger)


__all__ = ["MsprobeCallback"]
