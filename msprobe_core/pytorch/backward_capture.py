"""Each call's own input gradients, read from autograd's own graph nodes (backward records' ``output``).

A tensor hook on an input sees that tensor's total gradient, summed over every call that used it. What one
call sends to its input is the gradient on the graph edges that leave the call's part of the graph toward
that input, and autograd hands exactly those values to the post hooks of the nodes the edges start from:
``Node.register_hook(hook)`` calls ``hook(grad_inputs, grad_outputs)`` with ``grad_inputs[i]`` the gradient
sent along ``next_functions[i]``.

- At the call's start, ``InputEdges.of(tensors)`` notes where each input's gradient goes (its ``grad_fn``
  and output slot, or, for a leaf, the leaf itself: its edge ends in its ``AccumulateGrad``) and autograd's
  sequence number (each new node takes the next one, per thread).
- At its end, ``capture`` walks from the outputs' ``grad_fn`` through the nodes made during the call
  (sequence numbers between the two readings; nodes made before, the inputs' included, end the walk) and
  puts one post hook on each node with an edge to an input. A call that autograd decomposes into several
  nodes (``cross_entropy`` is ``log_softmax`` + ``nll_loss``, a module is many) thus reports the gradient
  on the edge that leaves it, not an inner node's.
- An input reached by several edges (used twice in the call) gets their sum, added in the order autograd
  runs the nodes; the sum is the tool's own tensor and changes nothing in the model. Edges whose node does
  not run in a backward pass (an output the loss does not use) count as nothing: what arrived is reported
  when autograd's graph task ends (``queue_callback``).
- An output that *is* an input (``nn.Dropout`` in eval mode returns its input) passes that input's whole
  gradient on: such an input is reported through a tensor hook on it, as the gradient of that output.

- The gradient of the call's one output (the backward record's ``input``) comes from the same post hook
  when that output's ``grad_fn`` is the call's one node with edges to its inputs (``InputEdges.output``):
  the node's ``grad_outputs`` are what the call receives, after every tensor hook on the output (a user's
  hook that changes the gradient included), where a tensor hook of the tool's own would see it before the
  hooks registered after it. One Python hook a call instead of two (its hook dict and partial less).

No node is inserted and every hook returns None, so losses and gradients are bit-identical with the tool on
(``register_full_backward_hook`` would insert identity nodes, which can reorder gradient sums). The hooks
hold no tensor of the graph (no reference cycle through autograd); their handles go to the caller, who
removes them when the step ends. Each hooked call leaves few objects for Python's garbage collector to
track until its backward pass: one ``_OwnGrads`` (a ``_NodeHook`` more per extra node), its dicts of
int tuples (untracked by the collector once it has seen them) and torch's hook dicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from msprobe_core.stats.kernel import KERNEL

ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # the node type of a leaf's gradient edge
_walk_fast = getattr(KERNEL, "walk", None)  # ``_walk`` in C (None: the kernel is not built or is off)
_OwnGradsC = getattr(KERNEL, "OwnGrads", None)  # ``usual_capture``'s
_sequence_nr = torch._C._autograd._get_sequence_nr
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_no_torch_function = torch._C.DisableTorchFunction
_add = torch._C._VariableFunctions.add  # the binding itself: never a wrapper the L1 dump patched in
_is_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled

Key = int
"""Where an input's gradient goes: the id of its ``grad_fn`` and its output slot + 1, or the id of the leaf and
0, as one int (``id << 32 | slot + 1``): dicts of ints are not tracked by Python's garbage collector."""

Indices = Union[int, tuple[int, ...]]
"""The input indices that are one tensor: an int, or a tuple when the call takes the tensor more than once."""

Report = Callable[[Any, int, torch.Tensor], None]
"""``report(context, input index, gradient)``: one input's own gradient, for the backward record's ``output``
(``context``: what the caller passed to ``capture``, one tuple per call instead of a partial)."""

BothReport = Callable[[Any, int, torch.Tensor, torch.Tensor], bool]
"""``report_both(context, input index, output's gradient, input's gradient)``: a call's two gradients at once;
False when it took neither (they then go to ``report_output`` and ``report`` one by one)."""


def _key(t: torch.Tensor) -> tuple[Key, Any]:
    """``t``'s gradient edge as a key, and the object whose id it holds (kept alive while the key is used)."""
    fn = t.grad_fn
    if fn is None:
        return id(t) << 32, t
    return id(fn) << 32 | t.output_nr + 1, fn


