"""This rank's piece of a tensor that PyTorch's own sharding split over ranks (DTensor, FSDP1 flat params).

* DTensor (FSDP2's ``fully_shard`` parameters, gradients and Adam moments; ``parallelize_module``'s tensor
  parallel weights): the local tensor is this rank's piece. Over a mesh dimension placed ``Shard`` the
  pieces add up; over one placed ``Replicate`` every coordinate holds the same piece, so only coordinate 0
  counts it. A ``Partial`` placement (a pending sum) cannot be read from pieces: ``None``.
* FSDP1 (``FullyShardedDataParallel``): each unit's ``FlatParameter`` holds, on this rank, a contiguous
  range of the concatenated flattened original parameters; ``_shard_param_infos`` says which range of
  which original parameter. The gradient and the Adam moments of the flat parameter share its layout.

``LocalPiece`` carries what the combining step needs (``msprobe_core.monitor.shard_stats``): the piece, the
group over which pieces add up, and whether this rank's piece counts. Nothing here communicates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import torch
from torch import nn

from msprobe_core.pytorch.wrapper_names import fsdp1_class, unwrapped_name

try:
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class LocalPiece:
    """This rank's piece of a tensor: ``sharded`` False means the full tensor is here (nothing to combine);
    otherwise pieces add up over ``group`` and ``counts`` is False for a replica another rank counts."""
    tensor: torch.Tensor
    group: Any = None
    counts: bool = True
    sharded: bool = False


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_view(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (no copy, no autograd op); any other tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


_MESH_GROUPS: dict[int, Any] = {}


def mesh_group(mesh: Any) -> Any:
    """The process group of all ranks of a device mesh (cached per mesh)."""
    group = _MESH_GROUPS.get(id(mesh))
    if group is None:
        group = mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
        _MESH_GROUPS[id(mesh)] = group
    return group


def dtensor_piece(t: Any) -> LocalPiece | None:
    """This rank's piece of a DTensor, or None when a placement is ``Partial`` (a pending reduction)."""
    placements = t.placements
    if any(p.is_partial() for p in placements):
        return None
    local = t._local_tensor.detach()
    if not any(p.is_shard() for p in placements):
        return LocalPiece(local)  # replicated everywhere: the full tensor is here
    mesh = t.device_mesh
    coord = mesh.get_coordinate() or ()
    counts = all(c == 0 for c, p in zip(coord, placements) if p.is_replicate())
    return LocalPiece(local, mesh_group(mesh), counts, True)


def dtensor_start(t: Any) -> int | None:
    """Where a DTensor's local piece starts among the full tensor's elements in row-major order, where the piece
    is one contiguous range of them (every ``Shard`` placement on dim 0: FSDP2's ``fully_shard``); None
    otherwise (a piece of another dim is strided)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(p.is_shard() and (type(p) is not Shard or p.dim != 0) for p in t.placements):
        return None
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return int(offset[0]) * math.prod(t.shape[1:]) if len(offset) else 0


def piece_of(t: torch.Tensor) -> LocalPiece | None:
    """``dtensor_piece`` for a DTensor, the full tensor for any other tensor."""
    return dtensor_piece(t) if is_dtensor(t) else LocalPiece(t.detach())


class FlatSlot(NamedTuple):
    """One original parameter inside an FSDP1 ``FlatParameter``."""
    flat: nn.Parameter
    index: int
    group: Any
    orig: nn.Parameter | None  # use_orig_params=True: the original parameter (optimizer state is keyed by it)

    @property
    def numel(self) -> int:
        return int(self.flat._numels[self.index])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.flat._shapes[self.index])

    @property
    def start(self) -> int:
        """Where this rank's range starts among the original parameter's elements (0 where it holds none)."""
        info = self.flat._shard_param_infos[self.index]
        return int(info.intra_param_start_idx) if info.in_shard else 0

    def cut(self, flat_tensor: torch.Tensor) -> LocalPiece:
        """This rank's range of the parameter from a tensor laid out like the local flat shard."""
        info = self.flat._shard_param_infos[self.index]
        if info.in_shard:
            piece = flat_tensor.detach().reshape(-1).narrow(0, info.offset_in_shard, info.numel_in_shard)
        else:
            piece = flat_tensor.detach().new_zeros(0)
        return LocalPiece(piece, self.group, True, True)

    def own(self, t: torch.Tensor) -> LocalPiece:
        """A tensor already cut to this rank's range (use_orig_params: the original parameter's state)."""
        return LocalPiece(t.detach().reshape(-1), self.group, True, True)


def fsdp1_slots(chunk: nn.Module, prefix: str = "") -> Iterator[tuple[str, FlatSlot]]:
    """Every original parameter of the FSDP1 units of ``chunk``: (unwrapped name, slot)."""
    fsdp1 = fsdp1_class()
    if fsdp1 is None:  # FSDP1 not loaded: no unit can exist
        return
    for name, module in chunk.named_modules():
        if not isinstance(module, fsdp1):
            continue
        handle = getattr(module, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if flat is None or not hasattr(flat, "_shard_param_infos"):
            continue
        origs = list(getattr(flat, "_params", None) or []) if getattr(handle, "_use_orig_params", False) else []
        base = unwrapped_name(name)
        for i, fqn in enumerate(flat._fqns):
            full = unwrapped_name(f"{base}.{fqn}" if base else fqn)
            yield prefix + full, FlatSlot(flat, i, module.process_group, origs[i] if i < len(origs) else None)
