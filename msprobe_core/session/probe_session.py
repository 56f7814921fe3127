"""``ProbeSession``: the dump and the monitor of one process, driven by an integration's events.

See ``msprobe_core.session`` for the lifecycle every integration drives and what each event means.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from msprobe_core import hparams
from msprobe_core.common.exit_close import cancel_close_at_exit, close_at_exit
from msprobe_core.common.patch import PatchHandle
from msprobe_core.common.tool_guard import tool_work
from msprobe_core.pytorch.ranks import global_rank
from msprobe_core.session.engine_followers import engine_follower

logger = logging.getLogger("msprobe_core.session")

ConfigLike = Union[str, os.PathLike, Mapping[str, Any], None]
Model = Union[torch.nn.Module, Sequence[torch.nn.Module]]


class ProbeSession:
    """An optional dump and an optional monitor, driven step by step by an integration.

    ``config_path``: the dump's config.json (path or dict; None: no dump); ``dump_path`` overrides its
    ``dump_path``. ``monitor_config_path``: the monitor's config (path or dict; None: no monitor);
    ``monitor_output_dir`` overrides ``MONITOR_OUTPUT_DIR``. ``process_group``: the pipeline-parallel group
    (its rank orders anomalies across pipeline stages). ``params_have_main_grad``: gradients are read from
    ``param.main_grad`` where present (Megatron) before ``param.grad``. ``config_check_path``: also write
    msprobe's config_check pack there (``msprobe_core.config_check``: environment, packages, hyperparameters,
    the weights and batches of the first micro-steps, random-number call sites); its random-number patches go
    on at once, its model hook at ``attach``, and everything comes off at ``close``.
    """

    def __init__(self, config_path: ConfigLike = None, monitor_config_path: ConfigLike = None, *,
                 monitor_output_dir: Optional[str] = None, dump_path: Optional[str] = None,
                 process_group: Any = None, params_have_main_grad: bool = True,
                 config_check_path: Optional[str] = None):
        self.debugger = None
        self.config_checker = None
        self._config_check_path = None if config_check_path is None else os.fspath(config_check_path)
        self.monitor = None
        self._model: Optional[Model] = None
        self._optimizer: Any = None
        self._rank_id: Optional[int] = None
        self._dumping = False
        self._owns_debugger = False
        self._followers: list[Any] = []
        if config_path is not None:
            from msprobe_core.pytorch.debugger import PrecisionDebugger

            self._owns_debugger = PrecisionDebugger.current() is None
            self.debugger = PrecisionDebugger(config_path, dump_path=dump_path)
        if self._config_check_path is not None:
            from msprobe_core.config_check import ConfigChecker

            ConfigChecker.apply_patches(fmk="pytorch")
        if monitor_config_path is not None:
            from msprobe_core.monitor.trainer_mon import TrainerMon

            self.monitor = TrainerMon(monitor_config_path, process_group=process_group,
                                      params_have_main_grad=params_have_main_grad, output_dir=monitor_output_dir)

    # ------------------------------------------------------------------------------ what it is attached to
    @property
    def model(self) -> Optional[Model]:
        """The module (or model chunks) given to ``attach``."""
        return self._model

    @property
    def optimizer(self) -> Any:
        """The optimizer given to ``attach``."""
        return self._optimizer

    @property
    def dump_path(self) -> Optional[Path]:
        """The dump's ``dump_path`` (absolute), or None without a dump."""
        return Path(self.debugger.config.dump_path).absolute() if self.debugger is not None else None

    @property
    def dump_step(self) -> Optional[int]:
        """The number of the dump step the next ``end_step()`` finishes, or None without a dump."""
        return self.debugger.current_step if self.debugger is not None else None

    # ------------------------------------------------------------------------------ event: attach
    def attach(self, model: Model, optimizer: Any = None, grad_acc_steps: int = 1, state_reader: Any = None,
               dp_group: Any = None, start_iteration: int = 0, *, patch_optimizer: bool = False,
               step_label: Optional[Callable[[], int]] = None, step_skipped: Optional[Callable[[Any], Optional[bool]]] = None,
               rank_id: Optional[int] = None) -> None:
        """The real module(s) being trained, and, for the monitor, the optimizer whose state it reads.

        ``grad_acc_steps``: micro-batches per optimizer step. ``state_reader``: where gradients, weights and
        optimizer states live (``msprobe_core.monitor.state_readers``; a sharded reader combines shard
        statistics over its group, or ``dp_group``). ``start_iteration``: the label of the first monitored
        step. ``patch_optimizer``: wrap ``optimizer.step`` so that every call runs ``gradients_ready``,
        ``before_optimizer_step`` and ``after_optimizer_step(step_label(), skipped=step_skipped(result))``,
        ``result`` being what ``optimizer.step()`` returned (the integration then makes none of these calls
        itself). ``rank_id``: name the dump's rank folder explicitly.
        """
        self._model = model
        self._optimizer = optimizer
        self._rank_id = rank_id
        close_at_exit(self.close)  # also by finish_distributed(): the session lets go of the model then
        if self._config_check_path is not None and self.config_checker is None:
            from msprobe_core.config_check import ConfigChecker

            self.config_checker = ConfigChecker(model=model, output_zip_path=self._config_check_path, fmk="pytorch")
        if self.monitor is not None:
            if state_reader is not None:
                self.monitor.set_state_reader(state_reader)
            self.monitor.set_monitor(model, grad_acc_steps=grad_acc_steps, optimizer=optimizer, dp_group=dp_group,
                                     start_iteration=start_iteration, patch_optimizer=patch_optimizer,
                                     step_label=step_label, step_skipped=step_skipped)

    def set_state_reader(self, reader: Any, dp_group: Any = None) -> None:
        """Read the monitor's states through ``reader`` from now on (for an engine found only once training
        runs); ``dp_group`` replaces the data-parallel group."""
        if self.monitor is not None:
            self.monitor.set_state_reader(reader, dp_group)

    def follow_engine(self, kind: str, current_step: Callable[[], int]) -> Optional[PatchHandle]:
        """Let the integration registered for engines of ``kind`` drive this session's monitor at that
        engine's optimizer steps, labelled ``current_step()`` (e.g. the Hugging Face Trainer running
        DeepSpeed; see ``msprobe_core.session.engine_followers``). Returns its handle (undone by ``close``),
        or None when no integration for ``kind`` is installed."""
        follower = engine_follower(kind)
        if follower is None:
            logger.warning("msprobe: no integration follows %s engines here; the monitor reads nothing from them",
                           kind)
            return None
        handle = follower(self, current_step)
        self._followers.append(handle)
        return handle

    # ------------------------------------------------------------------------------ events: dump steps
    def begin_step(self, step: Optional[int] = None, *, token_range: Optional[Sequence[int]] = None) -> None:
        """Step begin: dump everything until ``end_step`` into step ``step`` (all micro-batches; None: the
        debugger's own count). ``token_range=[start, end]`` dumps only the forward passes producing those
        tokens (0 = the prefill)."""
        if self.debugger is None or self._model is None:
            return
        if step is not None:
            self.debugger.set_init_step(step)
        self.debugger.start(self._model, token_range=token_range, rank_id=self._rank_id)
        self._dumping = True

    def end_step(self) -> Optional[Path]:
        """Step end: stop dumping and write the step's files. Returns the rank folder whose dump.json was
        written (``dump_path/step{N}/rank{R}``), or None when the step wrote none."""
        if self.debugger is None or not self._dumping:
            return None
        self._dumping = False
        self.debugger.stop()
        self.debugger.step()
        return self.debugger.last_rank_dir

    # ------------------------------------------------------------------------------ events: optimizer step
    def gradients_ready(self, grads: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Gradients ready: this step's gradients are final (reduced, before clipping); the monitor records
        them now (from its state reader, or ``grads = {parameter name: gradient}``)."""
        if self.monitor is not None:
            with tool_work():
                self.monitor.collect_grads(grads)

    def before_optimizer_step(self) -> None:
        """Just before the optimizer update: weights (as this step used them) and gradients."""
        if self.monitor is not None:
            with tool_work():
                self.monitor.pre_optimizer_step()

    def after_optimizer_step(self, step: Optional[int] = None, skipped: Optional[bool] = None) -> Optional[dict]:
        """After the optimizer step: optimizer states are recorded, then the monitor step (labelled ``step``;
        None: the monitor's own count) is written and checked. ``skipped=True``: the framework's loss scaler
        skipped this update (fp16 overflow), so the step is reported as a skipped step, not as NaN/Inf
        anomalies (None: not known). Returns its metrics (``api`` format) or None."""
        if self.monitor is not None:
            with tool_work():
                return self.monitor.post_optimizer_step(optimizer_step=step, skipped=skipped)
        return None

    def on_anomaly(self, callback: Callable[[Any], None]) -> Optional[Callable[[], None]]:
        """Call ``callback(anomaly)`` for each anomaly the monitor finds; returns the unregister function."""
        if self.monitor is not None:
            return self.monitor.register_anomaly_callback(callback)
        return None

    # ------------------------------------------------------------------------------ hyperparameters
    def output_folders(self) -> list[Path]:
        """The folders this session writes into: the dump path and the monitor's output folder."""
        folders = []
        if self.debugger is not None:
            folders.append(Path(self.debugger.config.dump_path))
        if self.monitor is not None:
            folders.append(Path(self.monitor.output_dir))
        return folders

    def record_framework_arguments(self, section: str, args: Mapping[str, Any]) -> None:
        """Put the framework's own arguments (Megatron's ``args``...) under ``section`` in the config_check
        pack's hyperparameters; nothing when the session has no config_check path. Call it after ``attach``."""
        if self.config_checker is not None:
            self.config_checker.record_hyperparameters({section: dict(args)})

    def write_hyperparameters(self, doc: Mapping[str, Any]) -> list[Path]:
        """``hyperparameters.json`` at the top of each output folder (global rank 0 only) and, when the
        monitor writes TensorBoard, as text and hparams there. Returns the files written."""
        if self.config_checker is not None:  # every rank: the checker writes from rank 0 itself
            self.config_checker.record_hyperparameters({"msprobe": dict(doc.get("normalized", {}))})
        if global_rank() != 0:
            return []
        written = [hparams.write(folder, doc) for folder in self.output_folders()]
        if self.monitor is not None and "tensorboard" in self.monitor.config.formats:
            self._hparams_to_tensorboard(doc)
        return written

    def _hparams_to_tensorboard(self, doc: Mapping[str, Any]) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:  # pragma: no cover - tensorboardX is part of the monitor extra
            return
        logdir = Path(self.monitor.output_dir) / "hparams"
        with SummaryWriter(logdir=str(logdir)) as writer:
            writer.add_text("hyperparameters", "```json\n" + json.dumps(doc, indent=1, default=str) + "\n```", 0)
            # its own sub-run: tensorboardX names event files by the second, so a second writer in the same
            # folder could replace the text's file
            writer.add_hparams(hparams.flat_for_tensorboard(doc), {"hparam/captured": 1.0}, name="hparams")

    # ------------------------------------------------------------------------------ event: close
    def close(self) -> None:
        """Close: finish the open dump step, undo every patch the session made, flush and close the
        monitor. A debugger this session created is released, so a later session may use another config.
        Leaves the model as it was, and lets go of it, of the optimizer and of every process group: a
        closed session keeps no framework object alive (a DDP reducer or a gloo group that lives until
        interpreter exit can abort it). Idempotent."""
        while self._followers:
            self._followers.pop().remove()
        if self.config_checker is not None:
            self.config_checker.close()
        if self._dumping:
            self.end_step()
        if self.debugger is not None:
            if self._owns_debugger:
                type(self.debugger).release(self.debugger)
            else:
                self.debugger.close()
        if self.monitor is not None:
            self.monitor.close()
        self._model = self._optimizer = None
        cancel_close_at_exit(self.close)
