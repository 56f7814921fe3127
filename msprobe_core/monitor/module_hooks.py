"""Activation statistics from module hooks that cannot change the numbers.

* Forward: ``register_forward_hook(with_kwargs=True)`` sees a module's inputs and outputs; statistics are
  computed at once (under ``no_grad``, on detached tensors) so later in-place ops cannot alter them.
* Backward: a tensor hook (``Tensor.register_hook``) on each monitored input/output that requires grad
  receives the gradient of the loss with respect to that tensor; the hook returns None, so the gradient
  flows on untouched. ``register_full_backward_hook`` is never used: it wraps inputs and outputs in
  identity autograd nodes and changes the graph.
* A tensor seen twice (the output of ``ln`` is the input of the next ``linear``) is summarised once and
  gets both names; the backward hook is registered once per tensor.
* Micro-batches are counted by a forward pre-hook on each model chunk. Forward calls made while
  autograd runs backward (activation recomputation for gradient checkpointing) and calls of modules in
  eval mode are skipped. Inputs that do not require grad get no backward hook (so no placeholder NaN).
"""

from __future__ import annotations

import logging
import weakref
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from msprobe_core.monitor.collector import Slot, StepCollector
from msprobe_core.monitor.config import IOSpec
from msprobe_core.monitor.records import ACTV, ACTV_GRAD
from msprobe_core.common.tool_guard import tool_work
from msprobe_core.pytorch.native_shards import local_view
from msprobe_core.pytorch.wrapper_names import is_compiled, opaque_to_compiler, unwrapped_modules

logger = logging.getLogger("msprobe_core.monitor")

ROOT_NAME = "model"
"""Name used for a model chunk's root module (whose ``named_modules`` name is empty)."""

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. recomputation in gradient checkpointing)."""
    return _graph_task_id is not None and _graph_task_id() != -1


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and x.numel() > 0


def tensor_leaves(obj: Any, prefix: str = "", depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Floating-point tensors in a module's arguments or output: (index path, tensor), two levels deep."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)] if _is_float(obj) else []
    out: list[tuple[str, torch.Tensor]] = []
    if depth > 2:
        return out
    if isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            out.extend(tensor_leaves(item, f"{prefix}.{i}" if prefix else str(i), depth + 1))
    elif isinstance(obj, dict):
        for key, item in obj.items():
            out.extend(tensor_leaves(item, f"{prefix}.{key}" if prefix else str(key), depth + 1))
    return out


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _identity(t: torch.Tensor) -> tuple[int, int, int]:
    """Same object, same version, same storage: the values cannot have changed in between."""
    local = t if type(t) in _PLAIN else local_view(t)
    return id(t), local._version, local.data_ptr()


def _select(leaves: list[tuple[str, torch.Tensor]], index: int | None) -> list[tuple[str, torch.Tensor]]:
    if index is None:
        return []
    if index < 0:
        return leaves
    return [leaves[index]] if index < len(leaves) else []


def _input_leaves(args: Any, kwargs: Any) -> list[tuple[str, torch.Tensor]]:
    """``tensor_leaves`` of a call's arguments, with the usual call (one tensor, no keywords) made cheap."""
    if not kwargs and len(args) == 1 and type(args[0]) in _PLAIN:
        return [("0", args[0])] if _is_float(args[0]) else []
    return tensor_leaves(args) + tensor_leaves(kwargs, "")


def _output_leaves(output: Any) -> list[tuple[str, torch.Tensor]]:
    if type(output) in _PLAIN:
        return [("", output)] if _is_float(output) else []
    return tensor_leaves(output)


