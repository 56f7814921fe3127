"""``MegatronProbe``: dump, monitor and hyperparameters of one Megatron run, over a ``ProbeSession``.

Everything here is glue: where Megatron keeps its model chunks, optimizer states and arguments, and when
an iteration starts and ends. Statistics, files and rules live in ``msprobe_core``.

- Model: Megatron trains a list of model chunks (one per virtual pipeline stage), each wrapped in DDP
  (and ``Float16Module`` under bf16/fp16). The probe hooks the unwrapped chunks, so names do not depend
  on the wrappers (a bf16 and an fp32 run dump under the same names): the dump names them
  ``Module.{chunk}.…``; the monitor prefixes ``{chunk}:`` when there are several chunks (the virtual
  pipeline stage) and tags every row with its micro-batch and every anomaly with the pipeline stage.
- Dump: one dump step per iteration, labelled with Megatron's iteration number (the first iteration is
  ``step1``, as Megatron logs it), holding every micro-batch of the iteration (forward/backward ``.0``,
  ``.1``, ...). The dump config's ``step`` list selects by this label.
- Monitor: driven at ``optimizer.step()`` (the session wraps the optimizer instance's ``step``): gradients
  are read right before it, i.e. after the data-parallel reduction of the grad buffers and before
  clipping; weights are the fp32 main parameters before the update; Adam moments after it (see
  ``state_reader``). Under the distributed optimizer every rank reads its shards and the statistics are
  combined over the data-parallel group; with ``module_ranks`` naming part of that group, the ranks left
  out still contribute their shards (``msprobe_core.monitor.shard_agreement``).
- Hyperparameters: Megatron's args namespace (raw, under ``args``, with Megatron's own names), the model's
  ``TransformerConfig``, the ``OptimizerConfig``, the optimizer and LR scheduler, normalised by
  ``msprobe_core.hparams``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence, Union

import torch

from msprobe_core import hparams
from msprobe_core.errors import ConfigError
from msprobe_core.session import ConfigLike, ProbeSession, cancel_close_at_exit, close_at_exit, dist_ready, group_size
from msprobe_integrations.megatron.state_reader import MegatronStateReader, leaf_optimizers

logger = logging.getLogger("msprobe_core.megatron")

_WRAPPERS = ("DistributedDataParallel", "Float16Module", "FullyShardedDataParallel", "TorchFullyShardedDataParallel",
             "DataParallel")


def unwrap_chunk(module: Any) -> torch.nn.Module:
    """A model chunk without Megatron's DDP / FSDP / ``Float16Module`` wrappers."""
    while type(module).__name__ in _WRAPPERS and isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def unwrap_chunks(model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> list[torch.nn.Module]:
    """Megatron's model (a chunk or a list of chunks) as a list of unwrapped chunks."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise ConfigError("model", model, "a torch.nn.Module or a non-empty list of them (Megatron model chunks)")
    return [unwrap_chunk(c) for c in chunks]


# ------------------------------------------------------------------------------------------ parallel state
def _parallel_state() -> Any:
    try:
        from megatron.core import parallel_state
    except ImportError:  # pragma: no cover - the integration needs megatron-core
        return None
    return parallel_state if parallel_state.model_parallel_is_initialized() else None


def pipeline_group() -> Any:
    ps = _parallel_state()
    return ps.get_pipeline_model_parallel_group() if ps else None


def data_parallel_group() -> Any:
    ps = _parallel_state()
    return ps.get_data_parallel_group(with_context_parallel=True) if ps else None


def parallel_sizes() -> dict[str, Any]:
    ps = _parallel_state()
    if ps is None:
        return {}
    return {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
            "data_parallel_size": ps.get_data_parallel_world_size()}


def num_microbatches(args: Any = None) -> int:
    """Micro-batches per iteration: megatron-core's calculator, else from the batch-size arguments."""
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return int(get_num_microbatches())
    except Exception:  # the calculator is not initialised (custom loops)
        pass
    gbs, mbs = getattr(args, "global_batch_size", None), getattr(args, "micro_batch_size", None)
    dp = parallel_sizes().get("data_parallel_size") or getattr(args, "data_parallel_size", None) or 1
    if gbs and mbs:
        return max(1, int(gbs) // (int(mbs) * int(dp)))
    return 1


# ------------------------------------------------------------------------------------------ hyperparameters
def _dataclass_fields(obj: Any) -> Optional[dict[str, Any]]:
    if obj is None or not dataclasses.is_dataclass(obj):
        return None
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name, None)
        if callable(value) and not isinstance(value, type):
            value = getattr(value, "__qualname__", None) or type(value).__name__
        out[f.name] = value
    return out


def capture_hyperparameters(args: Any, chunks: Sequence[torch.nn.Module], optimizer: Any = None,
                            opt_param_scheduler: Any = None) -> dict[str, Any]:
    """The hyperparameters document: Megatron's args (raw, own names), model and optimizer configs,
    optimizer and scheduler settings, parallel sizes, micro-batches per iteration and precision."""
    sections: dict[str, Any] = {}
    if args is not None:
        sections["args"] = dict(vars(args))
    model_config = _dataclass_fields(getattr(chunks[0], "config", None)) if chunks else None
    if model_config:
        sections["model_config"] = model_config
    leaves = leaf_optimizers(optimizer)
    opt_config = _dataclass_fields(getattr(leaves[0], "config", None)) if leaves else None
    if opt_config:
        sections["optimizer_config"] = opt_config
    if optimizer is not None:
        sections["megatron_optimizer"] = {"class": type(optimizer).__name__,
                                          "chained": [type(o).__name__ for o in leaves]}
    args_dict = sections.get("args", {})
    extra: dict[str, Any] = {}
    for key, value in parallel_sizes().items():
        if args_dict.get(key) is None and value is not None:
            extra[key] = value
    if dist_ready() and args_dict.get("world_size") is None:
        extra["world_size"] = group_size(None)
    extra["gradient_accumulation_steps"] = num_microbatches(args)
    extra["mixed_precision"] = hparams.mixed_precision(args_dict.get("bf16", (opt_config or {}).get("bf16")),
                                                       args_dict.get("fp16", (opt_config or {}).get("fp16")))
    return hparams.capture("megatron", sections, leaves[0] if leaves else None, opt_param_scheduler, extra)


# ------------------------------------------------------------------------------------------ the probe
class MegatronProbe:
    """Dump and/or monitor of a Megatron training run. Either config may be None (a dict works in place
    of a path). Call ``setup()`` once model and optimizer exist, ``begin_iteration(n)`` before the
    forward-backward schedule of iteration ``n`` and ``end_iteration()`` after ``train_step``;
    ``close()`` at the end. ``MegatronHooks`` / ``install()`` make these calls from Megatron-LM's
    ``setup_model_and_optimizer`` and ``train_step``."""

    def __init__(self, config_path: ConfigLike = None, monitor_config_path: ConfigLike = None, *,
                 monitor_output_dir: Optional[str] = None, capture_hyperparameters: bool = True,
                 config_check_path: Optional[str] = None):
        self.config_path = config_path
        self.config_check_path = config_check_path
        self.monitor_config_path = monitor_config_path
        self.monitor_output_dir = monitor_output_dir
        self.capture = capture_hyperparameters
        self.session: Optional[ProbeSession] = None
        self.chunks: list[torch.nn.Module] = []
        self.optimizer: Any = None
        self.hyperparameter_files: list = []
        self.next_step = 1
        self._step: Optional[int] = None
        self._closed = False

    @classmethod
    def from_args(cls, args: Any) -> "MegatronProbe":
        """From Megatron's args namespace (the flags of ``add_args``)."""
        return cls(getattr(args, "msprobe_config", None), getattr(args, "msprobe_monitor_config", None),
                   monitor_output_dir=getattr(args, "msprobe_monitor_output_dir", None),
                   capture_hyperparameters=not getattr(args, "msprobe_no_hparams", False),
                   config_check_path=getattr(args, "msprobe_config_check", None))

    @property
    def enabled(self) -> bool:
        return any(p is not None for p in (self.config_path, self.monitor_config_path, self.config_check_path))

    @property
    def is_setup(self) -> bool:
        return self.session is not None

    # ------------------------------------------------------------------------------ set up
    def setup(self, model: Any, optimizer: Any = None, opt_param_scheduler: Any = None, args: Any = None,
              start_iteration: Optional[int] = None) -> "MegatronProbe":
        """Attach to the model chunks and the Megatron optimizer (after both are built and a checkpoint
        is loaded). ``start_iteration`` is the label of the next iteration (default
        ``args.iteration + 1``). Writes ``hyperparameters.json``. Does nothing when disabled or done."""
        if not self.enabled or self.session is not None:
            return self
        self.chunks = unwrap_chunks(model)
        self.optimizer = optimizer
        if start_iteration is None:
            start_iteration = int(getattr(args, "iteration", 0) or 0) + 1
        self.next_step = start_iteration
        # the pipeline group orders anomalies across pipeline stages; gradients are in main_grad
        session = ProbeSession(self.config_path, self.monitor_config_path, monitor_output_dir=self.monitor_output_dir,
                               config_check_path=self.config_check_path,
                               process_group=pipeline_group(), params_have_main_grad=True)
        self.session = session
        reader = MegatronStateReader(optimizer) if optimizer is not None else None
        # the session wraps optimizer.step: gradients after the data-parallel reduction, before clipping
        session.attach(self.chunks, optimizer, grad_acc_steps=num_microbatches(args), state_reader=reader,
                       dp_group=data_parallel_group(), start_iteration=start_iteration,
                       patch_optimizer=optimizer is not None, step_label=self._optimizer_step_label,
                       step_skipped=self._update_skipped)
        if hasattr(args, "__dict__"):
            # the checker finds Megatron's arguments only through megatron.training.get_args(), which
            # megatron-core alone (a Megatron-LM-shaped loop of one's own) does not have
            session.record_framework_arguments("megatron_args", vars(args))
        if self.capture:
            doc = capture_hyperparameters(args, self.chunks, optimizer, opt_param_scheduler)
            self.hyperparameter_files = session.write_hyperparameters(doc)
        close_at_exit(self.close)
        return self

    # ------------------------------------------------------------------------------ iterations
    def begin_iteration(self, step: Optional[int] = None) -> None:
        """Before the forward-backward schedule of iteration ``step`` (default: the next one)."""
        if self.session is None:
            return
        self._step = int(step) if step is not None else self.next_step
        self.next_step = self._step + 1
        self.session.begin_step(self._step)

    def end_iteration(self) -> None:
        """After ``train_step``: finish the iteration's dump step."""
        self._step = None
        if self.session is not None:
            self.session.end_step()

    def _optimizer_step_label(self) -> int:
        """The label of the optimizer step about to run: the iteration's, or the next one when the optimizer
        steps outside a wrapped ``train_step``."""
        if self._step is not None:
            return self._step
        label, self.next_step = self.next_step, self.next_step + 1
        return label

    @staticmethod
    def _update_skipped(result: Any) -> Optional[bool]:
        """Whether the optimizer step just run skipped its update: Megatron's ``optimizer.step()`` returns
        ``(update_successful, grad_norm, num_zeros_in_grad)``, ``update_successful`` False when the loss
        scaler found Inf/NaN gradients. None for a step that returns something else."""
        if isinstance(result, tuple) and result and isinstance(result[0], bool):
            return not result[0]
        return None

    # ------------------------------------------------------------------------------ end
    def close(self) -> None:
        """Finish the open dump step, flush the monitor, restore ``optimizer.step``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.session is not None:
            self.session.close()
        self.chunks, self.optimizer = [], None  # keep no model alive past the run
        try:
            cancel_close_at_exit(self.close)
        except Exception:  # pragma: no cover
            pass