@dataclass(slots=True, eq=False)
class InputEdges:
    """A call's inputs that require grad, noted at its start: their edge keys and the sequence number.

    The L0 C hooks (``stats/_fast_l0.c``, ``FieldsNew``) make it and read its fields in their slots, in this
    order, while the class is a plain slots dataclass without ``__post_init__``; anything else makes them call the
    class and read its attributes."""

    begin: int
    slots: dict[Key, Indices]  # edge key -> the input indices that are that tensor
    alive: list                # the grad_fns and leaves the keys' ids stand for
    leaf: bool                 # a leaf is among them (else an edge to an ``AccumulateGrad`` leads to no input)
    output: Optional[torch.Tensor] = None  # the one output whose gradient ``capture`` delivers

    @classmethod
    def of(cls, tensors: list) -> Optional["InputEdges"]:
        """The edges of ``tensors`` (the call's tensor inputs, in record order); None if none requires grad."""
        slots: dict[Key, Indices] = {}  # ints only (the usual case): a dict the collector does not track
        alive = []
        leaf = False
        for i, t in enumerate(tensors):
            if t.requires_grad:
                key, obj = _key(t)
                indices = slots.get(key)
                if indices is None:
                    slots[key] = i
                    alive.append(obj)
                    leaf = leaf or obj is t
                else:
                    slots[key] = (indices if type(indices) is tuple else (indices,)) + (i,)
        return cls(_sequence_nr(), slots, alive, leaf) if slots else None


def capture(edges: InputEdges, outputs: list, report: Report, fail: Callable[[Any, BaseException], None],
            context: Any, keep: Callable[[Any], None], report_output: Optional[Report] = None,
            hook_output: Optional[Callable[[Any, torch.Tensor], None]] = None,
            hooks: Optional[dict] = None, report_both: Optional[BothReport] = None) -> None:
    """Hook the call's own nodes so that ``report`` gets each input's own gradient when backward runs;
    ``outputs`` are the call's output tensors, ``fail(context, exc)`` gets an exception raised in a hook (the
    user's backward goes on), ``keep`` receives each hook handle. With ``edges.output`` set, the gradient of
    that output goes to ``report_output(context, 0, grad)`` from the node that makes it, when that node is the
    call's one node with edges to its inputs; otherwise ``hook_output(context, output)`` hooks it as a tensor.
    ``hooks``: the hooks of single-edge calls, by what they hold (made once, not per call and step; one dict
    per set of callbacks);
    ``report_both``: a single-edge call's two gradients at once, where it takes them."""
    end = _sequence_nr()
    begin, slots = edges.begin, edges.slots
    out, edges.output = edges.output, None
    roots = []
    passed: dict[Key, torch.Tensor] = {}  # input edge -> the output that is that tensor
    for t in outputs:
        if not t.requires_grad:
            continue
        key, fn = _key(t)
        if key in slots:
            passed.setdefault(key, t)
        elif fn is not t and begin <= fn._sequence_nr() < end:
            roots.append(fn)
    hits, counts = _walk_fast(roots, slots, passed, begin, end, edges.leaf, ACCUMULATE_GRAD) \
        if _walk_fast is not None else _walk(roots, slots, passed, begin, end, edges.leaf)
    out_nr = -1
    if out is not None:
        if len(hits) == 1 and not passed and len(roots) == 1 and hits[0][0] is roots[0] and out.grad_fn is roots[0]:
            out_nr = out.output_nr
        else:  # another shape of graph: a tensor hook on the output, registered before the hooks below
            hook_output(context, out)
    if not hits and not passed:
        return
    if len(hits) == 1 and len(hits[0][1]) == 1 and not passed:
        node, ((key, edge_list),) = hits[0]
        if len(edge_list) == 1 and type(slots[key]) is int:  # one edge to one input: reported as it comes
            keep(node.register_hook(_single_edge(hooks, report, fail, context, slots[key], edge_list[0],
                                                 report_output, out_nr, report_both)))
            return
    state = _OwnGrads(slots, counts, report, fail, context)
    if len(hits) == 1:  # one node of the call sends to its inputs; the state is its hook
        node, state.node_hits = hits[0]
        if out_nr >= 0:
            state.report_output, state.out_nr = report_output, out_nr
        keep(node.register_hook(state))
    else:
        for node, node_hits in hits:
            keep(node.register_hook(_NodeHook(state, node_hits)))
    for key, t in passed.items():
        state.expected[key] = 1
        keep(t.register_hook(state.tensor_hook(key)))


