"""Activation statistics of a ``torch.compile``d model computed inside its graph (``CompiledActivationHooks``).

``ActivationHooks`` on a compiled model run eagerly at graph breaks (one per hooked module), and under Inductor
graph breaks change the kernels and so the losses' last bits. On a model compiled as a whole with
``torch.compile(model)`` the monitor installs these hooks instead: the same rows as in eager mode (names, call
order, micro-batches, aliases, external inputs, values within float32 rounding), no graph break, no
recompilation, losses bit-identical to the compiled model without the monitor. Their tensor work is traced into
the graph (``pytorch.compiled_taps``):

* a module's forward hook computes the statistics of its selected inputs and outputs in the graph and appends
  them, with the rows' names (constants), to ``_fwd``;
* for each selected tensor whose gradient is wanted it registers a gradient hook inside the traced code, as
  ``ActivationHooks`` does eagerly (so it sees the tensor's whole gradient); the hook writes the gradient's
  statistics to a slot of ``GradSlots``.

Which tensor each sighting is (the output of ``ln`` is the input of ``linear``: one tensor, the second row an
alias) and when autograd made it (backward rows come in the order autograd reaches the tensors: the last made
first) is worked out while Dynamo traces, by ``comptime`` (code Dynamo runs at compile time, not in the graph)
into ``_Sightings.info``: the traced code holds no tensor in a Python object (Dynamo would make it an output
of the graph, and the kernels would change).

The hooks read no state of the monitor while Dynamo traces them: they run in every training forward. Eagerly,
between graphs (the compiled wrapper's own pre-hook, ``flush``, ``new_step``), ``_drain`` moves the last
forward's events and the gradient slots to ``events``; ``flush`` (called by the monitor when the step's
weights are read) turns the step's events into rows with one host read, or drops them when the step is not
monitored. ``model.compile()`` (compiled in place: no eager wrapper) and partly compiled models keep
``ActivationHooks``.
"""

from __future__ import annotations

import logging
import weakref
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from msprobe_core.monitor.collector import StepCollector
from msprobe_core.monitor.config import IOSpec
from msprobe_core.monitor.module_hooks import HookSet, _input_leaves, _output_leaves, _Site, selected_modules
from msprobe_core.monitor.records import ACTV, ACTV_GRAD
from msprobe_core.monitor.step_state import StepState
from msprobe_core.pytorch.compiled_taps import GradSlots, graph_stats
from msprobe_core.pytorch.wrapper_names import unwrapped_modules

logger = logging.getLogger("msprobe_core.monitor")

_START, _ROWS, _GRADS = 0, 1, 2  # event kinds
_LAST = 1 << 62  # creation order of a tensor the root module returns


