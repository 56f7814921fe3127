"""What a ``DeepSpeedEngine`` is and where it keeps things: ZeRO stage, data-parallel group, the torch
optimizer under DeepSpeed's wrappers, the fp16 loss scale its gradients carry, the optimizer's state keys."""

from __future__ import annotations

from typing import Any

import torch

from msprobe_core.errors import MsprobeError
from msprobe_core.session import STATE_KINDS


class DeepSpeedIntegrationError(MsprobeError, RuntimeError):
    """The object given is not a usable DeepSpeed engine, or DeepSpeed is missing."""


def is_engine(obj: Any) -> bool:
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:  # pragma: no cover - deepspeed is an optional dependency
        return False
    return isinstance(obj, DeepSpeedEngine)


def loss_scale(engine: Any) -> float:
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


def skipped_steps(engine: Any) -> int:
    """How many updates the engine skipped: ``_take_model_step`` counts one in ``engine.skipped_steps`` when
    its fp16 optimizer reports ``overflow`` (the loss scaler found Inf/NaN gradients)."""
    return int(getattr(engine, "skipped_steps", 0) or 0)


def skipped_since(engine: Any, count_before: int) -> bool:
    """Whether the engine skipped an update since ``skipped_steps(engine)`` was ``count_before`` (read before
    ``_take_model_step``)."""
    return skipped_steps(engine) > count_before


def unscale(t: torch.Tensor, scale: float) -> torch.Tensor:
    """``t`` divided by the loss scale (as float32); ``t`` itself when the scale is 1 or ``t`` is empty."""
    return t if scale == 1.0 or t.numel() == 0 else t.float() / scale


def empty_shard(device: torch.device) -> torch.Tensor:
    """What a rank that holds no piece of a tensor reports (every rank reports every name)."""
    return torch.empty(0, dtype=torch.float32, device=device)


def torch_optimizer(optimizer: Any) -> Any:
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


def state_keys(zero_optimizer: Any) -> list[str]:
    """The monitored state keys the torch optimizer under ZeRO keeps (``exp_avg``, ``exp_avg_sq``, SGD's
    ``momentum_buffer``); the optimizer's type decides it, so every rank gets the same answer."""
    state = getattr(torch_optimizer(zero_optimizer), "state", None) or {}
    for s in state.values():
        return [k for k in STATE_KINDS if k in s and isinstance(s[k], torch.Tensor)]
    return []
