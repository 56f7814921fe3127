"""``ProbeSession``: what every framework integration drives, so each adapter stays a thin shim.

An integration knows *when* things happen in its framework (a step begins, gradients are final, the
optimizer stepped, training ends) and *where* tensors live; the session knows what to do then: run the
dump (``PrecisionDebugger``) over whole optimizer steps, drive the monitor (``TrainerMon``), write the
captured hyperparameters next to both outputs (once per folder, by global rank 0) and into TensorBoard.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from msprobe_core import hparams
from msprobe_core.pytorch.tool_guard import tool_work

logger = logging.getLogger("msprobe_core")

ConfigLike = Union[str, os.PathLike, Mapping[str, Any], None]


def global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


class ProbeSession:
    """An optional dump and an optional monitor, driven step by step by an integration.

    ``config_path``: the dump's config.json (path or dict; None: no dump). ``monitor_config_path``: the
    monitor's config (path or dict; None: no monitor). ``monitor_output_dir`` overrides
    ``MONITOR_OUTPUT_DIR``.
    """

    def __init__(self, config_path: ConfigLike = None, monitor_config_path: ConfigLike = None, *,
                 monitor_output_dir: Optional[str] = None):
        self.debugger = None
        self.monitor = None
        self._model: Any = None
        self._dumping = False
        if config_path is not None:
            from msprobe_core.pytorch.debugger import PrecisionDebugger
            self.debugger = PrecisionDebugger(config_path)
        if monitor_config_path is not None:
            from msprobe_core.pytorch.monitor import TrainerMon
            self.monitor = TrainerMon(monitor_config_path, output_dir=monitor_output_dir)

    # ------------------------------------------------------------------------------ set up
    def attach(self, model: Union[torch.nn.Module, Sequence[torch.nn.Module]], optimizer: Any = None,
               grad_acc_steps: int = 1, state_reader: Any = None, dp_group: Any = None, start_iteration: int = 0) -> None:
        """The real module(s) being trained and, for the monitor, the optimizer whose state it reads.
        The integration calls the step methods below itself (the optimizer is not patched)."""
        self._model = model
        if self.monitor is not None:
            if state_reader is not None:
                self.monitor.reader = state_reader
            self.monitor.set_monitor(model, grad_acc_steps=grad_acc_steps, optimizer=optimizer, dp_group=dp_group,
                                     start_iteration=start_iteration, patch_optimizer=False)

    # ------------------------------------------------------------------------------ dump
    def begin_step(self, step: int) -> None:
        """Start dumping optimizer step ``step`` (all of its micro-batches go into ``step{step}``)."""
        if self.debugger is None or self._model is None:
            return
        self.debugger.set_init_step(step)
        self.debugger.start(self._model)
        self._dumping = True

    def end_step(self) -> None:
        """Stop dumping and write the step's files."""
        if self.debugger is None or not self._dumping:
            return
        self._dumping = False
        self.debugger.stop()
        self.debugger.step()

    # ------------------------------------------------------------------------------ monitor
    def gradients_ready(self, grads: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Gradients of this optimizer step are final (before clipping): record them."""
        if self.monitor is not None:
            with tool_work():
                self.monitor.collect_grads(grads)

    def before_optimizer_step(self) -> None:
        if self.monitor is not None:
            with tool_work():
                self.monitor.pre_optimizer_step()

    def after_optimizer_step(self, step: int) -> Optional[dict]:
        """The optimizer stepped: record its states, write and check the step (labelled ``step``)."""
        if self.monitor is not None:
            with tool_work():
                return self.monitor.post_optimizer_step(optimizer_step=step)
        return None

    def on_anomaly(self, callback: Callable[[Any], None]) -> Optional[Callable[[], None]]:
        if self.monitor is not None:
            return self.monitor.register_anomaly_callback(callback)
        return None

    # ------------------------------------------------------------------------------ hyperparameters
    def output_folders(self) -> list[Path]:
        folders = []
        if self.debugger is not None:
            folders.append(Path(self.debugger.config.dump_path))
        if self.monitor is not None:
            folders.append(Path(self.monitor.output_dir))
        return folders

    def write_hyperparameters(self, doc: Mapping[str, Any]) -> list[Path]:
        """``hyperparameters.json`` at the top of each output folder (rank 0 only) and, when the monitor
        writes TensorBoard, as text and hparams there."""
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
        import json

        logdir = Path(self.monitor.output_dir) / "hparams"
        with SummaryWriter(logdir=str(logdir)) as writer:
            writer.add_text("hyperparameters", "```json\n" + json.dumps(doc, indent=1, default=str) + "\n```", 0)
            # its own sub-run: tensorboardX names event files by the second, so a second writer in the same
            # folder could replace the text's file
            writer.add_hparams(hparams.flat_for_tensorboard(doc), {"hparam/captured": 1.0}, name="hparams")

    # ------------------------------------------------------------------------------ end
    def close(self) -> None:
        """Finish the open dump step and flush/close the monitor; leaves the model as it was."""
        if self._dumping:
            self.end_step()
        if self.debugger is not None:
            self.debugger.close()
        if self.monitor is not None:
            self.monitor.close()