class _Site:
    """One hooked module: its name, its spec, its chunk and the row names of its calls, each made once."""

    __slots__ = ("name", "spec", "chunk", "_names")

    def __init__(self, name: str, spec: IOSpec, chunk: int):
        self.name = name
        self.spec = spec
        self.chunk = chunk
        self._names: dict[tuple[int, str, str | None], str] = {}

    def named(self, count: int, direction: str,
              leaves: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``{name}[.call{count}].{direction}[.{index path}]`` of each leaf (the path only with several)."""
        names = self._names
        single = len(leaves) == 1
        out = []
        for suffix, t in leaves:
            key = (count, direction, None if single else suffix)
            full = names.get(key)
            if full is None:
                base = self.name if count == 0 else f"{self.name}.call{count}"
                full = names[key] = f"{base}.{direction}" if single else f"{base}.{direction}.{suffix}"
            out.append((full, t))
        return out


class ActivationHooks:
    """Installs and removes the activation hooks of a list of model chunks."""

    def __init__(self, collector: StepCollector, *, forward: bool, backward: bool,
                 is_active: Callable[[], bool], step_token: Callable[[], int]):
        self.collector = collector
        self.forward = forward
        self.backward = backward
        self._is_active = is_active
        self._step_token = step_token
        self._handles: list[Any] = []
        self._micro: list[int] = []
        self._calls: dict[str, int] = {}
        # per step, by tensor identity (few objects the garbage collector tracks: this runs per tensor)
        self._refs: dict[tuple[int, int, int], weakref.ref] = {}
        self._fwd_slots: dict[tuple[int, int, int], Slot] = {}
        self._bwd_hooks: dict[tuple[int, int, int], _GradHook] = {}
        self._failed = False
        self.module_names: list[str] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self, chunks: Sequence[nn.Module], select: Callable[[str], IOSpec | None]) -> list[str]:
        """Hook every module for which ``select(qualified name)`` gives a spec; returns the hooked names."""
        self.remove()
        self._micro = [-1] * len(chunks)
        multi = len(chunks) > 1
        compiled = is_compiled(chunks)  # hooks inside compiled code run eagerly (no recompiles for the tool)
        for c, chunk in enumerate(chunks):
            self._handles.append(chunk.register_forward_pre_hook(partial(self._on_chunk_start, c)))
            for name, module in unwrapped_modules(chunk):
                qualified = (f"{c}:" if multi else "") + (name or ROOT_NAME)
                spec = select(qualified)
                if spec is None:
                    continue
                hook = partial(self._on_forward, _Site(qualified, spec, c))
                if compiled:
                    hook = opaque_to_compiler(hook)
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
                self.module_names.append(qualified)
        return list(self.module_names)

    def remove(self) -> None:
        """Remove every hook this object installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.module_names.clear()
        self.new_step()

    def new_step(self) -> None:
        """Forget micro-batch counters and per-step tensor identities."""
        self._micro = [-1] * len(self._micro)
        self._calls.clear()
        self._refs.clear()
        self._fwd_slots.clear()
        self._bwd_hooks.clear()

    # ------------------------------------------------------------------------------------------ hooks
    def _on_chunk_start(self, chunk: int, module: nn.Module, args: Any) -> None:
        if module.training and not in_backward() and self._is_active():
            self._micro[chunk] += 1
            if chunk == 0:
                self._calls.clear()
                self._refs.clear()
                self._fwd_slots.clear()
                self._bwd_hooks.clear()

    def _on_forward(self, site: _Site, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not module.training or not self._is_active() or in_backward():
            return
        try:
            with tool_work():  # the monitor's own tensor work never shows up in an L1 dump
                self._capture(site, max(self._micro[site.chunk], 0), args, kwargs, output)
        except Exception:  # never break the training step
            if not self._failed:
                self._failed = True
                logger.exception("monitor: activation hook of '%s' failed; activation statistics may be incomplete",
                                 site.name)

    def _capture(self, site: _Site, micro: int, args: Any, kwargs: Any, output: Any) -> None:
        name, spec = site.name, site.spec
        count = self._calls.get(name, 0)
        self._calls[name] = count + 1
        ins = _input_leaves(args, kwargs)
        outs = _output_leaves(output)
        if self.forward:
            selected = site.named(count, "input", _select(ins, spec.input)) + site.named(count, "output",
                                                                                        _select(outs, spec.output))
            if selected:
                self._record_forward(name, selected, micro)
        if self.backward:
            selected = (site.named(count, "input", _select(ins, spec.input_grad))
                        + site.named(count, "output", _select(outs, spec.output_grad)))
            for full, t in selected:
                if t.requires_grad:
                    self._register_grad(full, name, t, micro)

    def _seen(self, key: tuple[int, int, int], t: torch.Tensor) -> bool:
        """Whether ``t`` (identity ``key``) was seen before in this step; from now on it is."""
        ref = self._refs.get(key)
        if ref is not None and ref() is t:
            return True
        self._refs[key] = weakref.ref(t)
        self._fwd_slots.pop(key, None)  # a dead tensor's identity, reused
        self._bwd_hooks.pop(key, None)
        return False

    def _record_forward(self, module: str, selected: list[tuple[str, torch.Tensor]], micro: int) -> None:
        slots, collector = self._fwd_slots, self.collector
        for full, t in selected:
            key = _identity(t)
            where = slots.get(key) if self._seen(key, t) else None
            if where is None:
                where = slots[key] = collector.slot(t)
            collector.add_entry(ACTV, full, module, micro, t.numel(), where, external=not t.requires_grad)

    def _register_grad(self, full: str, module: str, t: torch.Tensor, micro: int) -> None:
        key = _identity(t)
        hook = self._bwd_hooks.get(key) if self._seen(key, t) else None
        if hook is not None:
            hook.names += ((full, module),)
            return
        hook = self._bwd_hooks[key] = _GradHook(self, micro, self._step_token(), ((full, module),))
        t.register_hook(hook)


class _GradHook:
    """The gradient hook of one activation tensor: records the gradient's statistics under each of the
    tensor's names and returns None (the gradient flows on untouched). One object per tensor and step."""

    __slots__ = ("hooks", "micro", "token", "names")

    def __init__(self, hooks: ActivationHooks, micro: int, token: int, names: tuple[tuple[str, str], ...]):
        self.hooks = hooks
        self.micro = micro
        self.token = token
        self.names = names
        """(row name, module) pairs (a tuple of strings: nothing for the garbage collector to track)."""

    def __call__(self, grad: torch.Tensor) -> None:
        hooks = self.hooks
        if self.token != hooks._step_token() or not hooks._is_active() or not _is_float(grad):
            return None
        try:
            collector = hooks.collector
            with tool_work():
                where = collector.slot(grad)
            numel, micro = grad.numel(), self.micro
            for full, module in self.names:
                collector.add_entry(ACTV_GRAD, full, module, micro, numel, where)
        except Exception:  # never break the backward pass
            if not hooks._failed:
                hooks._failed = True
                logger.exception("monitor: gradient hook of '%s' failed", self.names[0][0])
        return None
