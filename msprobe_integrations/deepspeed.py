"""DeepSpeed integration: dump and monitor a ``DeepSpeedEngine`` under ZeRO stage 0, 1, 2 and 3 with one call.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    from msprobe_integrations.deepspeed import patch_engine
    engine = patch_engine(engine, config_path="dump.json", monitor_config_path="monitor.json")
    ...  # train as usual: engine(x), engine.backward(loss), engine.step()
    unpatch(engine)  # optional: original methods back, outputs flushed

or, as a drop-in for ``deepspeed.initialize``,
``engine, optimizer, _, _ = msprobe_integrations.deepspeed.initialize(model=..., config=..., config_path=...,
monitor_config_path=...)``.

- Dump: one dump step per optimizer step, named by ``engine.global_steps`` as it is while the step's
  micro-batches run (``step0`` holds the first accumulation window, as DeepSpeed counts). Every micro-batch
  of a gradient-accumulation window lands in that step: the window opens at the first ``engine(...)``
  (forward of ``engine.module``) and closes after ``engine.step()`` at the accumulation boundary
  (``engine.is_gradient_accumulation_boundary()``), so backward passes are inside it.
- Monitor: driven at the engine's optimizer step (``_take_model_step``, only called at the boundary):
  weights and gradients are read before the update (before gradient clipping, which ZeRO does inside its
  optimizer step and stage 0 just before it), optimizer states after it. They are read where the engine
  keeps them (``make_state_reader``): ``param.grad`` and ``optimizer.state[param]`` at stage 0; this rank's
  fragments of the fp32 master weights, the reduced gradient partitions and the partitioned Adam states at
  stage 1-2 (``param._hp_mapping``); the ``ds_tensor`` partitions (fp32 master, gradient and state
  partitions, padding cut off) at stage 3, where ``param.numel()`` is 0 outside gather windows. The
  monitor computes partial statistics of each rank's shards and all-reduces scalars over the data-parallel
  group (``msprobe_core.monitor.stats``); nothing is gathered. Gradients the engine keeps multiplied by the
  fp16 loss scale are divided by it; with DeepSpeed's stage-0 fp16/bf16 optimizers weights and states are
  those of the fp32 master copies. Monitor steps are labelled with ``engine.global_steps`` like the dump.
- Collectives: every rank reaches the engine's optimizer step. When the monitor might collect on some ranks
  and not others (``module_ranks`` leaving out ranks of the group, ``dynamic_on``), the ranks first agree
  with one 1-element all-reduce per step, and a rank that does not collect still contributes its shards to
  the scalar all-reduces (and writes nothing), so no rank waits for another forever.
- Hyperparameters: the ds_config, zero stage, micro batch, accumulation, precision, optimizer and scheduler
  through ``msprobe_core.hparams.capture`` into ``hyperparameters.json`` (and TensorBoard).
- ``patch_engine`` is idempotent (a second call returns the engine unchanged) and ``unpatch`` reverses it.

For the Hugging Face Trainer (which steps the engine inside ``backward()``), ``msprobe_integrations.hf``
calls ``follow_trainer_engine``. This module is glue: statistics, files and rules live in ``msprobe_core``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping, Optional, Union

import torch

from msprobe_core import hparams
from msprobe_core.errors import ConfigError, MsprobeError
from msprobe_core.monitor.records import EXP_AVG, EXP_AVG_SQ
from msprobe_core.monitor.selection import Selection, named_parameters
from msprobe_core.monitor.state_readers import STATE_KINDS, StateReader, TorchStateReader
from msprobe_core.monitor.stats import combine_partials, shard_partials
from msprobe_core.pytorch.session import ProbeSession

logger = logging.getLogger("msprobe_integrations.deepspeed")

ConfigLike = Union[str, os.PathLike, Mapping[str, Any], None]

PATCH_ATTR = "_msprobe_patch"
"""The engine attribute holding its ``EnginePatch`` while patched."""

class DeepSpeedIntegrationError(MsprobeError, RuntimeError):
    """The object given is not a usable DeepSpeed engine, or DeepSpeed is missing."""


# ---------------------------------------------------------------------------------------------- helpers
def _is_engine(obj: Any) -> bool:
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:  # pragma: no cover - deepspeed is an optional dependency
        return False
    return isinstance(obj, DeepSpeedEngine)


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _group_size(group: Any) -> int:
    return torch.distributed.get_world_size(group) if _dist_ready() else 1


def _group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group`` (None: the world)."""
    if not _dist_ready():
        return [0]
    if group is None:
        return list(range(torch.distributed.get_world_size()))
    return list(torch.distributed.get_process_group_ranks(group))


