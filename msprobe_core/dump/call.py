"""``Call``: one recorded forward call between its start and its end, as the dump's records and its
framework back-ends pass it around."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(slots=True, eq=False)
class Call:
    """A recorded forward call between its start and its end.

    The L0 C hooks (``stats/_fast_l0.c``, ``l0_call_layout``) fill these slots themselves, in this order, while the
    class is a plain slots dataclass without ``__post_init__``; anything else makes them call the class."""

    name: str
    backward: str
    seq: int
    record: dict
    save: bool
    parent: Optional[str]
    grad: bool = False  # autograd records this call and its backward is dumped
    edges: Any = None   # framework data for its backward ``output`` (PyTorch: its inputs' gradient edges)
    stack: Any = None   # its call stack, while its record is JSON text (``CallRecords``: journaled with it at its end)
    by_node: bool = False  # a module call: its one output's gradient may come from its own node (``_grad_by_node``)

    def backward_parent(self) -> Optional[str]:
        """The parent of its backward record in construct.json."""
        return self.parent.replace(".forward", ".backward") if self.parent else None
