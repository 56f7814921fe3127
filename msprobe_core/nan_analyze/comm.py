"""What each ``torch.distributed`` call sends and receives, and which records on different ranks are one call.

A dump names communication calls ``Distributed.{api}.{n}.forward``. For each API the table below says
which arguments hold what a rank contributes (``send``) and which the call writes (``recv``), and which
argument names the root rank (``src`` of broadcast/scatter, ``dst`` of reduce/gather/send, ``src`` of
recv). Collectives pair across ranks by API, process group and call count on that group (the n-th
``all_reduce`` on group [0, 2] of every member is one call); point-to-point calls pair the k-th send from
rank a to rank b with the k-th receive on b from a.

The dump describes a collective's process group as msprobe does, by its ranks in the call's arguments
(``{"type": "torch.ProcessGroup", "group_ranks": [0, 2], "group_id": "..."}``); a call without a group
argument (or ``group=None``) ran on the default group, the world. Dumps that recorded a group object
without its ranks (older ones) leave only the API's call count to pair by (``group_ranks``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from msprobe_core.dumpdir.record_leaves import Leaf

COMM_PREFIX = "Distributed."
RANK_NUMBER = re.compile(r"^rank(\d+)$")

Slot = tuple[int, str]  # (position in input_args, keyword name)


@dataclass(frozen=True)
class CommSpec:
    """How one communication API moves data.

    ``root_role``: ``src`` when only the root sends (broadcast, scatter), ``dst`` when only the root
    receives (reduce, gather), "" when every rank sends and receives. ``p2p``: ``send``/``recv``/"".
    """

    send: tuple[Slot, ...] = ()
    recv: tuple[Slot, ...] = ()
    root: Optional[Slot] = None
    root_role: str = ""
    p2p: str = ""


_T0 = ((0, "tensor"),)
COMM_SPECS: dict[str, CommSpec] = {
    "all_reduce": CommSpec(_T0, _T0),
    "broadcast": CommSpec(_T0, _T0, (1, "src"), "src"),
    "reduce": CommSpec(_T0, _T0, (1, "dst"), "dst"),
    "all_gather": CommSpec(((1, "tensor"),), ((0, "tensor_list"),)),
    "all_gather_into_tensor": CommSpec(((1, "input_tensor"),), ((0, "output_tensor"),)),
    "_all_gather_base": CommSpec(((1, "input_tensor"),), ((0, "output_tensor"),)),
    "reduce_scatter": CommSpec(((1, "input_list"),), ((0, "output"),)),
    "reduce_scatter_tensor": CommSpec(((1, "input"),), ((0, "output"),)),
    "_reduce_scatter_base": CommSpec(((1, "input"),), ((0, "output"),)),
    "all_to_all": CommSpec(((1, "input_tensor_list"),), ((0, "output_tensor_list"),)),
    "all_to_all_single": CommSpec(((1, "input"),), ((0, "output"),)),
    "gather": CommSpec(_T0, ((1, "gather_list"),), (2, "dst"), "dst"),
    "scatter": CommSpec(((1, "scatter_list"),), _T0, (3, "src"), "src"),
    "send": CommSpec(_T0, (), (1, "dst"), p2p="send"),
    "isend": CommSpec(_T0, (), (1, "dst"), p2p="send"),
    "recv": CommSpec((), _T0, (1, "src"), p2p="recv"),
    "irecv": CommSpec((), _T0, (1, "src"), p2p="recv"),
    # synchronise without moving tensors the dump can see
    "barrier": CommSpec(),
    "all_gather_object": CommSpec(),
    "broadcast_object_list": CommSpec(),
    "batch_isend_irecv": CommSpec(),
}


def comm_api(name: str) -> Optional[str]:
    """``all_reduce`` for ``Distributed.all_reduce.0.forward``; None for other records and backward ones."""
    if not name.startswith(COMM_PREFIX) or not name.endswith(".forward"):
        return None
    api = name.split(".")[1]
    return api if api in COMM_SPECS else None


def call_count(name: str) -> str:
    """The call count of ``Distributed.{api}.{n}.forward``."""
    return name.split(".")[2]


UNKNOWN_GROUP: tuple[int, ...] = ()
"""``group_ranks`` of a call whose process group the dump recorded without its ranks."""


def group_ranks(record: Any) -> Optional[tuple[int, ...]]:
    """The ranks of the process group a collective ran on, as its record's arguments give them; None for
    the default group (no group argument, or null); ``UNKNOWN_GROUP`` for a group recorded without ranks."""
    if not isinstance(record, dict):
        return None
    args = record.get("input_args")
    kwargs = record.get("input_kwargs")
    values = list(args) if isinstance(args, list) else []
    values += list(kwargs.values()) if isinstance(kwargs, dict) else []
    for value in values:
        if isinstance(value, dict) and "ProcessGroup" in str(value.get("type", "")):
            ranks = value.get("group_ranks")
            if isinstance(ranks, list) and ranks and all(type(r) is int for r in ranks):
                return tuple(ranks)
            return UNKNOWN_GROUP
    return None


def rank_number(label: str) -> Optional[int]:
    """3 for ``rank3``; None for ``proc1234`` or a bare folder."""
    m = RANK_NUMBER.match(label)
    return int(m.group(1)) if m else None


def _slot_prefixes(slot: Slot) -> tuple[str, str]:
    return f"input.{slot[0]}", f"input.{slot[1]}"


def _in_slots(path: str, slots: Iterable[Slot]) -> bool:
    for slot in slots:
        for prefix in _slot_prefixes(slot):
            if path == prefix or path.startswith(prefix + "."):
                return True
    return False


def slot_leaves(leaves: Iterable[Leaf], slots: tuple[Slot, ...]) -> list[Leaf]:
    """The tensor leaves of a record that sit in the given argument slots."""
    return [leaf for leaf in leaves if leaf.is_tensor and _in_slots(leaf.path, slots)]


def root_rank(record: Any, spec: CommSpec) -> Optional[int]:
    """The root rank argument (src/dst) of a call, when it was recorded as an int."""
    if spec.root is None or not isinstance(record, dict):
        return None
    pos, key = spec.root
    args = record.get("input_args") or []
    value = args[pos] if isinstance(args, list) and pos < len(args) else (record.get("input_kwargs") or {}).get(key)
    if isinstance(value, dict) and isinstance(value.get("value"), int) and not isinstance(value.get("value"), bool):
        return value["value"]
    return None


def receives(spec: CommSpec, rank: int, root: Optional[int]) -> bool:
    """Whether the call writes into ``rank``'s tensors."""
    if spec.p2p:
        return spec.p2p == "recv"
    if spec.root_role == "dst" and root is not None:
        return rank == root
    if spec.root_role == "src" and root is not None:
        return rank != root
    return True


def sends(spec: CommSpec, rank: int, root: Optional[int]) -> bool:
    """Whether ``rank`` contributes data to the call."""
    if spec.p2p:
        return spec.p2p == "send"
    if spec.root_role == "src" and root is not None:
        return rank == root
    return True