def usual_capture(fallback: Callable[[Any, Any], None], report: Report, fail: Callable[[Any, BaseException], None],
                  report_output: Report, report_both: BothReport, keep: Callable[[Any], None],
                  hooks: dict, step_hooks: Any = None) -> Optional[Callable[[Any, Any], None]]:
    """``capture`` in C for the usual call of a module (``OwnGrads``: a ``Call`` whose one plain output is made by
    the call's one node with one edge to one input, that output's gradient read by that node), taking
    ``fallback(call, out)`` for any other; None without the kernel. ``call.edges`` are its ``InputEdges``, the
    context given to the callbacks ``(call.backward, call.save, call.backward_parent())``. ``step_hooks``: the
    ``StepHooks`` that ``keep`` fills, given a node hook's handle directly once it holds the step's first (no
    Python call per hook)."""
    if _OwnGradsC is None:
        return None
    return _OwnGradsC(fallback=fallback, sequence_nr=_sequence_nr, accumulate_grad=ACCUMULATE_GRAD, report=report,
                     fail=fail, report_output=report_output, report_both=report_both, keep=keep, hooks=hooks,
                     max_hooks=_MAX_HOOKS, step_hooks=step_hooks)


def _single_edge(hooks: Optional[dict], report: Report, fail: Callable, context: Any, index: int, edge: int,
                 report_output: Optional[Report], out_nr: int, report_both: Optional[BothReport]) -> "_SingleEdge":
    """The hook of a call whose one node sends one edge to one input: the one made for the same values
    before (``hooks``), or a new one."""
    key = (context, index, edge, out_nr)
    hook = hooks.get(key) if hooks is not None else None
    if hook is None:
        hook = _single_edge_type(report, fail, context, index, edge, report_output, out_nr, report_both)
        if hooks is not None:
            if len(hooks) >= _MAX_HOOKS:
                hooks.clear()
            hooks[key] = hook
    return hook


_MAX_HOOKS = 1 << 16
"""Single-edge hooks kept for reuse (a model's calls of a step, the same from step to step)."""


