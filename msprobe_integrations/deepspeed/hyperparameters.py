"""The hyperparameters document of a ``DeepSpeedEngine`` (``hyperparameters.json``)."""

from __future__ import annotations

from typing import Any, Mapping


from msprobe_core import hparams
from msprobe_core.session import group_size
from msprobe_integrations.deepspeed.engine import torch_optimizer, zero_stage


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
    precision = hparams.mixed_precision(engine.bfloat16_enabled(), engine.fp16_enabled())
    torch_opt = torch_optimizer(engine.optimizer)
    scheduler = engine.lr_scheduler
    clip = engine.gradient_clipping()
    extra = {
        "zero_stage": zero_stage(engine),
        "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "global_batch_size": engine.train_batch_size(),
        "data_parallel_size": getattr(engine, "dp_world_size", None),
        "world_size": group_size(None),
        "mixed_precision": precision,
        "optimizer": engine.optimizer_name() or (type(torch_opt).__name__ if torch_opt is not None else None),
        "lr_scheduler": engine.scheduler_name() or (type(scheduler).__name__ if scheduler is not None else None),
        "max_grad_norm": clip if clip else None,
        "zero_optimizer": type(engine.optimizer).__name__ if engine.optimizer is not None else None,
    }
    return hparams.capture(source, sections, torch_opt, scheduler, extra)
