"""megatron-core's distributed checkpoint (``metadata.json`` with ``"sharded_backend": "torch_dist"``).

The tensors are stored globally (full shapes, tensor parallelism already undone), read with
``torch.distributed.checkpoint`` without a process group. megatron-core stacks each layer's tensor
along a leading axis (``decoder.layers.mlp.linear_fc1.weight`` is ``[num_layers, ...]``; local experts
add one more); those are listed per layer (``decoder.layers.3.mlp.linear_fc1.weight``) and each is read
alone through a load plan that asks only for its slice, so memory stays at one layer's tensor.
Optimizer states, RNG states and ``_extra_state`` are skipped; names are canonical as in ``megatron``.
"""

from __future__ import annotations

import itertools
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from msprobe_core.config_check.ckpt import torch_file
from msprobe_core.config_check.ckpt.megatron import canonical, model_config
from msprobe_core.config_check.ckpt.source import EXTRA_STATE, Checkpoint, Entry
from msprobe_core.config_check.exceptions import CheckpointError

METADATA = "metadata.json"
_STACKED = re.compile(r"(?:^|\.)(layers|local_experts)(?=\.(?!\d))")
_SKIP = ("optimizer.", "rng_state", "rerun_state")


def is_dist_checkpoint(path: Path) -> bool:
    meta = path / METADATA
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text(encoding="utf-8")).get("sharded_backend") is not None
    except (ValueError, OSError):
        return False


def _planner(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        """Reads only the ``offsets``/``sizes`` box of one stored tensor into a tensor of that size."""

        def create_local_plan(self) -> LoadPlan:
            md = self.metadata.state_dict_metadata[key]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            return LoadPlan(create_read_items_for_chunk_list(key, md, [chunk]))

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.state_dict[index.fqn]

    return SlicePlanner()


def _read_slice(path: Path, key: str, dtype: torch.dtype, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    out = torch.empty(sizes, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        dcp.load({key: out}, storage_reader=dcp.FileSystemReader(str(path)), planner=_planner(key, offsets, sizes),
                 no_dist=True)
    return out


def open_dist(path: Path) -> Checkpoint:
    """The model tensors of a torch_dist checkpoint folder, per layer (see the module docstring)."""
    from torch.distributed.checkpoint import FileSystemReader

    backend = json.loads((path / METADATA).read_text(encoding="utf-8")).get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointError(f"{path}: distributed checkpoint backend '{backend}' is not supported (torch_dist is)")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated or foreign .metadata
        raise CheckpointError(f"{path}: cannot read the distributed checkpoint's .metadata: {e}") from None
    ckpt = Checkpoint(str(path), "megatron torch_dist")
    for key, md in metadata.state_dict_metadata.items():
        if not hasattr(md, "chunks") or key.startswith(_SKIP) or EXTRA_STATE in key:
            continue
        size = tuple(md.size)
        dtype = md.properties.dtype
        ends = [m.end(1) for m in _STACKED.finditer(key)]  # where a stacked axis' index belongs
        axes = len(ends)
        if axes == 0 or axes > len(size):
            ckpt.entries[canonical(key)] = Entry(size, str(dtype).replace("torch.", ""),
                                                 lambda k=key, s=size, d=dtype: _read_slice(path, k, d, (0,) * len(s), s))
            continue
        rest = size[axes:]
        for index in itertools.product(*(range(n) for n in size[:axes])):
            name = key
            for axis, i in reversed(list(enumerate(index))):  # insert from the right: positions stay valid
                name = f"{name[:ends[axis]]}.{i}{name[ends[axis]:]}"
            offsets = tuple(index) + (0,) * len(rest)
            sizes = (1,) * axes + rest
            ckpt.entries[canonical(name)] = Entry(
                rest, str(dtype).replace("torch.", ""),
                lambda k=key, d=dtype, o=offsets, s=sizes, a=axes: _read_slice(path, k, d, o, s).reshape(s[a:]))
    ckpt.entries = _layer_major(ckpt.entries)
    common = path / "common.pt"
    if common.is_file():
        state = torch_file.load(str(common))
        ckpt.config = model_config(state.get("args") if isinstance(state, dict) else None)
    return ckpt


def _layer_major(entries: dict[str, Entry]) -> dict[str, Entry]:
    """Per-layer entries in layer order (they come key by key from the stacked storage); the entries
    before the first layer (embeddings) and after (final norm, output layer) stay where they are."""
    layer = [next((int(x) for x in re.findall(r"\.layers\.(\d+)\.", n)), None) for n in entries]
    first = next((i for i, n in enumerate(layer) if n is not None), len(layer))

    def key(item: tuple[int, str]) -> tuple[int, int, int]:
        i, _ = item
        if layer[i] is not None:
            return 1, layer[i], i
        return (0 if i < first else 2), 0, i

    return {name: entries[name] for _, name in sorted(enumerate(entries), key=key)}