class CompiledActivationHooks(HookSet):
    """``ActivationHooks``' interface (``install``, ``remove``, ``new_step``, ``installed``, ``module_names``)
    for models compiled as a whole, plus ``flush``."""

    def __init__(self, collector: StepCollector, *, forward: bool, backward: bool, state: StepState):
        super().__init__(collector, forward=forward, backward=backward, state=state)
        self.ops = tuple(collector.engine.ops)
        self.eps = float(collector.engine.eps)
        self._sites: list[_Site] = []
        self._grads = GradSlots(partial(graph_stats, ops=self.ops, eps=self.eps), len(self.ops))
        self.events: list = []
        """The step's events in the order they happened."""
        self._fwd: list = []
        """The events of the forward running now (Dynamo replays the traced appends after the graph): empty
        whenever a forward starts (so Dynamo's guard on it holds), moved to ``events`` by ``_drain``."""
        self._tapped = False
        """A gradient hook was registered since the gradient slots were last taken."""
        self._sightings = _Sightings()
        self._calls: dict[int, int] = {}
        self._slots: dict[tuple[int, int], int] = {}

    def install(self, chunks: Sequence[nn.Module], select: Callable[[str], IOSpec | None]) -> list[str]:
        """Hook every module for which ``select(qualified name)`` gives a spec; returns the hooked names."""
        self.remove()
        global comptime
        from torch._dynamo.comptime import comptime  # loaded: the chunks are compiled
        multi = len(chunks) > 1
        for c, chunk in enumerate(chunks):
            root = next(iter(unwrapped_modules(chunk)))[1]
            device = _device_of(root)
            # the compiled wrapper's own hooks run eagerly, around the graph (torch.compile runs the hooks of a
            # model of a class of its own outside the graph too): the previous pass's results out, a new forward
            self._handles.append(chunk.register_forward_pre_hook(partial(self._on_root_start, c)))
            for module, qualified, spec in selected_modules(c, chunk, select, multi):
                index = self._grads.add(_device_of(module) or device)
                self._sites.append(_Site(qualified, spec, c, self.forward, self.backward))
                hooked = chunk if module is root else module  # the root's rows: on the wrapper, eagerly
                self._handles.append(hooked.register_forward_hook(partial(self._on_forward, index), with_kwargs=True))
                self.module_names.append(qualified)
        return list(self.module_names)

    def remove(self) -> None:
        """Remove every hook this object installed, with the sites and gradient slots they fed."""
        self._sites.clear()
        self._grads.clear()
        super().remove()

    def _forget_step(self) -> None:
        """Drop the events of the step that ended."""
        self._drain()
        self.events = []

    def _drain(self) -> None:
        """Eagerly, between graphs: the last forward's events and the gradients that arrived since, to ``events``."""
        if self._fwd:
            self._tapped = self._tapped or any(e[0] == _ROWS and e[3] for e in self._fwd)
            self.events.extend(self._fwd)
            self._fwd.clear()
        if self._tapped:
            self._tapped = False
            self.events.append((_GRADS, self._grads.take()))

    def _on_root_start(self, chunk: int, module: nn.Module, args: Any) -> None:
        """Eagerly, before a chunk's graph: the previous pass's results out, a new forward (and trace) begins."""
        self._drain()
        self._calls.clear()
        self._slots.clear()
        self._sightings.new_trace()
        if module.training:
            self.events.append((_START, chunk))

    # ----------------------------------------------------------------- traced by Dynamo (no tool state read)

    def _on_forward(self, index: int, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not module.training:
            return
        site = self._sites[index]
        count = self._calls.get(index, 0)
        self._calls[index] = count + 1
        in_paths, tensors = _input_leaves(args, kwargs)
        out_paths, outs = _output_leaves(output)
        n_in = len(tensors)
        tensors = tensors + outs
        owner = self._sightings.key
        rows, grads, stats = [], [], []
        for i, fwd_name, bwd_name in site._make_plan(count, in_paths, out_paths):  # plan() caches: state to guard
            t = tensors[i]
            key = (index, count, i)
            # which tensor this is (host side); run eagerly (the root's hooks): an output is the last made
            comptime(_note_traced, lambda: _SIGHTINGS[owner].note(key, t, order=(_LAST if i >= n_in else -1,)))
            if fwd_name is not None:
                rows.append((fwd_name, t.numel(), not t.requires_grad, len(stats), key))
                stats.append(graph_stats(t, self.ops, self.eps))
            if bwd_name is not None and t.requires_grad:  # a hook per sighting, as in eager mode
                slot = self._slots.get((index, count), 0)
                hook = self._grads.hook(index, count, slot)
                if hook is not None:
                    self._slots[(index, count)] = slot + 1
                    t.register_hook(hook)
                    grads.append(((index, count, slot), bwd_name, t.numel(), key))
        self._fwd.append((_ROWS, index, tuple(rows), tuple(grads), torch.stack(stats) if stats else None))

    # ----------------------------------------------------------------- host side
    def flush(self) -> None:
        """Turn the step's events into rows of the collector (one host read), if the step is monitored."""
        try:
            self._flush()
        except Exception:  # never break the training step
            logger.exception("monitor: activation statistics of the compiled model could not be read")

    def _flush(self) -> None:
        self._drain()
        events, self.events = self.events, []
        if not events or not self.state.collecting:
            return
        width = len(self.ops)
        blocks = [e[4].reshape(-1) if e[0] == _ROWS else e[1].reshape(-1) for e in events
                  if (e[0] == _ROWS and e[4] is not None) or (e[0] == _GRADS and e[1] is not None)]
        if not blocks:
            return
        flat = torch.cat([b.float() for b in blocks]).tolist()  # the step's one host read
        values, pos = [], 0
        for e in events:
            if e[0] == _ROWS and e[4] is not None:
                n = e[4].shape[0]
                values.append([flat[pos + k * width: pos + (k + 1) * width] for k in range(n)])
                pos += n * width
            elif e[0] == _GRADS and e[1] is not None:
                n = e[1].numel()
                values.append(flat[pos:pos + n])
                pos += n
            else:
                values.append(None)
        self._to_rows(events, values, width)

    def _to_rows(self, events: list, values: list, width: int) -> None:
        collector, sites, info = self.collector, self._sites, self._sightings.info
        micro = [-1] * (1 + max((s.chunk for s in sites), default=0))
        had_row: set = set()  # tensors (first sightings) with a forward row in this forward
        hooked: list[tuple] = []  # gradient hooks of the forwards not yet through a backward pass
        host: list[list[float]] = []
        rows: list[tuple] = []  # (kind, name, module, micro, numel, host row, external, alias)

        def backward_done(got: list[float]) -> None:
            # autograd reaches the tensors from the last made to the first: rows in that order, a tensor's
            # rows together (its first hook's place), as its names were given
            groups: dict[tuple, list[tuple]] = {}
            for h in hooked:
                groups.setdefault(h[0], []).append(h)
            for group in sorted(groups.values(), key=lambda g: (g[0][1], g[0][2]), reverse=True):
                k = 0
                for _, _, _, ref, name, module, m, numel in group:
                    at = self._grads.at(*ref)
                    if got[at + width] != 1.0:  # no gradient reached this tensor
                        continue
                    host.append(got[at:at + width])
                    rows.append((ACTV_GRAD, name, module, m, numel, len(host) - 1, False, k > 0))
                    k += 1
            hooked.clear()

        for e, vals in zip(events, values):
            kind = e[0]
            if kind == _GRADS:
                if vals is not None:
                    backward_done(vals)
            elif kind == _START:
                micro[e[1]] += 1
                if e[1] == 0:
                    had_row.clear()
            else:
                _, index, fwd_rows, wanted, _ = e
                site = sites[index]
                m = max(micro[site.chunk], 0)
                for name, n, external, k, key in fwd_rows:
                    first = info.get(key, (key, 0))[0]
                    host.append(vals[k])
                    rows.append((ACTV, name, site.name, m, n, len(host) - 1, external, first in had_row))
                    had_row.add(first)
                for ref, name, n, key in wanted:
                    first, order = info.get(key, (key, 0))
                    hooked.append((first, order, len(hooked), ref, name, site.name, m, n))
        if not rows:
            return
        base = collector.add_block(torch.tensor(host, dtype=torch.float32).reshape(-1, width))
        cpu = torch.device("cpu")
        for kind, name, module, m, n, k, external, alias in rows:
            collector.add_entry(kind, name, module, m, n, (cpu, base + k), external=external, alias=alias)


comptime: Any = None
"""``torch._dynamo.comptime.comptime``, imported by the first ``install`` (Dynamo is loaded by then)."""
_SIGHTINGS: "weakref.WeakValueDictionary[int, _Sightings]" = weakref.WeakValueDictionary()


class _Sightings:
    """Which tensor each sighting ``(site, call, leaf)`` of a hook is, and when autograd made it: worked out while
    Dynamo traces (``comptime``: a plain table, never part of the graph, the tensor known by its graph node) or,
    for a hook run eagerly, as it runs. ``info[sighting] = (first sighting of the same tensor, creation order)``."""

    def __init__(self) -> None:
        self.key = id(self)
        _SIGHTINGS[self.key] = self
        self.info: dict[tuple, tuple] = {}
        self._first: dict[Any, tuple] = {}
        self._alive: list = []  # eager sightings: the tensors whose ids are keys of ``_first``
        self._count = 0

    def new_trace(self) -> None:
        self._first = {}
        self._alive = []

    def note(self, key: tuple, t: Any, identity: Any = None, order: Any = None) -> None:
        if identity is None:
            identity = (id(t), t._version)
            self._alive.append(t)
        self._count += 1
        first = self._first.setdefault(identity, key)
        self.info[key] = (first, order if order is not None else (self._count,))


def _note_traced(ctx: Any) -> None:
    """``comptime``: the sighting ``key`` of the local ``t``, known by its graph node."""
    t = ctx.get_local("t")
    node = t.as_proxy().node
    order = getattr(node, "_sort_key", None)
    fake = t.as_fake()  # the tensor's stand-in while tracing (a gradient hook makes a new graph node for it)
    _SIGHTINGS[ctx.get_local("owner").as_python_constant()].note(
        ctx.get_local("key").as_python_constant(), None, (id(fake), fake._version),
        order if isinstance(order, tuple) else None)


def _device_of(module: nn.Module) -> torch.device | None:
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return None
