"""Which kind of checkpoint a path is, and opening it.

In order: a Megatron checkpoint folder with ``latest_checkpointed_iteration.txt`` (the latest iteration
is taken; ``release`` too); a DeepSpeed folder with ``latest``; a megatron-core distributed checkpoint
(``metadata.json``); an iteration folder with ``mp_rank_*`` folders; a DeepSpeed tag folder
(``mp_rank_XX_model_states.pt``); a Hugging Face folder (safetensors or ``pytorch_model*.bin``, sharded
with an index or not); a single ``.safetensors``, ``.index.json``, ``.bin``/``.pt``/``.pth`` file.
A single rank's folder (``mp_rank_00``) is refused: a model is compared whole.
"""

from __future__ import annotations

import json
from pathlib import Path

from msprobe_core.config_check.ckpt import deepspeed, dist, hf, megatron
from msprobe_core.config_check.ckpt.source import Checkpoint
from msprobe_core.config_check.exceptions import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"


def latest_iteration(folder: Path) -> Path:
    """The iteration folder ``latest_checkpointed_iteration.txt`` names."""
    text = (folder / TRACKER).read_text(encoding="utf-8").strip()
    if text == "release":
        name = "release"
    else:
        try:
            name = f"iter_{int(text):07d}"
        except ValueError:
            raise CheckpointError(f"{folder / TRACKER} holds '{text}', not an iteration number or 'release'") from None
    chosen = folder / name
    if not chosen.is_dir():
        raise CheckpointError(f"{folder / TRACKER} names iteration {text} but {chosen} does not exist")
    return chosen


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open ``path`` as whatever checkpoint it is (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path '{p}' does not exist")
    if p.is_file():
        return _open_file(p)
    if (p / TRACKER).is_file():
        p = latest_iteration(p)
    elif (p / deepspeed.LATEST).is_file():
        return deepspeed.open_deepspeed(p)
    if dist.is_dist_checkpoint(p):
        return dist.open_dist(p)
    if megatron.rank_files(p):
        return megatron.open_megatron(p)
    if megatron.RANK_DIR.match(p.name):
        raise CheckpointError(f"'{p}' is one rank's shard of a model; give its iteration folder ({p.parent}) "
                              "so all ranks are merged")
    if deepspeed.is_deepspeed(p):
        return deepspeed.open_deepspeed(p)
    files = hf.hf_files(p)
    if files:
        return hf.open_files(files, p)
    iterations = sorted(x.name for x in p.glob("iter_*") if x.is_dir())
    if iterations:
        raise CheckpointError(f"'{p}' holds iteration folders ({', '.join(iterations[-3:])}) but no {TRACKER}; "
                              "give one iteration folder")
    found = ", ".join(sorted(x.name for x in p.iterdir())[:12]) or "nothing"
    raise CheckpointError(f"'{p}' is not a checkpoint this tool reads (found: {found}); expected a Megatron folder "
                          f"({TRACKER}, iter_XXXXXXX/mp_rank_*), a torch_dist folder (metadata.json), a Hugging "
                          "Face folder (*.safetensors, pytorch_model*.bin), or a DeepSpeed folder (latest, "
                          "mp_rank_XX_model_states.pt)")


def _open_file(p: Path) -> Checkpoint:
    name = p.name
    if name.endswith(".index.json"):
        try:
            weight_map = json.loads(p.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(f"{p}: not a usable index ({e})") from None
        return hf.open_files([p.parent / f for f in dict.fromkeys(weight_map.values())], p.parent)
    if p.suffix in (".safetensors", ".bin", ".pt", ".pth"):
        if megatron.RANK_DIR.match(p.parent.name):
            raise CheckpointError(f"'{p}' is one rank's shard of a model; give its iteration folder "
                                  f"({p.parent.parent}) so all ranks are merged")
        return hf.open_files([p], p, kind="file")
    raise CheckpointError(f"'{p}': unknown checkpoint file type (expected .safetensors, .index.json, .bin, .pt, .pth)")
