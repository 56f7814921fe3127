"""L0 module records of a ``torch.compile(model)`` from statistics computed inside its graph
(``CompiledModuleRecords``): no graph break, so Inductor compiles the model as without the dump.

The dump's module hooks (``dump.call_records.CallRecords``) run eagerly; on a compiled model each would be a
graph break, and under Inductor the breaks change the kernels and so the losses' last bits. For an L0
statistics dump of a model compiled as a whole, the module hooks are replaced by two that Dynamo traces:

* the forward pre-hook and hook describe the call's inputs and outputs: non-tensor values as they are, each
  tensor by its dtype, shape and ``requires_grad`` and the index of its (max, min, sum, sum of squares) in a
  statistics tensor computed in the graph (``compiled_taps.dump_stats``); the description is appended to
  ``_fwd`` (Dynamo replays the append after the graph);
* a gradient hook registered inside the traced code on each output that requires grad (the backward record's
  ``input``) and on each input that does (its ``output``) writes the gradient's statistics to a slot
  (``compiled_taps.GradSlots``).

Eagerly, right after the compiled forward (a forward hook of the ``OptimizedModule`` wrapper), the calls are
replayed in order through ``CallRecords``' own module hooks with stand-ins: a tensor of the same dtype, shape
and ``requires_grad`` (zero strides: nothing allocated) whose statistics the summarizer is given; the records,
names, counters, construct.json parents, parameters and parameter gradients are then made by the same code as
in eager mode. Gradients are handed to ``CallRecords.on_grad`` the same way when the next forward starts, or at
``stop()`` (a handle in the service's forward handles).

A backward record's ``output`` (the gradients a call sends to its inputs) is read on a view of each input that
only the call gets (the pre-hook hands the call views): its gradient is the call's own share, as
``backward_capture`` reports it in eager mode. Limits: at most ``CALLS`` calls of a module per forward and
``GRADS`` tensors per call get backward values; stack.json holds the stack of the model's call (the records
are made after the compiled forward).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn

from msprobe_core.dump.call import Call
from msprobe_core.pytorch.compiled_taps import CALLS, GradSlots, dump_stats

GRADS = 16
"""Tensors per module call (inputs and outputs) whose gradients get a slot."""
_T = object()
"""Marks a tensor in a traced description: ``(_T, stats row, dtype, shape, requires_grad, slot)``."""
_PRE, _POST = 0, 1
_DEPTH = 8  # nesting of lists, tuples and dicts described (deeper: described as their type)


class CompiledModuleRecords:
    """The in-graph module hooks of one dump service and their replay (see the module docstring)."""

    def __init__(self, records: Any, summarizer: Any, handles: list):
        """``records``: the service's ``CallRecords``; ``summarizer``: its ``Summarizer``; ``handles``: the
        service's forward handles (removed at ``stop()``)."""
        self.records = records
        self.summarizer = summarizer
        self.handles = handles
        self._grads = GradSlots(dump_stats, 4, calls=CALLS, slots=GRADS)
        self._sites: list[tuple[nn.Module, str]] = []
        self._hooks: dict[tuple[int, str], tuple[Callable, Callable]] = {}
        self._fwd: list = []
        self._calls: dict[int, int] = {}
        self._slots: dict[tuple[int, int], int] = {}
        self._pending: list = []  # (Call, field, index, slot, stand-in) of replayed calls awaiting gradients

    # ----------------------------------------------------------------- installed at start()
    def watch(self, wrapper: nn.Module) -> None:
        """``wrapper`` (an ``OptimizedModule``) is the model being hooked: replay after each of its forwards."""
        self.handles += [wrapper.register_forward_pre_hook(self._before_forward),
                         wrapper.register_forward_hook(self._after_forward), _Flush(self)]

    def hooks(self, module: nn.Module, base: str) -> tuple[Callable, Callable]:
        """The (pre, post) forward hooks (``with_kwargs``) of ``module`` recorded as ``base``: made once, so
        the hooks Dynamo guards on stay the same objects from step to step."""
        key = (id(module), base)
        made = self._hooks.get(key)
        if made is None:
            index = len(self._sites)
            self._sites.append((module, base))
            self._grads.add(_device_of(module))
            made = self._hooks[key] = (partial(self._on_pre, index), partial(self._on_post, index))
        return made

    # ----------------------------------------------------------------- traced by Dynamo (no tool state read)
    def _on_pre(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        count = self._calls.get(index, 0)
        self._calls[index] = count + 1
        stats: list = []
        described, new, changed = self._describe((args, kwargs), stats, index, count, 0, True)
        self._fwd.append((_PRE, index, count, described, torch.stack(stats) if stats else None))
        return (tuple(new[0]), new[1]) if changed else None  # the call runs on views of its inputs (``_describe``)

    def _on_post(self, index: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        stats: list = []
        described, _, _ = self._describe(output, stats, index, self._calls.get(index, 1) - 1, 0, False)
        self._fwd.append((_POST, index, 0, described, torch.stack(stats) if stats else None))

    def _describe(self, obj: Any, stats: list, index: int, count: int, depth: int,
                  inputs: bool) -> tuple[Any, Any, bool]:
        """(``obj``'s description, ``obj`` or, for ``inputs``, ``obj`` with a view in place of each tensor whose
        gradient is hooked, whether it is a new object): the gradient of a view that only the call gets is the
        call's own share of its input's gradient, what eager mode records."""
        if isinstance(obj, torch.Tensor):
            slot, new, changed = None, obj, False
            if obj.requires_grad:
                n = self._slots.get((index, count), 0)
                hook = self._grads.hook(index, count, n)
                if hook is not None:
                    self._slots[(index, count)] = n + 1
                    if inputs:
                        new, changed = obj.view_as(obj), True
                    new.register_hook(hook)
                    slot = n
            row = None
            if obj.numel() > 0:
                row = len(stats)
                stats.append(dump_stats(obj))
            return (_T, row, obj.dtype, tuple(obj.shape), obj.requires_grad, slot), new, changed
        if depth < _DEPTH and isinstance(obj, (list, tuple)) and type(obj).__name__ != "Size":
            parts = [self._describe(v, stats, index, count, depth + 1, inputs) for v in obj]
            changed = any(p[2] for p in parts) and type(obj) in (list, tuple)  # other sequences: as they are
            return [p[0] for p in parts], (type(obj)(p[1] for p in parts) if changed else obj), changed
        if depth < _DEPTH and isinstance(obj, dict):
            parts = {k: self._describe(v, stats, index, count, depth + 1, inputs) for k, v in obj.items()}
            changed = any(p[2] for p in parts.values()) and type(obj) is dict
            return {k: p[0] for k, p in parts.items()}, ({k: p[1] for k, p in parts.items()} if changed else obj), changed
        return obj, obj, False

    # ----------------------------------------------------------------- eagerly, between graphs
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.flush_gradients()
        self._fwd.clear()
        self._calls.clear()  # what the traced hooks count per forward
        self._slots.clear()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        events = list(self._fwd)
        self._fwd.clear()  # empty whenever a forward starts: Dynamo's guard on it holds
        try:
            self._replay(events)
        except Exception as e:  # the tool must never break the user's step
            self.records._error("the records of the compiled model's forward", e)

    def _replay(self, events: list) -> None:
        blocks = [e[4].reshape(-1) for e in events if e[4] is not None]
        flat = torch.cat(blocks).tolist() if blocks else []  # the forward's one host read
        pos, open_calls = 0, {}
        records = self.records
        # in the forward's autograd mode (the records' code reads it: a call recorded with its backward)
        for kind, index, count, described, block in events:
            rows = flat[pos:pos + block.numel()] if block is not None else []
            pos += block.numel() if block is not None else 0
            module, base = self._sites[index]
            grads: list = []
            value = self._stand_in(described, rows, grads)
            if kind == _PRE:
                args, kwargs = value
                records._module_pre(base, False, False, module, tuple(args), kwargs)
                calls = records.step_state.module_calls.get(id(module))
                call = calls[-1] if calls else None
                open_calls.setdefault(index, []).append((args, kwargs, call, count))
                field = "output"  # the gradients the call sends to its inputs
            else:
                args, kwargs, call, count = open_calls[index].pop()
                records._module_post(base, module, tuple(args), kwargs, value)
                field = "input"  # the gradients of its outputs
            if isinstance(call, Call) and call.grad and records.selection.keeps("backward", field):
                self._pending += [(call, field, i, (index, count, slot), t) for i, (t, slot) in enumerate(grads)
                                  if slot is not None]

    def _stand_in(self, described: Any, rows: list, grads: list) -> Any:
        """The described value with stand-in tensors (their summaries' statistics given); ``grads`` gets
        ``(stand-in, slot)`` per tensor, in ``tensors_in`` order."""
        if isinstance(described, tuple) and len(described) == 6 and described[0] is _T:
            _, row, dtype, shape, requires_grad, slot = described
            t = _tensor(dtype, shape, requires_grad)
            if row is not None:
                self._give(t, rows[row * 4:row * 4 + 4])
            grads.append((t, slot))
            return t
        if isinstance(described, list):
            return [self._stand_in(v, rows, grads) for v in described]
        if isinstance(described, dict):
            return {k: self._stand_in(v, rows, grads) for k, v in described.items()}
        return described

    def _give(self, t: torch.Tensor, values: list[float]) -> None:
        entry = self.summarizer._entry(t)
        if entry is not None:
            entry.stats = tuple(values)

    def flush_gradients(self) -> None:
        """The gradients that reached the slots since the last forward, to their backward records."""
        try:
            self._flush_gradients()
        except Exception as e:  # the tool must never break the user's step
            self.records._error("the backward records of the compiled model", e)

    def _flush_gradients(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        taken = self._grads.take()
        if taken is None:
            return
        flat = taken.reshape(-1).tolist()
        with torch.no_grad():
            for call, field, i, ref, like in pending:
                at = self._grads.at(*ref)
                if flat[at + 4] != 1.0:  # no gradient reached this tensor
                    continue
                grad = _tensor(like.dtype, tuple(like.shape), False)
                self._give(grad, flat[at:at + 4])
                self.records.on_grad(call.backward, field, i, call.save, call.backward_parent(), grad)


class _Flush:
    """A forward handle whose removal at ``stop()`` records the gradients of the last forward."""

    def __init__(self, owner: CompiledModuleRecords):
        self.owner = owner

    def remove(self) -> None:
        self.owner.flush_gradients()


def _tensor(dtype: torch.dtype, shape: tuple, requires_grad: bool) -> torch.Tensor:
    """A stand-in: ``dtype`` and ``shape``, one element in memory (zero strides)."""
    t = torch.empty_strided(shape, (0,) * len(shape), dtype=dtype)
    if requires_grad and (dtype.is_floating_point or dtype.is_complex):
        t.requires_grad_(True)
    return t


def _device_of(module: nn.Module) -> Optional[torch.device]:
    for p in module.parameters():
        return p.device
    return None
