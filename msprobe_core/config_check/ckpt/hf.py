"""Hugging Face checkpoints: ``model.safetensors``, sharded safetensors with ``model.safetensors.index.json``,
``pytorch_model.bin`` (sharded with ``pytorch_model.bin.index.json``), or one such file given directly.

safetensors files are read tensor by tensor (``safe_open``: shapes from the header, nothing else read
until a tensor is asked for); ``.bin`` files are memory-mapped (``torch_file``). ``config.json`` next to
the weights gives the attention layout the Megatron mapping needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from msprobe_core.config_check.ckpt import torch_file
from msprobe_core.config_check.ckpt.source import Checkpoint, Entry, state_dict_entries
from msprobe_core.config_check.exceptions import CheckpointError

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2"}


def hf_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face model folder, in the index's order (empty: not one)."""
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, OSError) as e:
                raise CheckpointError(f"{index}: not a usable index ({e})") from None
            return [folder / f for f in dict.fromkeys(weight_map.values())]
    singles = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    return singles


def _safetensors_entries(path: Path) -> dict[str, Entry]:
    from safetensors import safe_open

    def loader(name: str):
        def load():
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)
        return load

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            piece = f.get_slice(name)
            out[name] = Entry(tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype(), piece.get_dtype().lower()),
                              loader(name))
    return out


def _bin_entries(path: Path) -> dict[str, Entry]:
    state = torch_file.load(str(path))
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a state dict")
    for key in ("state_dict", "model", "module"):
        if isinstance(state.get(key), dict) and len(state) <= 8:
            state = state[key]
            break
    return state_dict_entries(state)


def open_files(files: list[Path], where: Path, kind: str = "huggingface") -> Checkpoint:
    """A checkpoint made of these weight files (safetensors or torch)."""
    ckpt = Checkpoint(str(where), kind)
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"weight file {f} (named by the index) does not exist")
        entries = _safetensors_entries(f) if f.suffix == ".safetensors" else _bin_entries(f)
        ckpt.entries.update(entries)
    config = (where if where.is_dir() else where.parent) / "config.json"
    if config.is_file():
        ckpt.config = hf_config(config)
    return ckpt


def hf_config(path: Path) -> dict[str, Any]:
    """The attention/MLP layout from a Hugging Face ``config.json`` (names as ``megatron.model_config``)."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return {}
    heads = cfg.get("num_attention_heads")
    out = {"num_attention_heads": heads, "num_query_groups": cfg.get("num_key_value_heads", heads),
           "hidden_size": cfg.get("hidden_size"), "kv_channels": cfg.get("head_dim")}
    return {k: v for k, v in out.items() if v is not None}