def _loss_scale(engine: Any) -> float:
    """The factor the engine's gradients carry when the monitor reads them (before the optimizer step):
    the fp16 loss scale where ``engine.backward`` scaled the loss (ZeRO optimizers, torch autocast's
    GradScaler), else 1. (DeepSpeed's stage-0 fp16 optimizers are not ZeRO optimizers; their gradients
    are not scaled.)"""
    try:
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        opt = engine.optimizer
        scale: Any = 1.0
        if isinstance(opt, ZeROOptimizer):
            if getattr(opt, "custom_loss_scaler", False):
                scale = getattr(opt, "external_loss_scale", None) or 1.0
            elif getattr(opt, "torch_autocast_gradscaler", None) is not None:
                scale = opt.torch_autocast_gradscaler.get_scale()
            elif getattr(opt, "loss_scaler", None) is not None:
                scale = opt.loss_scaler.cur_scale
        elif getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
            scale = engine.torch_autocast_z0_gradscaler.get_scale()
        scale = float(scale)
        return scale if scale > 0 else 1.0
    except Exception:  # an engine without these attributes: treat gradients as unscaled
        return 1.0


def _unscale(t: torch.Tensor, scale: float) -> torch.Tensor:
    return t if scale == 1.0 or t.numel() == 0 else t.float() / scale


def _empty_like_device(t: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=t.device if t is not None else device)


def _torch_optimizer(optimizer: Any) -> Any:
    """The innermost torch optimizer under DeepSpeed's wrappers (``.optimizer`` chains)."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


def zero_stage(engine: Any) -> int:
    """The engine's ZeRO stage (0 when ZeRO is off)."""
    try:
        return int(engine.zero_optimization_stage())
    except Exception:
        return 0


def dp_group(engine: Any) -> Any:
    """The process group ZeRO partitions over (the optimizer's ``dp_process_group``, else the engine's)."""
    group = getattr(engine.optimizer, "dp_process_group", None)
    if group is None:
        group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
    return group


