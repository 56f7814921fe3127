"""Ranks and process groups as ``torch.distributed`` reports them, with the answers of a single process
when it is not initialised (rank 0, a group of one). The one rank helper of the toolkit."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist


def dist_ready() -> bool:
    """Whether ``torch.distributed`` is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def current_rank() -> Optional[int]:
    """This process's global rank, or None when ``torch.distributed`` is not initialised."""
    return dist.get_rank() if dist_ready() else None


def global_rank() -> int:
    """This process's global rank; without ``torch.distributed``, ``$RANK`` (set by launchers) or 0."""
    rank = current_rank()
    return rank if rank is not None else int(os.environ.get("RANK", "0"))


def rank_in(group: Any) -> int:
    """This process's rank inside ``group`` (None: the world); 0 without ``torch.distributed``."""
    return max(dist.get_rank(group=group), 0) if dist_ready() else 0


def group_size(group: Any) -> int:
    """The number of ranks of ``group`` (None: the world); 1 without ``torch.distributed``."""
    return dist.get_world_size(group) if dist_ready() else 1


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the world); ``[0]`` without ``torch.distributed``."""
    if not dist_ready():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def collective_device(group: Any = None) -> torch.device:
    """The device ``group``'s collectives take tensors on: the current GPU under NCCL, else the CPU."""
    backend = str(dist.get_backend(group)) if dist_ready() else ""
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is True on any rank of ``group``: one 1-element all-reduce, which every rank of the
    group must call (``flag`` itself without ``torch.distributed`` or in a group of one)."""
    if group_size(group) <= 1:
        return bool(flag)
    value = torch.tensor([1.0 if flag else 0.0], device=collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item() > 0)
