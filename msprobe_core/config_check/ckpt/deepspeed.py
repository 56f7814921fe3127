"""DeepSpeed checkpoints: ``DIR/latest`` naming a tag folder, or the tag folder itself.

ZeRO stages 0-2 keep the whole module in ``mp_rank_XX_model_states.pt`` (``module``: the weights in the
training dtype; several XX, Megatron-DeepSpeed's tensor parallelism, are merged like Megatron's). Under
ZeRO-3 the module is partitioned: the fp32 weights are gathered from the ``zero_pp_rank_*`` optimizer
files with DeepSpeed's own ``zero_to_fp32`` in lazy mode (one parameter gathered at a time).
"""

from __future__ import annotations

import re
from pathlib import Path

from msprobe_core.config_check.ckpt import torch_file
from msprobe_core.config_check.ckpt.megatron import merge_shards
from msprobe_core.config_check.ckpt.source import Checkpoint, Entry, state_dict_entries
from msprobe_core.config_check.exceptions import CheckpointError

LATEST = "latest"
_MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_STATES = re.compile(r"^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$")


def tag_folder(path: Path) -> Path:
    """The checkpoint folder ``latest`` names, or ``path`` itself."""
    latest = path / LATEST
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8").strip()
        folder = path / tag
        if not folder.is_dir():
            raise CheckpointError(f"{latest} names tag '{tag}' but {folder} does not exist")
        return folder
    return path


def is_deepspeed(folder: Path) -> bool:
    return any(_MODEL_STATES.match(p.name) or _ZERO3_STATES.match(p.name) for p in folder.iterdir())


def open_deepspeed(path: Path) -> Checkpoint:
    folder = tag_folder(path)
    files = sorted((p for p in folder.iterdir() if _MODEL_STATES.match(p.name)),
                   key=lambda p: int(_MODEL_STATES.match(p.name).group(1)))
    ckpt = Checkpoint(str(folder), "deepspeed")
    if not files:
        if any(_ZERO3_STATES.match(p.name) for p in folder.iterdir()):
            return _zero3(folder, ckpt)
        raise CheckpointError(f"{folder} holds no DeepSpeed mp_rank_XX_model_states.pt")
    modules = []
    for f in files:
        state = torch_file.load(str(f))
        if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
            raise CheckpointError(f"{f} holds no 'module' state dict")
        modules.append(state_dict_entries(state["module"]))
    if len(modules) == 1:
        ckpt.entries = modules[0]
        return ckpt
    for name in modules[0]:
        parts = {(0, tp): m[name].load() for tp, m in enumerate(modules) if name in m}
        ckpt.entries[name] = merge_shards(name, parts, glu=False, replicate_experts=False)
    return ckpt


def _zero3(folder: Path, ckpt: Checkpoint) -> Checkpoint:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name, lazy_mode=True)
    for name, value in lazy.items():
        load = value.contiguous if hasattr(value, "contiguous") else (lambda v=value: v)
        ckpt.entries[name] = Entry(tuple(value.shape), str(value.dtype).replace("torch.", ""), load)
    ckpt.notes.append("ZeRO-3: fp32 master weights gathered from the optimizer partitions")
    return ckpt