# ---------------------------------------------------------------------------------------------- readers
class Stage0Reader(TorchStateReader):
    """ZeRO stage 0 (plain data parallel): every rank holds whole ``param.grad`` and optimizer states,
    already all-reduced at the boundary, so statistics are local (``sharded = False``). With DeepSpeed's
    fp16/bf16 optimizers the weights are the fp32 master copies and the states those of the masters."""

    sharded = False

    def __init__(self, engine: Any):
        super().__init__(params_have_main_grad=False)
        self.engine = engine
        self.group = dp_group(engine)

    def _masters(self) -> dict[int, tuple[torch.Tensor, Callable[[str], Optional[torch.Tensor]]]]:
        """``id(model param) -> (fp32 master, state getter)`` for DeepSpeed's fp16 optimizers (empty otherwise)."""
        opt = self.engine.optimizer
        state = getattr(_torch_optimizer(opt), "state", None) or {}
        lp_groups = getattr(opt, "fp16_groups", None) or []
        out: dict[int, tuple[torch.Tensor, Callable[[str], Optional[torch.Tensor]]]] = {}
        unfused = getattr(opt, "fp32_groups", None)
        flats = getattr(opt, "fp32_groups_flat", None)
        for i, lps in enumerate(lp_groups):
            if unfused is not None and i < len(unfused):  # FP16_UnfusedOptimizer: one master per parameter
                for lp, hp in zip(lps, unfused[i]):
                    out[id(lp)] = (hp, lambda key, hp=hp: (state.get(hp) or {}).get(key))
            elif flats is not None and i < len(flats):  # FP16_Optimizer: one flat master per group
                offset = 0
                for lp in lps:
                    n = lp.numel()

                    def get(key: str, flat=flats[i], offset=offset, n=n, lp=lp) -> Optional[torch.Tensor]:
                        t = (state.get(flat) or {}).get(key)
                        return t.narrow(0, offset, n).view_as(lp) if isinstance(t, torch.Tensor) else None

                    out[id(lp)] = (flats[i].narrow(0, offset, n).view_as(lp), get)
                    offset += n
        return out

    def weights(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        masters = self._masters()
        return {n: masters[id(p)][0] if id(p) in masters else p for n, p in params.items()}

    def grads(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        scale = _loss_scale(self.engine)
        return {n: _unscale(g, scale) for n, g in super().grads(params).items()}

    def optimizer_states(self, optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
        masters = self._masters()
        if not masters:
            return super().optimizer_states(_torch_optimizer(self.engine.optimizer), params)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in params.items():
            if id(p) not in masters:
                continue
            for key, kind in STATE_KINDS.items():
                t = masters[id(p)][1](key)
                if isinstance(t, torch.Tensor):
                    out.setdefault(kind, {})[name] = t
        return out


class FragmentReader(StateReader):
    """ZeRO stage 1-2 (and DeepSpeed's bf16 optimizer): each parameter ``p`` linked to the fp32 master
    partition of this rank through ``p._hp_mapping`` (None where this rank holds no piece of ``p``).

    Weights: the fp32 master fragment. Gradients: the reduced gradient of the fragment (``averaged_gradients``,
    present between the boundary backward and the optimizer step). States: the optimizer-state fragments,
    linked after the first optimizer step. A rank without a piece of a parameter returns an empty tensor,
    so every rank returns the same names (the monitor's combine all-reduces rows in sorted-name order).
    """

    sharded = True

    def __init__(self, engine: Any):
        self.engine = engine
        self.group = dp_group(engine)
        self._warned: set[str] = set()

    def _warn_once(self, what: str, exc: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("msprobe: could not read %s from the ZeRO optimizer (%s); reported as empty", what, exc)

    def weights(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in params.items():
            if not hasattr(p, "_hp_mapping"):
                continue
            hm = p._hp_mapping
            out[name] = hm.get_hp_fragment() if hm is not None else _empty_like_device(None, p.device)
        return out

    def grads(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        scale = _loss_scale(self.engine)
        out: dict[str, torch.Tensor] = {}
        for name, p in params.items():
            if not hasattr(p, "_hp_mapping"):
                continue
            hm = p._hp_mapping
            if hm is None:
                out[name] = _empty_like_device(None, p.device)
                continue
            try:
                frag = hm.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
            except Exception as exc:  # no gradients at this moment (outside the boundary)
                self._warn_once(f"the gradient of {name}", exc)
                out[name] = _empty_like_device(None, p.device)
                continue
            address = hm.lp_fragment_address
            if frag.numel() == p.numel() and frag.numel() != address.numel:
                # a full-size accumulation buffer (bf16 optimizer, one rank): keep this rank's fragment only
                frag = frag.narrow(0, address.start, address.numel)
            out[name] = _unscale(frag, scale)
        return out

    def optimizer_states(self, optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
        zero = self.engine.optimizer
        keys = _state_keys(zero)
        if not keys:
            return {}  # the optimizer has not stepped yet (the same on every rank)
        inner_state = getattr(_torch_optimizer(zero), "state", None) or {}
        flats = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_groups_flat_partition", None) or []
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in params.items():
            if not hasattr(p, "_hp_mapping"):
                continue
            hm = p._hp_mapping
            state = None
            if hm is not None and hm.param_group_index < len(flats):
                state = inner_state.get(flats[hm.param_group_index])
            for key in keys:
                frag = None
                if hm is not None:
                    # the torch optimizer's state of this rank's flat fp32 partition, cut to p's fragment. (DeepSpeed's
                    # own hp_mapping.optim_fragment is linked once, after the first group stepped, so it stays
                    # empty for later param groups.)
                    flat_state = state.get(key) if state else None
                    if isinstance(flat_state, torch.Tensor) and flat_state.dim() == 1:
                        address = hm.hp_fragment_address
                        frag = flat_state.narrow(0, address.start, address.numel)
                    elif hm.optim_fragment:
                        frag = hm.optim_fragment.get(key)
                out.setdefault(STATE_KINDS[key], {})[name] = frag if frag is not None else _empty_like_device(None, p.device)
        return out


def _state_keys(zero_optimizer: Any) -> list[str]:
    """The monitored state keys the torch optimizer under ZeRO keeps (``exp_avg``, ``exp_avg_sq``, SGD's
    ``momentum_buffer``); the optimizer's type decides it, so every rank gets the same answer."""
    state = getattr(_torch_optimizer(zero_optimizer), "state", None) or {}
    for s in state.values():
        return [k for k in STATE_KINDS if k in s and isinstance(s[k], torch.Tensor)]
    return []


class Stage3Reader(StateReader):
    """ZeRO stage 3: parameters are partitioned into ``p.ds_tensor`` (``p.numel() == 0`` outside gather
    windows). Reads this rank's fp32 master partition, gradient partition and state partitions through
    DeepSpeed's local (non-collective) accessors, with the padding of the last partition cut off."""

    sharded = True

    def __init__(self, engine: Any):
        self.engine = engine
        self.group = dp_group(engine)
        self._warned: set[str] = set()

    def _valid(self, p: torch.nn.Parameter, shard: Optional[torch.Tensor]) -> torch.Tensor:
        """The part of this rank's partition that holds elements of ``p`` (no padding)."""
        if shard is None:
            return _empty_like_device(None, p.ds_tensor.device)
        shard = shard.reshape(-1)
        size = int(p.ds_tensor.ds_numel if hasattr(p.ds_tensor, "ds_numel") else p.ds_tensor.numel())
        group = getattr(p, "ds_process_group", None)
        rank = torch.distributed.get_rank(group=group) if _dist_ready() else 0
        valid = max(0, min(size, int(p.ds_numel) - rank * size))
        return shard.narrow(0, 0, min(valid, shard.numel()))

    def _read(self, what: str, name: str, p: torch.nn.Parameter, fn: Callable[[], Any]) -> torch.Tensor:
        try:
            return self._valid(p, fn())
        except Exception as exc:
            if what not in self._warned:
                self._warned.add(what)
                logger.warning("msprobe: could not read the %s of %s from ZeRO-3 (%s); reported as empty", what, name, exc)
            return _empty_like_device(None, p.ds_tensor.device)

    def weights(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_local_fp32_param
        return {n: self._read("weight", n, p, lambda p=p: safe_get_local_fp32_param(p))
                for n, p in params.items() if hasattr(p, "ds_id")}

    def grads(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_local_grad
        scale = _loss_scale(self.engine)
        return {n: _unscale(self._read("gradient", n, p, lambda p=p: safe_get_local_grad(p)), scale)
                for n, p in params.items() if hasattr(p, "ds_id")}

    def optimizer_states(self, optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
        from deepspeed.utils import safe_get_local_optimizer_state
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key in _state_keys(self.engine.optimizer):  # empty before the first optimizer step
            out[STATE_KINDS[key]] = {n: self._read(key, n, p, lambda p=p, k=key: safe_get_local_optimizer_state(p, k))
                                     for n, p in params.items() if hasattr(p, "ds_id")}
        return out


def make_state_reader(engine: Any) -> StateReader:
    """The reader for where this engine keeps gradients and optimizer states (see the module docstring)."""
    params = list(engine.module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        return Stage3Reader(engine)
    if any(hasattr(p, "_hp_mapping") for p in params):
        return FragmentReader(engine)
    return Stage0Reader(engine)


# ---------------------------------------------------------------------------------------------- hyperparameters
def engine_hyperparameters(engine: Any, source: str = "deepspeed") -> dict[str, Any]:
    """The hyperparameters document of an engine: its ds_config, the model config when it has one, the
    optimizer and scheduler, with zero stage, micro batch, accumulation, precision, optimizer and scheduler
    names normalised."""
    ds_config = engine.config if isinstance(getattr(engine, "config", None), Mapping) else \
        getattr(getattr(engine, "_config", None), "_param_dict", None)
    sections: dict[str, Any] = {"ds_config": ds_config}
    model_config = getattr(engine.module, "config", None)
    if model_config is not None and hasattr(model_config, "to_dict"):
        sections["model_config"] = model_config.to_dict()
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    torch_opt = _torch_optimizer(engine.optimizer)
    scheduler = engine.lr_scheduler
    clip = engine.gradient_clipping()
    extra = {
        "zero_stage": zero_stage(engine),
        "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "global_batch_size": engine.train_batch_size(),
        "data_parallel_size": getattr(engine, "dp_world_size", None),
        "world_size": torch.distributed.get_world_size() if _dist_ready() else 1,
        "mixed_precision": precision,
        "optimizer": engine.optimizer_name() or (type(torch_opt).__name__ if torch_opt is not None else None),
        "lr_scheduler": engine.scheduler_name() or (type(scheduler).__name__ if scheduler is not None else None),
        "max_grad_norm": clip if clip else None,
        "zero_optimizer": type(engine.optimizer).__name__ if engine.optimizer is not None else None,
    }
    return hparams.capture(source, sections, torch_opt, scheduler, extra)


# ---------------------------------------------------------------------------------------------- monitor driver
class MonitorDriver:
    """Drives a session's monitor at one engine's optimizer step, keeping the collectives of every rank
    of the data-parallel group in lockstep (see the module docstring)."""

    def __init__(self, session: ProbeSession, engine: Any, reader: StateReader):
        self.session = session
        self.engine = engine
        self.reader = reader
        self._shadow = False
        mon = session.monitor
        self._agree = bool(mon is not None and reader.sharded and _group_size(reader.group) > 1
                           and (mon.dynamic or not all(mon.config.selects_rank(r) for r in _group_ranks(reader.group))))

    def before(self) -> None:
        """Before the optimizer update (gradients are still there): weights and gradients."""
        mon = self.session.monitor
        if mon is None:
            return
        self._shadow = False
        if self._agree:
            flag = torch.tensor([1.0 if mon.collecting else 0.0], device=self._device())
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.reader.group)
            self._shadow = bool(flag.item() > 0) and not mon.collecting
        if self._shadow:
            self._shadow_before()
        else:
            self.session.before_optimizer_step()

    def after(self, step: int) -> Optional[dict]:
        """After the optimizer update: optimizer states, then the step is written and checked."""
        mon = self.session.monitor
        if mon is None:
            return None
        if self._shadow:
            self._shadow_after()
            self._shadow = False
        return self.session.after_optimizer_step(step)

    # A rank that does not collect this step while others do: the same all-reduces, nothing recorded.
    def _device(self) -> torch.device:
        try:
            from deepspeed.accelerator import get_accelerator
            return torch.device(get_accelerator().current_device_name())
        except Exception:  # pragma: no cover
            return torch.device("cpu")

    def _params(self) -> dict[str, torch.nn.Parameter]:
        mon = self.session.monitor
        selection = Selection(mon.config, 1)
        return {n: p for n, p in named_parameters([self.engine.module]).items() if selection.selects_param(n)}

    def _contribute(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not tensors:
            return
        names = sorted(tensors)
        combine_partials(shard_partials(self.session.monitor.engine, [tensors[n] for n in names]), self.reader.group)

    def _shadow_before(self) -> None:
        config = self.session.monitor.config
        params = self._params()
        if config.param_distribution:
            self._contribute(self.reader.weights(params))
        if config.wg_distribution:
            self._contribute(self.reader.grads(params))

    def _shadow_after(self) -> None:
        mon = self.session.monitor
        if not mon.config.mv_distribution or getattr(mon, "_optimizer", None) is None:
            return
        states = self.reader.optimizer_states(getattr(mon, "_optimizer", None), self._params())
        for kind in (EXP_AVG, EXP_AVG_SQ):
            if kind in states:
                self._contribute(states[kind])


# ---------------------------------------------------------------------------------------------- engine patch
class EnginePatch:
    """What ``patch_engine`` installed on one engine: instance-level wrappers of ``forward``, ``step`` and
    ``_take_model_step``, the session and the monitor driver. ``remove()`` undoes it."""

    def __init__(self, engine: Any, session: ProbeSession, reader: Optional[StateReader]):
        self.engine = engine
        self.session = session
        self.reader = reader
        self.driver = MonitorDriver(session, engine, reader) if (session.monitor is not None and reader is not None) else None
        self.in_window = False
        self._saved: dict[str, Any] = {}
        self.hyperparameter_files: list = []

    # -- wrappers -------------------------------------------------------------------------------
    def _install(self, name: str, wrapper: Callable[..., Any]) -> None:
        self._saved[name] = self.engine.__dict__.get(name, _MISSING)
        wrapper.__wrapped__ = getattr(self.engine, name)  # type: ignore[attr-defined]
        object.__setattr__(self.engine, name, wrapper)

    def install(self) -> None:
        engine = self.engine
        if self.session.debugger is not None:
            forward, step = engine.forward, engine.step

            def patched_forward(*args: Any, **kwargs: Any) -> Any:
                if not self.in_window:
                    self.session.begin_step(int(engine.global_steps))
                    self.in_window = True
                return forward(*args, **kwargs)

            def patched_step(*args: Any, **kwargs: Any) -> Any:
                boundary = engine.is_gradient_accumulation_boundary()
                out = step(*args, **kwargs)
                if boundary and self.in_window:
                    self.in_window = False
                    self.session.end_step()
                return out

            self._install("forward", patched_forward)
            self._install("step", patched_step)
        if self.driver is not None:
            take = engine._take_model_step
            driver = self.driver

            def patched_take_model_step(*args: Any, **kwargs: Any) -> Any:
                label = int(engine.global_steps)
                _guarded(driver.before, "before the optimizer step")
                out = take(*args, **kwargs)
                _guarded(lambda: driver.after(label), "after the optimizer step")
                return out

            self._install("_take_model_step", patched_take_model_step)

    def remove(self, close: bool = True) -> None:
        for name, saved in self._saved.items():
            if saved is _MISSING:
                self.engine.__dict__.pop(name, None)
            else:
                object.__setattr__(self.engine, name, saved)
        self._saved.clear()
        if close:
            self.session.close()
            # the dump's debugger is one per process: forget ours so a later patch_engine can use a new config
            from msprobe_core.pytorch.debugger import PrecisionDebugger

            if self.session.debugger is not None and PrecisionDebugger._instance is self.session.debugger:
                PrecisionDebugger.reset()
        self.in_window = False


_MISSING = object()


def _guarded(fn: Callable[[], Any], where: str) -> None:
    try:
        fn()
    except Exception:  # never break training for monitoring
        logger.exception("msprobe: monitoring %s failed", where)


def patch_engine(engine: Any, config_path: ConfigLike = None, monitor_config_path: ConfigLike = None, *,
                 monitor_output_dir: Optional[str] = None, capture_hyperparameters: bool = True) -> Any:
    """Dump (``config_path``: the dump's config.json, path or dict) and monitor (``monitor_config_path``)
    a ``DeepSpeedEngine`` returned by ``deepspeed.initialize``; returns the same engine.

    Idempotent: patching an already patched engine returns it unchanged (a warning says the new configs
    were ignored). ``unpatch(engine)`` removes everything and flushes the outputs.
    """
    if not _is_engine(engine):
        raise DeepSpeedIntegrationError(f"patch_engine expects the DeepSpeedEngine returned by deepspeed.initialize, "
                                        f"got {type(engine).__name__}")
    existing = getattr(engine, PATCH_ATTR, None)
    if existing is not None:
        if config_path is not None or monitor_config_path is not None:
            logger.warning("msprobe: the engine is already patched; the configs given now are ignored "
                           "(call unpatch(engine) first to change them)")
        return engine
    if config_path is None and monitor_config_path is None:
        raise ConfigError("config_path/monitor_config_path", None,
                          "at least one of them: the dump's config.json and/or the monitor's config (path or dict)")
    if engine.optimizer is None and monitor_config_path is not None:
        raise ConfigError("monitor_config_path", monitor_config_path,
                          "only for an engine with an optimizer (deepspeed.initialize(..., optimizer=...) or a ds_config optimizer)")
    session = ProbeSession(config_path, monitor_config_path, monitor_output_dir=monitor_output_dir)
    reader = make_state_reader(engine) if session.monitor is not None else None
    session.attach(engine.module, engine.optimizer, grad_acc_steps=max(1, int(engine.gradient_accumulation_steps())),
                   state_reader=reader, dp_group=reader.group if reader is not None else None,
                   start_iteration=int(engine.global_steps))
    patch = EnginePatch(engine, session, reader)
    patch.install()
    object.__setattr__(engine, PATCH_ATTR, patch)
    if capture_hyperparameters:
        try:
            patch.hyperparameter_files = session.write_hyperparameters(engine_hyperparameters(engine))
        except Exception:
            logger.exception("msprobe: capturing the DeepSpeed hyperparameters failed")
    logger.info("msprobe: DeepSpeed engine patched (ZeRO stage %d, reader %s)", zero_stage(engine),
                type(reader).__name__ if reader is not None else "none")
    return engine



def get_patch(engine: Any) -> Optional[EnginePatch]:
    """The engine's ``EnginePatch`` (its ``session``, ``reader``) or None when it is not patched."""
    return getattr(engine, PATCH_ATTR, None)


def unpatch(engine: Any, close: bool = True) -> Any:
    """Undo ``patch_engine``: the engine's own methods come back; with ``close`` the open dump step is
    written and the monitor's files are flushed and closed. Does nothing on an unpatched engine."""
    patch = getattr(engine, PATCH_ATTR, None)
    if patch is None:
        return engine
    patch.remove(close=close)
    engine.__dict__.pop(PATCH_ATTR, None)
    return engine


def initialize(*args: Any, config_path: ConfigLike = None, monitor_config_path: ConfigLike = None,
               monitor_output_dir: Optional[str] = None, capture_hyperparameters: bool = True, **kwargs: Any) -> Any:
    """Drop-in for ``deepspeed.initialize``: the same arguments and return value, with the engine patched
    (``patch_engine``) when a dump or monitor config is given."""
    import deepspeed

    result = deepspeed.initialize(*args, **kwargs)
    if config_path is not None or monitor_config_path is not None:
        patch_engine(result[0], config_path, monitor_config_path, monitor_output_dir=monitor_output_dir,
                     capture_hyperparameters=capture_hyperparameters)
    return result


# ---------------------------------------------------------------------------------------------- HF Trainer
def follow_trainer_engine(session: ProbeSession, current_step: Callable[[], int]) -> Callable[[], None]:
    """Monitor a Trainer-owned engine: wrap ``DeepSpeedEngine._take_model_step`` (class level) so that at
    every optimizer step the session's monitor reads the engine's own (sharded) gradients before the update
    and its optimizer states after it, labelled ``current_step()``. The engine is bound on first sight (the
    one whose ``module`` is the session's model, else the first that steps). Returns the undo callable."""
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError as exc:  # pragma: no cover
        raise DeepSpeedIntegrationError("the Trainer runs DeepSpeed but deepspeed cannot be imported") from exc
    original = DeepSpeedEngine.__dict__["_take_model_step"]
    bound: dict[str, Any] = {}

    def driver_for(engine: Any) -> Optional[MonitorDriver]:
        if session.monitor is None:
            return None
        if "engine" not in bound:
            model = getattr(session, "_model", None)
            if model is not None and engine.module is not model:
                return None
            reader = make_state_reader(engine)
            session.monitor.reader = reader
            session.monitor.dp_group = reader.group
            bound["engine"] = engine
            bound["driver"] = MonitorDriver(session, engine, reader)
            logger.info("msprobe: following the Trainer's DeepSpeed engine (ZeRO stage %d, reader %s)",
                        zero_stage(engine), type(reader).__name__)
        return bound["driver"] if bound["engine"] is engine else None

    def _take_model_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        driver = driver_for(self)
        if driver is None:
            return original(self, *args, **kwargs)
        _guarded(driver.before, "before the optimizer step")
        out = original(self, *args, **kwargs)
        _guarded(lambda: driver.after(int(current_step())), "after the optimizer step")
        return out

    _take_model_step.__wrapped__ = original  # type: ignore[attr-defined]
    DeepSpeedEngine._take_model_step = _take_model_step

    def undo() -> None:
        if DeepSpeedEngine.__dict__.get("_take_model_step") is _take_model_step:
            DeepSpeedEngine._take_model_step = original
        bound.clear()

    return undo


__all__ = ["patch_engine", "unpatch", "initialize", "get_patch", "follow_trainer_engine", "make_state_reader",
           "engine_hyperparameters", "Stage0Reader", "FragmentReader", "Stage3Reader", "MonitorDriver",
           "EnginePatch", "DeepSpeedIntegrationError"]