class _SingleEdge:
    """The post hook of a call's one node when it sends one edge to one input (most calls): the input's
    gradient, and the output's (``out_nr`` >= 0) that the node received. It holds no state of a backward
    pass, so the same object serves the same call in every step."""

    __slots__ = ("report", "fail", "context", "index", "edge", "report_output", "out_nr", "report_both")

    def __init__(self, report: Report, fail: Callable[[Any, BaseException], None], context: Any, index: int,
                 edge: int, report_output: Optional[Report], out_nr: int, report_both: Optional[BothReport]):
        self.report = report
        self.fail = fail
        self.context = context
        self.index = index
        self.edge = edge
        self.report_output = report_output
        self.out_nr = out_nr
        self.report_both = report_both if out_nr >= 0 else None

    def __call__(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        grad = grad_inputs[self.edge]
        if self.out_nr >= 0:
            received = grad_outputs[self.out_nr]
            if grad is not None and received is not None and self.report_both is not None:
                try:
                    if self.report_both(self.context, self.index, received, grad):
                        return
                except Exception as e:  # the tool never breaks the user's backward
                    self.fail(self.context, e)
                    return
            _report_output(self, received)
        if grad is not None:
            try:
                self.report(self.context, self.index, grad)
            except Exception as e:  # the tool never breaks the user's backward
                self.fail(self.context, e)


_single_edge_type: Any = getattr(KERNEL, "SingleEdge", None) or _SingleEdge
"""``_SingleEdge`` in C (the same fields and calls), or the Python class without the kernel."""


def _report_output(hook: Any, grad: Optional[torch.Tensor]) -> None:
    """The output's gradient a call's node received, to ``hook.report_output``."""
    if grad is not None:
        try:
            hook.report_output(hook.context, 0, grad)
        except Exception as e:  # the tool never breaks the user's backward
            hook.fail(hook.context, e)


def _walk(roots: list, slots: dict[Key, Indices], skip: dict, begin: int, end: int, leaf_inputs: bool):
    """The call's nodes with edges to its inputs (``[(node, ((key, edge indices), ...)), ...]``) and the
    number of such edges per input key; edges to a key in ``skip`` are left out (``leaf_inputs``: some input
    is a leaf)."""
    stack = list(dict.fromkeys(roots))  # outputs of one node (split, chunk) share it: walk it once
    seen = set(stack)
    hits = []
    counts: dict[Key, int] = {}
    while stack:
        node = stack.pop()
        found: Optional[dict[Key, list[int]]] = None
        for edge, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if type(nxt) is ACCUMULATE_GRAD:
                if not leaf_inputs:
                    continue
                key = id(nxt.variable) << 32
                if key not in slots:
                    continue
            else:
                key = id(nxt) << 32 | nr + 1
                if key not in slots:
                    if nxt not in seen and begin <= nxt._sequence_nr() < end:
                        seen.add(nxt)
                        stack.append(nxt)
                    continue
            if key in skip:
                continue
            if found is None:
                found = {}
            found.setdefault(key, []).append(edge)
            counts[key] = counts.get(key, 0) + 1
        if found is not None:
            hits.append((node, tuple([(k, tuple(e)) for k, e in found.items()])))
    return hits, counts


class _OwnGrads:
    """One call's input gradients as its nodes send them during a backward pass."""

    __slots__ = ("slots", "expected", "report", "fail", "context", "partial", "queued", "node_hits", "report_output",
                 "out_nr")

    def __init__(self, slots: dict[Key, Indices], expected: dict[Key, int], report: Report,
                 fail: Callable[[Any, BaseException], None], context: Any):
        self.slots = slots
        self.expected = expected        # edge key -> how many of the call's edges lead there
        self.report = report
        self.fail = fail
        self.context = context
        self.partial: dict[Key, list] = {}  # key -> [edges arrived, their sum] in the running backward pass
        self.queued = False
        self.node_hits: tuple = ()      # the hits of the one node that has the state itself as its hook
        self.report_output: Optional[Report] = None
        self.out_nr = -1                # that node's output slot whose gradient goes to ``report_output``

    def __call__(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        """The post hook of the call's one node with edges to its inputs (no closure made per call)."""
        if self.out_nr >= 0:
            _report_output(self, grad_outputs[self.out_nr])
        self._node_done(self.node_hits, grad_inputs)

    def _node_done(self, node_hits: tuple, grad_inputs: tuple) -> None:
        try:
            for key, edge_list in node_hits:
                self._arrive(key, [grad_inputs[e] for e in edge_list])
        except Exception as e:  # the tool never breaks the user's backward
            self.fail(self.context, e)

    def tensor_hook(self, key: Key) -> Callable:
        def hook(grad):
            try:
                self._arrive(key, [grad])
            except Exception as e:
                self.fail(self.context, e)
            return None
        return hook

    def _arrive(self, key: Key, grads: list) -> None:
        expected = self.expected[key]
        if len(grads) == expected:  # every edge of this input starts at this node (the usual case)
            self._emit(key, _sum(grads, None))
            return
        got = self.partial.get(key)
        if got is None:
            got = self.partial[key] = [0, None]
            if not self.queued:
                self.queued = True
                _queue_callback(self._flush)
        got[0] += len(grads)
        got[1] = _sum(grads, got[1])
        if got[0] >= expected:
            del self.partial[key]
            self._emit(key, got[1])

    def _flush(self) -> None:
        """End of the backward pass: report what arrived for inputs whose other edges did not run."""
        self.queued = False
        partial, self.partial = self.partial, {}
        try:
            for key, (_, total) in partial.items():
                self._emit(key, total)
        except Exception as e:
            self.fail(self.context, e)

    def _emit(self, key: Key, grad: Optional[torch.Tensor]) -> None:
        if grad is not None:
            indices = self.slots[key]
            if type(indices) is int:
                self.report(self.context, indices, grad)
                return
            for index in indices:
                self.report(self.context, index, grad)


class _NodeHook:
    """The post hook of one more node of a call with several nodes sending to its inputs (one object, no
    closure and cells per node)."""

    __slots__ = ("state", "node_hits")

    def __init__(self, state: _OwnGrads, node_hits: tuple):
        self.state = state
        self.node_hits = node_hits

    def __call__(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self.state._node_done(self.node_hits, grad_inputs)


def _sum(grads: list, total: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``total`` plus the defined gradients of ``grads``, left to right (the tool's own tensor)."""
    for g in grads:
        if g is None:
            continue
        if total is None:
            total = g
            continue
        prev = _is_grad_enabled()
        with _no_torch_function():
            if prev:
                _set_grad_enabled(False)
            try:
                total = _add(total, g)
            finally:
                if prev:
                    _set_grad_enabled(True)
    return total
