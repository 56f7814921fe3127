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
from collections import OrderedDict
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from msprobe_core.monitor.collector import Slot, StepCollector, is_float_tensor
from msprobe_core.monitor.config import IOSpec
from msprobe_core.monitor.records import ACTV, ACTV_GRAD
from msprobe_core.monitor.step_state import StepState
from msprobe_core.common.tool_guard import TOOL
from msprobe_core.pytorch.native_shards import local_view
from msprobe_core.pytorch.step_hooks import add_tensor_hook
from msprobe_core.pytorch.wrapper_names import is_compiled, opaque_to_compiler, unwrapped_modules
from msprobe_core.stats.kernel import KERNEL

logger = logging.getLogger("msprobe_core.monitor")

ROOT_NAME = "model"
"""Name used for a model chunk's root module (whose ``named_modules`` name is empty)."""

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_ActivationCore = getattr(KERNEL, "ActivationCore", None)
_CActivation = getattr(KERNEL, "Activation", None)
_ForwardSite = getattr(KERNEL, "ForwardSite", None)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. recomputation in gradient checkpointing)."""
    return _graph_task_id is not None and _graph_task_id() != -1


_is_float = is_float_tensor


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


def _identity(t: torch.Tensor) -> int:
    """Same object, same version, same storage: the values cannot have changed in between. One int (an
    object the garbage collector does not track) made of id, data pointer and version."""
    local = t if type(t) in _PLAIN else local_view(t)
    return (id(t) << 96) | (local.data_ptr() << 32) | (local._version & 0xFFFFFFFF)


def _chosen(count: int, index: int | None) -> list[int]:
    """The leaves an ``IOSpec`` index selects out of ``count``: none (None), all (-1) or one."""
    if index is None:
        return []
    if index < 0:
        return list(range(count))
    return [index] if index < count else []


_ONE_ARG = ("0",)
_ONE_OUTPUT = ("",)


def _input_leaves(args: Any, kwargs: Any) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    """The index paths and tensors of ``tensor_leaves`` of a call's arguments, the usual call (one tensor,
    no keywords) made cheap."""
    if not kwargs and len(args) == 1 and type(args[0]) in _PLAIN:
        return (_ONE_ARG, [args[0]]) if _is_float(args[0]) else ((), [])
    return _split(tensor_leaves(args) + tensor_leaves(kwargs, ""))


def _output_leaves(output: Any) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    if type(output) in _PLAIN:
        return (_ONE_OUTPUT, [output]) if _is_float(output) else ((), [])
    return _split(tensor_leaves(output))


def _split(leaves: list[tuple[str, torch.Tensor]]) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    return tuple(path for path, _ in leaves), [t for _, t in leaves]


_Plan = list[tuple[int, "str | None", "str | None"]]
"""Per leaf (inputs, then outputs): its index, its row name for statistics (None: not recorded) and for its
gradient (None: no gradient hook)."""


class _Site:
    """One hooked module: its name, its spec, its chunk, and per call layout the row names of its leaves,
    worked out once."""

    __slots__ = ("name", "spec", "chunk", "forward", "backward", "_plans", "usual", "generation", "calls")

    def __init__(self, name: str, spec: IOSpec, chunk: int, forward: bool, backward: bool):
        self.name = name
        self.spec = spec
        self.chunk = chunk
        self.forward = forward
        self.backward = backward
        self._plans: dict[tuple[int, tuple[str, ...], tuple[str, ...]], _Plan] = {}
        self.usual = self.plan(0, _ONE_ARG, _ONE_OUTPUT)
        """The plan of the usual call: the first of its step, one float tensor in, one out."""
        self.generation = -1
        """``ActivationHooks``' generation (a step, or a first chunk's forward) ``calls`` counts in."""
        self.calls = 0

    def usual_names(self) -> tuple[tuple[str | None, tuple | None], tuple[str | None, tuple | None]]:
        """The usual plan as the kernel's ``ForwardSite`` takes it: for the input, then the output, its row name
        (or None) and its gradient names (``((row name, module),)``, or None)."""
        leaves = {i: (fwd, None if bwd is None else ((bwd, self.name),)) for i, fwd, bwd in self.usual}
        return leaves.get(0, (None, None)), leaves.get(1, (None, None))

    def plan(self, count: int, ins: tuple[str, ...], outs: tuple[str, ...]) -> _Plan:
        """The leaves of the ``count``-th call (0: the first) with inputs ``ins`` and outputs ``outs`` (index
        paths): ``{name}[.call{count}].{input|output}[.{index path}]``, the path only where a direction
        has several selected leaves."""
        key = (count, ins, outs)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(count, ins, outs)
        return plan

    def _make_plan(self, count: int, ins: tuple[str, ...], outs: tuple[str, ...]) -> _Plan:
        base = self.name if count == 0 else f"{self.name}.call{count}"
        spec = self.spec

        def names(paths: tuple[str, ...], direction: str, index: int | None, on: bool) -> dict[int, str]:
            chosen = _chosen(len(paths), index) if on else []
            if len(chosen) == 1:
                return {chosen[0]: f"{base}.{direction}"}
            return {i: f"{base}.{direction}.{paths[i]}" for i in chosen}

        fwd_in = names(ins, "input", spec.input, self.forward)
        fwd_out = names(outs, "output", spec.output, self.forward)
        bwd_in = names(ins, "input", spec.input_grad, self.backward)
        bwd_out = names(outs, "output", spec.output_grad, self.backward)
        plan: _Plan = [(i, fwd_in.get(i), bwd_in.get(i)) for i in range(len(ins))]
        plan += [(len(ins) + i, fwd_out.get(i), bwd_out.get(i)) for i in range(len(outs))]
        return [leaf for leaf in plan if leaf[1] is not None or leaf[2] is not None]


def selected_modules(c: int, chunk: nn.Module, select: Callable[[str], IOSpec | None],
                     multi: bool) -> Iterator[tuple[nn.Module, str, IOSpec]]:
    """(module, qualified name, spec) of each module of chunk ``c`` (unwrapped names) that ``select`` picks;
    with ``multi`` (several chunks) the names are prefixed ``"{c}:"``."""
    for name, module in unwrapped_modules(chunk):
        qualified = (f"{c}:" if multi else "") + (name or ROOT_NAME)
        spec = select(qualified)
        if spec is not None:
            yield module, qualified, spec


class HookSet:
    """What the activation hook sets share (``ActivationHooks``, and ``CompiledActivationHooks`` for a model
    compiled as a whole): the collector they feed, the step in progress, the hooks they installed and the
    names of the modules they watch. A subclass adds ``install`` and ``_forget_step``."""

    def __init__(self, collector: StepCollector, *, forward: bool, backward: bool, state: StepState):
        """``state``: the monitor's step in progress (``new_step`` hands over each next one); hooks record
        while its ``collecting`` is set, and a gradient hook only for the step that registered it."""
        self.collector = collector
        self.forward = forward
        self.backward = backward
        self.state = state
        self._handles: list[Any] = []
        self.module_names: list[str] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        """Remove every hook this object installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.module_names.clear()
        self.new_step()

    def new_step(self, state: StepState | None = None) -> None:
        """Forget what belonged to the step that ended; ``state``: the step begun."""
        if state is not None:
            self.state = state
        self._forget_step()

    def _forget_step(self) -> None:
        raise NotImplementedError


