"""Hyperparameter capture shared by every integration: one normalised schema with an alias map.

Each integration hands over what its framework has (HF ``TrainingArguments.to_dict()`` and the model
config, a DeepSpeed ds_config, Megatron's args namespace, the optimizer and scheduler objects); this
module flattens it, normalises the names (``lr`` / ``learning_rate``, ``micro_batch_size`` /
``per_device_train_batch_size`` / ``train_micro_batch_size_per_gpu``, ...) and writes
``hyperparameters.json`` atomically. The raw sections are kept under their framework's own names, so
nothing is lost in the normalisation.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

SCHEMA = "msprobe_core.hyperparameters/1"
FILE_NAME = "hyperparameters.json"

# canonical name -> names the frameworks use (looked up in order, in every section given)
ALIASES: dict[str, tuple[str, ...]] = {
    "learning_rate": ("learning_rate", "lr"),
    "min_learning_rate": ("min_lr", "min_learning_rate"),
    "micro_batch_size": ("micro_batch_size", "per_device_train_batch_size", "train_micro_batch_size_per_gpu"),
    "global_batch_size": ("global_batch_size", "train_batch_size"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", "gradient_accumulation"),
    "max_steps": ("max_steps", "train_iters"),
    "num_train_epochs": ("num_train_epochs", "epochs"),
    "warmup_steps": ("warmup_steps", "lr_warmup_iters"),
    "warmup_ratio": ("warmup_ratio", "lr_warmup_fraction"),
    "lr_scheduler": ("lr_scheduler_type", "lr_decay_style", "lr_scheduler"),
    "weight_decay": ("weight_decay",),
    "adam_beta1": ("adam_beta1",),
    "adam_beta2": ("adam_beta2",),
    "adam_epsilon": ("adam_epsilon", "adam_eps"),
    "max_grad_norm": ("max_grad_norm", "clip_grad", "gradient_clipping"),
    "optimizer": ("optim", "optimizer"),
    "seed": ("seed",),
    "world_size": ("world_size",),
    "zero_stage": ("zero_stage",),
    "tensor_model_parallel_size": ("tensor_model_parallel_size",),
    "pipeline_model_parallel_size": ("pipeline_model_parallel_size",),
    "virtual_pipeline_model_parallel_size": ("virtual_pipeline_model_parallel_size",),
    "data_parallel_size": ("data_parallel_size",),
    "num_layers": ("num_layers", "num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "ffn_hidden_size": ("ffn_hidden_size", "intermediate_size", "n_inner"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_key_value_heads": ("num_key_value_heads", "num_query_groups"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "seq_length": ("seq_length", "max_seq_length", "max_position_embeddings", "n_positions"),
    "bf16": ("bf16",),
    "fp16": ("fp16",),
    "model_type": ("model_type",),
}


def to_plain(value: Any, depth: int = 0) -> Any:
    """A JSON-able copy: containers recurse, enums/dtypes/paths/objects become strings."""
    if depth > 8:
        return repr(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if isinstance(value, Mapping):
        return {str(k): to_plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_plain(v, depth + 1) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        try:
            return to_plain(asdict(value), depth + 1)
        except TypeError:
            pass
    if hasattr(value, "value") and type(value).__module__ == "enum":  # Enum members
        return to_plain(value.value, depth + 1)
    return str(value)


def normalize(sections: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Canonical values and where each came from (``"section.name"``). Earlier sections win."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for canonical, names in ALIASES.items():
        for section, content in sections.items():
            if not isinstance(content, Mapping):
                continue
            hit = next((n for n in names if n in content and content[n] is not None), None)
            if hit is not None:
                values[canonical] = to_plain(content[hit])
                origin[canonical] = f"{section}.{hit}"
                break
    _heads_without_grouped_query(sections, values, origin)
    return values, origin


def _heads_without_grouped_query(sections: Mapping[str, Any], values: dict[str, Any], origin: dict[str, str]) -> None:
    """Megatron's ``num_query_groups`` (default 1) means something only with ``group_query_attention``; without it
    every attention head has its own key/value head, so ``num_key_value_heads`` is ``num_attention_heads``."""
    section, _, name = origin.get("num_key_value_heads", "").partition(".")
    content = sections.get(section)
    if name != "num_query_groups" or not isinstance(content, Mapping) or content.get("group_query_attention", True):
        return
    if "num_attention_heads" in values:
        values["num_key_value_heads"] = values["num_attention_heads"]
        origin["num_key_value_heads"] = origin["num_attention_heads"]
    else:
        del values["num_key_value_heads"], origin["num_key_value_heads"]


def optimizer_section(optimizer: Any) -> Optional[dict[str, Any]]:
    """Class and per-group settings of a torch optimizer (or a wrapper exposing ``param_groups``)."""
    if optimizer is None:
        return None
    try:  # Megatron's ChainedOptimizer.optimizer asserts when it chains several optimizers
        inner = getattr(optimizer, "optimizer", None)
    except AssertionError:
        inner = None
    groups = getattr(optimizer, "param_groups", None) or getattr(inner, "param_groups", None) or []
    out_groups = []
    for g in groups:
        params = g.get("params", [])
        settings = {k: to_plain(v) for k, v in g.items() if k != "params"}
        settings["num_params"] = len(params)
        settings["numel"] = int(sum(getattr(p, "numel", lambda: 0)() for p in params))
        out_groups.append(settings)
    section = {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "param_groups": out_groups}
    if inner is not None and inner is not optimizer:
        section["inner_class"] = f"{type(inner).__module__}.{type(inner).__qualname__}"
    return section


def scheduler_section(scheduler: Any) -> Optional[dict[str, Any]]:
    if scheduler is None:
        return None
    state = {}
    try:
        state = {k: to_plain(v) for k, v in scheduler.state_dict().items() if not callable(v)}
    except Exception:  # a scheduler without a plain state_dict
        pass
    return {"class": f"{type(scheduler).__module__}.{type(scheduler).__qualname__}", "state": state}


def library_versions(names: Iterable[str] = ("torch", "transformers", "accelerate", "deepspeed", "megatron.core",
                                              "peft", "trl", "numpy", "tensorboardX")) -> dict[str, str]:
    """Versions of the libraries that are already imported (nothing is imported to find out)."""
    import sys

    from msprobe_core import __version__

    versions = {"python": platform.python_version(), "msprobe_core": __version__}
    for name in names:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module else None
        if version is not None:
            versions[name] = str(version)
    return versions


def mixed_precision(bf16: Any, fp16: Any) -> str:
    """The ``mixed_precision`` value every integration reports: ``bf16``, ``fp16`` or ``fp32``."""
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def capture(source: str, sections: Mapping[str, Any], optimizer: Any = None, scheduler: Any = None,
            extra_normalized: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The hyperparameters document: ``normalized`` values with their ``origin``, the raw sections,
    optimizer and scheduler settings and library versions. ``source`` names the integration."""
    raw = {name: to_plain(value) for name, value in sections.items() if value is not None}
    opt = optimizer_section(optimizer)
    lookup = dict(raw)
    if opt and opt["param_groups"]:
        group = dict(opt["param_groups"][0])
        betas = group.get("betas")
        if isinstance(betas, list) and len(betas) == 2:
            group.setdefault("adam_beta1", betas[0])
            group.setdefault("adam_beta2", betas[1])
        if "eps" in group:
            group.setdefault("adam_epsilon", group["eps"])
        group.setdefault("optimizer", opt["class"].rsplit(".", 1)[-1])
        lookup["optimizer"] = group
    values, origin = normalize(lookup)
    for key, value in (extra_normalized or {}).items():
        if value is not None:
            values[key] = to_plain(value)
            origin[key] = source
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "source": source,
        "captured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "normalized": values,
        "origin": origin,
        **raw,
    }
    if opt:
        doc["optimizer"] = opt
    sched = scheduler_section(scheduler)
    if sched:
        doc["scheduler"] = sched
    doc["versions"] = library_versions()
    return doc


def write(folder: str | os.PathLike, doc: Mapping[str, Any]) -> Path:
    """Write ``hyperparameters.json`` at the top of ``folder`` (atomic: temporary file and rename)."""
    from msprobe_core.files.atomic_write import write_text_atomic

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    target = path / FILE_NAME
    write_text_atomic(target, json.dumps(doc, indent=2, ensure_ascii=False, default=str) + "\n")
    return target


def flat_for_tensorboard(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The normalised values as TensorBoard hparams accept them (bool, int, float or str)."""
    out: dict[str, Any] = {}
    for key, value in doc.get("normalized", {}).items():
        out[key] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
    return out
