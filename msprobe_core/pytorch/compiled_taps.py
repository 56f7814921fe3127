"""Statistics computed inside a ``torch.compile`` graph: no graph break, the compiled step unchanged.

A hook that ``torch.compile`` must not trace (the tool's eager hooks) breaks the graph where it is called, and
under Inductor every break changes the kernels on both sides of it (Inductor fuses each graph on its own), so
the losses move in their last bits. Hooks on a model compiled as a whole therefore do their tensor work as
part of the graph and leave everything else to the host, once per step:

* forward: a module hook that Dynamo traces computes the statistics of the tensors it sees as a small tensor
  (``graph_stats``) and appends it, with constants (names, shapes), to a plain list: Dynamo replays the
  append after the graph ran, the statistics are extra outputs of the graph;
* backward: a gradient hook registered inside the traced code (``GradSlots.hook``) computes the statistics of
  the gradient and copies them into a small persistent tensor (its *slot*); Dynamo traces it into the
  backward graph as a mutation of a graph input (a hook with a Python side effect would be refused there).
  The hook returns None, so the gradient flows on untouched, and it sees what a tensor hook sees in eager
  mode (the tensor's whole gradient). The host takes the slots between graphs (``GradSlots.take``).

The hooks read no state of the tool while Dynamo traces them (they run in every training forward; the host
decides at the step's end whether the step is recorded) and hold no tensor of the graph in a Python object
(which would make it an output of the graph and change the kernels), so the tool adds no guard, no
recompilation and no graph: losses bit-identical to the compiled model without the tool
(``tests/msprobe_core/monitor/test_monitor_compiled.py``).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable, Sequence

import torch
from torch import nn

from msprobe_core.pytorch.tensor_stats import MONITOR_OPS
from msprobe_core.pytorch.wrapper_names import optimized_module_class

logger = logging.getLogger("msprobe_core.pytorch")

IN_GRAPH_GRAD_HOOKS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 11)
"""Whether Dynamo traces a gradient hook registered on an intermediate tensor without compiled autograd
(torch 2.11, pytorch#172126), which the in-graph hooks need; older Dynamo breaks the graph there."""
_warned = False

CALLS = 8
"""Calls of one hooked module per forward whose gradient statistics have a slot (more: not recorded)."""
SLOTS = 4
"""Tensors per module call (its inputs and outputs) whose gradient statistics have a slot."""


def compiled_as_a_whole(models: Sequence[nn.Module]) -> bool:
    """Whether every model is compiled as a whole by ``torch.compile(model)`` (an ``OptimizedModule``, whose
    own hooks run eagerly around the graph): where the tool's hooks go into the graph. ``model.compile()``
    (compiled in place, no eager wrapper) and partly compiled models keep the tool's eager hooks, as every
    compiled model does on a torch whose Dynamo cannot trace the gradient hooks (``IN_GRAPH_GRAD_HOOKS``)."""
    optimized = optimized_module_class()  # None: nothing is compiled
    whole = optimized is not None and bool(models) and all(isinstance(m, optimized) for m in models)
    if whole and not IN_GRAPH_GRAD_HOOKS:  # the eager hooks: a graph break at each hooked module
        global _warned
        if not _warned:
            _warned = True
            logger.warning("torch %s: Dynamo cannot trace the tool's gradient hooks (torch >= 2.11 can): the "
                           "compiled model keeps the eager hooks, with a graph break at each hooked module",
                           torch.__version__)
        return False
    return whole


def dump_stats(t: torch.Tensor) -> torch.Tensor:
    """(max, min, sum, sum of squares) of a non-empty tensor as float32, as the dump's summaries take them
    (``dump.summarize.fill``: Mean = sum / numel, Norm = its square root; a bool tensor's max and min are any
    and all; a complex tensor's are those of its magnitude); traceable by Dynamo."""
    x = t.detach()
    if x.is_complex():  # summarised by magnitude, as in eager mode
        x = x.abs()
    if x.dtype != torch.float32:
        x = x.float()
    return torch.stack([x.amax(), x.amin(), x.sum(), (x * x).sum()])


def graph_stats(t: torch.Tensor, ops: Sequence[str], eps: float) -> torch.Tensor:
    """``ops`` (names of ``tensor_stats.MONITOR_OPS``) of a non-empty tensor as a float32 tensor: torch's
    reductions, traceable by Dynamo (computed in float32, as the monitor's device path does)."""
    x = t.detach()
    if x.dtype != torch.float32:
        x = x.float()
    out = []
    for op in ops:
        if op == "min":
            out.append(x.amin())
        elif op == "max":
            out.append(x.amax())
        elif op == "norm":
            out.append(torch.linalg.vector_norm(x))
        elif op == "mean":
            out.append(x.mean())
        elif op == "zeros":
            out.append((x.abs() <= eps).float().mean())
        elif op == "nans":
            out.append(torch.isnan(x).float().sum())
        else:
            raise ValueError(f"unknown statistic '{op}'; allowed: {', '.join(MONITOR_OPS)}")
    return torch.stack(out)


class GradSlots:
    """Where the statistics of gradients land, inside the compiled backward: one float32 tensor per hooked
    module, ``[CALLS, SLOTS, width + 1]`` (the last column: 1 where a gradient arrived). ``hook(site, call,
    slot)`` is a gradient hook for ``Tensor.register_hook`` inside traced code: it copies the gradient's
    statistics to its place and returns None, so the gradient flows on untouched; Dynamo traces it into the
    backward graph (a mutation of a graph input, no Python side effect). ``take()`` hands the host what
    arrived since the last ``take`` and zeroes the slots (eagerly, between graphs)."""

    def __init__(self, stats: Callable[[torch.Tensor], torch.Tensor], width: int, calls: int = CALLS,
                 slots: int = SLOTS):
        self.stats = stats
        self.width = width
        self.calls = calls
        self.per_call = slots
        self.slots: list[torch.Tensor] = []

    def add(self, device: torch.device | None) -> int:
        """A place for one more hooked module; returns its index."""
        self.slots.append(torch.zeros((self.calls, self.per_call, self.width + 1), device=device))
        return len(self.slots) - 1

    def at(self, site: int, call: int, slot: int) -> int:
        """Where slot ``(site, call, slot)``'s row starts in ``take()``'s flat values."""
        return ((site * self.calls + call) * self.per_call + slot) * (self.width + 1)

    def clear(self) -> None:
        self.slots.clear()

    def hook(self, site: int, call: int, slot: int) -> Callable[[torch.Tensor], None] | None:
        """The gradient hook of a tensor of ``site``'s call ``call`` (None past the slots there are)."""
        if call >= self.calls or slot >= self.per_call:
            return None
        return partial(_write, self, site, call, slot)

    def take(self) -> torch.Tensor | None:
        """Every slot as one ``[sites, CALLS, SLOTS, width + 1]`` tensor (None: no site); the slots are zeroed."""
        if not self.slots:
            return None
        with torch.no_grad():
            taken = torch.stack(self.slots)
            torch._foreach_zero_(self.slots)
        return taken


def _write(slots: GradSlots, site: int, call: int, slot: int, grad: torch.Tensor) -> None:
    row = torch.cat([slots.stats(grad), grad.new_ones(1, dtype=torch.float32)])
    slots.slots[site][call, slot].copy_(row)
    return None