class ActivationHooks(HookSet):
    """Installs and removes the activation hooks of a list of model chunks."""

    def __init__(self, collector: StepCollector, *, forward: bool, backward: bool, state: StepState):
        super().__init__(collector, forward=forward, backward=backward, state=state)
        self._micro: list[int] = []
        self._generation = 0
        """Bumped where call counts start over (``_Site.calls`` of an older generation count as 0)."""
        # per step, by tensor identity (one object the garbage collector tracks per tensor, and its weakref)
        self._seen: dict[int, _Activation] = {}
        self._failed = False
        self._core = self._make_core()
        """The kernel's ``ActivationCore`` (None: the Python hooks only): its ``ForwardSite`` does the usual
        forward call in C, its ``Activation`` the gradient hook."""
        self._new_activation, self._owner = (_Activation, self) if self._core is None else (_CActivation, self._core)

    def _make_core(self) -> Any:
        rows = self.collector.engine.tensor_rows
        if rows is None or None in (_ActivationCore, _CActivation, _ForwardSite):
            return None  # no kernel, or MSPROBE_FAST_STATS=0
        collector = self.collector
        return _ActivationCore(self, rows, collector._raw, collector._entries, collector.engine.count_eps, ACTV,
                               ACTV_GRAD, _graph_task_id, torch.get_num_threads, OrderedDict, RemovableHandle,
                               torch._C.TensorBase)

    def install(self, chunks: Sequence[nn.Module], select: Callable[[str], IOSpec | None]) -> list[str]:
        """Hook every module for which ``select(qualified name)`` gives a spec; returns the hooked names."""
        self.remove()
        self._micro = [-1] * len(chunks)
        multi = len(chunks) > 1
        compiled = is_compiled(chunks)  # hooks inside compiled code run eagerly (no recompiles for the tool)
        for c, chunk in enumerate(chunks):
            self._handles.append(chunk.register_forward_pre_hook(partial(self._on_chunk_start, c)))
            for module, qualified, spec in selected_modules(c, chunk, select, multi):
                site = _Site(qualified, spec, c, self.forward, self.backward)
                hook = partial(self._on_forward, site)
                if compiled:
                    hook = opaque_to_compiler(hook)
                elif self._core is not None:  # the usual call in C, every other by hook
                    hook = _ForwardSite(self._core, site, hook, qualified, c, *site.usual_names())
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
                self.module_names.append(qualified)
        return list(self.module_names)

    def _forget_step(self) -> None:
        """Forget micro-batch counters and per-step tensor identities."""
        self._micro = [-1] * len(self._micro)
        self._generation += 1
        self._seen.clear()

    # ------------------------------------------------------------------------------------------ hooks
    def _on_chunk_start(self, chunk: int, module: nn.Module, args: Any) -> None:
        if module.training and not in_backward() and self.state.collecting:
            self._micro[chunk] += 1
            if chunk == 0:
                self._generation += 1
                self._seen.clear()

    def _on_forward(self, site: _Site, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        # called for every module call: one frame, the usual call (one float tensor in, one out) decided inline
        if not module.training or not self.state.collecting or (_graph_task_id is not None and _graph_task_id() != -1):
            return  # in_backward(): activation recomputation
        TOOL.depth += 1  # the monitor's own tensor work never shows up in an L1 dump (tool_work, inlined)
        try:
            if site.generation == self._generation:
                count = site.calls
                site.calls = count + 1
            else:
                site.generation, site.calls, count = self._generation, 1, 0
            micro = self._micro[site.chunk]
            if micro < 0:
                micro = 0
            if (not count and not kwargs and len(args) == 1 and type(args[0]) in _PLAIN and type(output) in _PLAIN
                    and _is_float(args[0]) and _is_float(output)):
                plan, tensors = site.usual, (args[0], output)
            else:
                in_paths, tensors = _input_leaves(args, kwargs)
                out_paths, outs = _output_leaves(output)
                tensors += outs
                plan = site.plan(count, in_paths, out_paths)
            name = site.name
            collector, seen = self.collector, self._seen
            for i, fwd_name, bwd_name in plan:
                t = tensors[i]
                key = _identity(t)
                known = seen.get(key)
                if known is None or known.ref() is not t:  # new (a dead tensor's identity may be reused)
                    known = seen[key] = self._new_activation(weakref.ref(t), self._owner)
                requires_grad = t.requires_grad
                if fwd_name is not None:
                    if known.slot is None:
                        known.slot = collector.record_named(ACTV, ((fwd_name, name),), micro, t, not requires_grad)
                    else:
                        collector.add_entry(ACTV, fwd_name, name, micro, t.numel(), known.slot, not requires_grad, True)
                if bwd_name is not None and requires_grad:
                    if known.names:
                        known.names += ((bwd_name, name),)
                    else:
                        known.micro, known.state, known.names = micro, self.state, ((bwd_name, name),)
                        if add_tensor_hook(t, known) is None:  # a subclass: torch's own way
                            t.register_hook(known)
        except Exception as exc:  # never break the training step
            self._hook_failed(True, site.name, exc)
        finally:
            TOOL.depth -= 1

    def _on_grad(self, activation: Any, grad: torch.Tensor) -> None:
        """An activation's gradient hook (``_Activation``, or the kernel's ``Activation`` for a gradient it does
        not read): records the gradient's statistics under each of the activation's names."""
        state = activation.state
        if self.state is not state or not state.collecting:
            return None
        TOOL.depth += 1  # tool_work, inlined
        try:
            self.collector.record_named(ACTV_GRAD, activation.names, activation.micro, grad)  # not float: nothing
        except Exception as exc:  # never break the backward pass
            self._hook_failed(False, activation.names[0][0], exc)
        finally:
            TOOL.depth -= 1
        return None

    def _hook_failed(self, forward: bool, name: str, exc: BaseException) -> None:
        """Log the first failure of a hook (the training goes on; statistics may be incomplete)."""
        if self._failed:
            return
        self._failed = True
        if forward:
            logger.error("monitor: activation hook of '%s' failed; activation statistics may be incomplete", name,
                         exc_info=exc)
        else:
            logger.error("monitor: gradient hook of '%s' failed", name, exc_info=exc)


class _Activation:
    """An activation tensor seen this step: the slot of its statistics and, once a gradient name is asked for,
    its gradient hook, which records the gradient's statistics under each of the tensor's names and returns
    None (the gradient flows on untouched). One object per tensor and step."""

    __slots__ = ("ref", "hooks", "slot", "micro", "state", "names")

    def __init__(self, ref: weakref.ref, hooks: ActivationHooks):
        self.ref = ref
        """The tensor (weakly: its identity may be reused once it is gone)."""
        self.hooks = hooks
        self.slot: Slot | None = None
        """Where its forward statistics are (None: not computed)."""
        self.micro = 0
        self.state: StepState | None = None
        """The step that registered the hook: a gradient computed in a later one is not its business."""
        self.names: tuple[tuple[str, str], ...] = ()
        """(row name, module) pairs of its gradient (a tuple of strings: nothing for the garbage collector)."""

    def __call__(self, grad: torch.Tensor) -> None:
        return self.hooks._on_grad(self, grad)
