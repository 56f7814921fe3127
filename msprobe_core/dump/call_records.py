"""The records of the calls a dump looks at: ``CallRecords``, the part of a dump service
(``dump.service.DumpServiceBase``) that turns a wrapped API call (L1) or a module call (L0) into its records.

The begin and end of a record (forward inputs, outputs, construct.json parents, stack.json), overflow_check
on inputs and outputs (a call is kept only if it holds Inf/NaN, within ``overflow_nums``), backward records
from gradient hooks, module pre/post hooks and parameter gradients. The step's files, the recording gates
and the framework's tensors are its service's (given to its constructor)."""

from __future__ import annotations

import json
import threading
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from msprobe_core.common.tool_guard import TOOL
from msprobe_core.dump.api_wrap import next_call
from msprobe_core.dump.call import Call
from msprobe_core.dump.step_state import StepState
from msprobe_core.files.step_recorder import NO_PARENT, TextFields
from msprobe_core.log import setup_logging

if TYPE_CHECKING:
    from msprobe_core.dump.backend import DumpBackend
    from msprobe_core.dump.config import DumpConfig
    from msprobe_core.dump.host import DumpHost
    from msprobe_core.dump.selection import RecordSelection

logger = setup_logging()

_thread_id = threading.get_ident
SKIPPED = object()  # a module call the tool did not look at (not recording, or nested in a recorded API)
_RAW_INPUTS = "#inputs"   # overflow_check: a call's inputs, summarized once the call is known to overflow
_INPUT_FLAGS = "#flags"   # overflow_check: whether each input held Inf/NaN when the call started


_NO_SIZES = (0, 0)


def backward_fields(sizes: Optional[tuple[int, int]]) -> TextFields:
    """``_backward_skeleton`` for gradients given as text: complete once each of its slots is set (never
    without ``sizes``)."""
    return TextFields(_backward_skeleton(sizes), sum(sizes) if sizes is not None else -1)


def _param_fields(count: int) -> TextFields:
    """A ``parameters_grad`` record for gradients given as text: complete with ``count`` parameters'."""
    return TextFields({}, count)


def _backward_skeleton(sizes: Optional[tuple[int, int]]) -> dict[str, list]:
    """A backward record before its gradients: ``sizes`` (its forward's output and input tensors) slots each."""
    n_in, n_out = sizes if sizes is not None else (0, 0)
    return {"input": [None] * n_in, "output": [None] * n_out}


class CallRecords:
    """The records of API and module calls of one dump service (``DumpServiceBase.records``).

    It owns what only the recording needs: the open step's bookkeeping (``step_state``, replaced by
    ``new_step``), the overflow count and the module hooks made once per process. Everything else it is
    given at construction and binds once (the hot path reads its own attributes, never a chain): the
    service (``dump.host.DumpHost``: configuration, selection, summarizer, opening the step's recorder,
    journal sync, own-work guard, error log, the recording gates) and the framework back-end
    (``dump.backend.DumpBackend``: tensors, gradients, stacks). What it reads of the service while running:
    ``recorder`` (the open step's dump.json) and ``dumping_thread``."""

    def __init__(self, service: DumpHost, backend: DumpBackend) -> None:
        self.service = service
        self.backend = backend
        self.cfg: DumpConfig = service.cfg
        self.selection: RecordSelection = service.selection
        self.summarizer: Any = service.summarizer
        self.patcher: Any = None  # the L1 API patcher (``DumpServiceBase.set_patcher``): runs a recorded original
        self.step_state = StepState()  # replaced, never cleared, when the step ends (``new_step``)
        self._tls = TOOL
        self._construct = service.uses_l0      # construct.json parents are kept (L0 / mix)
        self._uses_l0 = service.uses_l0
        self._saves = service.saves_tensors    # task tensor: every record's tensor files
        self._overflow_check = service.cfg.task == "overflow_check"
        self._overflows = 0  # overflow_check: calls kept so far (in the whole process)
        selection = service.selection
        # forward records kept as JSON text from their start (``_text_inputs``), decided once: the text of
        # each tensor's summary is made once per tensor version, and the record journaled whole at its end
        self._as_text = selection.forward and not self._overflow_check
        self._keep_in = selection.keeps("forward", "input")
        self._keep_out = selection.keeps("forward", "output")
        self._keep_grad_in = selection.keeps("backward", "input")
        # gradients as the JSON text of their summaries (host statistics, no file): one journal frame each
        self._grads_as_text = not self._overflow_check
        self._tensor_text = service.summarizer.tensor_text
        # L0: gradients' text without a cache entry each (no API record reads them again); L1/mix keep the
        # cache (an API's backward or the optimizer's calls read the same gradients)
        grad_text = getattr(service.summarizer, "grad_text", None)
        self._grad_text = grad_text.text if grad_text is not None and service.cfg.level == "L0" else None
        # L0's gradients in C hooks (``DumpBackend._param_grad_hook``, a call's two at once): text without cache
        self.grads_by_c = self._grad_text is not None and self._grads_as_text and self._construct
        self._filters = selection.filters            # scope / list: asked per call; otherwise every call is kept
        self._tensor_list = bool(service.cfg.tensor_list)
        self._fast_text = service.summarizer.record_text  # the compiled text maker, or None (``SummarizerBase``)
        # module hooks in C for the usual call (``DumpBackend._module_hooks``): a configuration whose forward
        # record is text made at once and journaled whole, its backward one taken by node
        self._fast_modules = self._fast_text is not None and self._as_text and self._keep_in and self._keep_out \
            and not self._saves and not self._tensor_list and not self._filters and self._construct \
            and (not selection.backward or (selection.keeps("backward", "output") and self._keep_grad_in))
        self._hook_fns: dict[tuple, Any] = {}  # the module hooks, made once (``_hook_fn``, ``_fast_hooks``)
        self._grad_hook = self.on_grad            # bound once: a gradient hook's partial holds no new object
        self.hooked_models: list[Any] = []
        # the service's methods
        self._open_step = service._open_step
        self._sync = service._sync
        self._own = service._own
        self._error = service._error
        self._other_thread = service._other_thread
        self.should_record = service.should_record
        self._may_record_exclusive = service._may_record_exclusive
        self._end = service._end
        # the framework back-end's
        self.same_values: frozenset = backend.same_values
        self._quiet = backend._quiet
        self._tensors_in = backend._tensors_in
        self._wants_grad = backend._wants_grad
        self._hook_tensor_grad = backend._hook_tensor_grad
        self._hook_param_grad = backend._hook_param_grad
        self._grads_by_node = backend._grads_by_node
        self._grad_by_node = backend._grad_by_node
        self._keep_forward_handles = backend._keep_forward_handles
        self._overflow_flag = backend._overflow_flag
        self._any_overflow = backend._any_overflow
        self._capture_stack = backend._capture_stack
        self._call_inputs = backend._call_inputs
        self._collective_result = backend._collective_result
        self._prepare_backward = backend._prepare_backward
        self._on_device = backend._on_device
        self._own_parameters = backend._own_parameters
        self._grad_parameters = backend._grad_parameters
        self._opaque = backend._opaque
        self._in_graph_hooks = backend._in_graph_hooks
        self._module_hooks = backend._module_hooks
        self._param_grad_hook = backend._param_grad_hook
        self._class_name = backend._class_name
        self._named_modules = backend._named_modules
        self._before_hooking = backend._before_hooking
        self._rehook = backend._rehook
        self._hooked = backend._hooked

    def new_step(self) -> None:
        """The step ended: its counters, open calls and modules are forgotten."""
        self.step_state = StepState()

    # ================================================================== L1 APIs
    def on_api_call(self, original: Callable, prefix: str, api: str, args: tuple, kwargs: dict):
        """A wrapped API called while recording (the patchers' handler): runs ``original`` and records the call
        as ``{prefix}.{api}.{n}.forward`` (and its backward); returns the original's result unchanged."""
        key = f"{prefix}.{api}"
        state = self.step_state
        n, name = next_call(state.counters, key)
        tls = self._tls
        tls.depth += 1
        try:
            call = None
            if not self._filters or self.selection.record(name):
                try:
                    parent = state.module_stack[-1] if (self._construct and state.module_stack) else None
                    with self._quiet() as grad_enabled:
                        call = self._begin_record(name, f"{key}.{n}.backward", args, kwargs, parent, None, grad_enabled)
                    args, kwargs = self._call_inputs(call, args, kwargs, api)
                except Exception as e:  # the tool must never break the user's call
                    self._error(name, e)
            patcher = self.patcher
            out = patcher.call(original, args, kwargs) if patcher is not None else original(*args, **kwargs)
            shown = self._collective_result(name, api, original, args, kwargs, out) if prefix == "Distributed" else out
            if call is not None:
                try:
                    self._end(call, shown, args[0] if api in self.same_values and args else None)
                except Exception as e:
                    self._error(name, e)
            if self._filters:
                self.selection.call_finished(name)
            return out
        finally:
            tls.depth -= 1

    # ================================================================== shared record logic
    def begin(self, name: str, backward: str, args: tuple, kwargs: dict, parent: Optional[str],
              parameters: Optional[Sequence[tuple[str, Any]]] = None) -> Call:
        """Start ``call``'s record with its inputs (and a module's ``parameters``)."""
        with self._quiet() as grad_enabled:
            return self._begin_record(name, backward, args, kwargs, parent, parameters, grad_enabled)

    def _begin_record(self, name, backward, args, kwargs, parent, parameters, grad_enabled) -> Call:
        rec = self.service.recorder or self._open_step()
        overflow = self._overflow_check
        seq = -1 if overflow else rec.reserve(name)
        save = overflow or self._saves or (self._tensor_list and self.selection.saves_tensor(name))
        if overflow:  # the inputs are checked now, summarized (and saved) at the end only if the call overflows
            record = {_RAW_INPUTS: (args, kwargs, parameters),
                      _INPUT_FLAGS: [self._overflow_flag(t) for t in self._tensors_in((args, kwargs, parameters))]}
        else:
            record = (self._text_inputs(args, kwargs, parameters) if self._as_text and not save else None) \
                or self._input_record(name, args, kwargs, parameters, save)
        call = Call(name, backward, seq, record, save, parent, self.selection.backward and grad_enabled)
        if call.grad:
            tensors = self._tensors_in((args, kwargs))
            sizes = self.step_state.bwd_sizes
            sizes[backward] = (sizes.get(backward, _NO_SIZES)[0], len(tensors))
            if self.selection.keeps("backward", "output"):
                self._prepare_backward(call, tensors)
        if not overflow and self.cfg.extra_info:
            if type(record) is str:  # journaled with the record at its end; its place in stack.json kept now
                call.stack = rec.stack[name] = self._capture_stack()
            else:
                rec.put_stack(name, self._capture_stack())
        return call

    def _text_inputs(self, args: tuple, kwargs: dict, parameters: Any) -> Optional[str]:
        """The forward record's JSON text up to its ``output``, when every tensor's summary is known at once
        (``SummarizerBase.text``: host statistics); None otherwise (``_input_record`` makes it as a dict)."""
        if not self._keep_in:
            return '{"input_args": [], "input_kwargs": {}' + (', "parameters": {}' if parameters is not None else "")
        fast = self._fast_text
        if fast is not None:
            head = fast.inputs(args, kwargs)
            if parameters is None or head is None:
                return head
            p = fast.text(dict(parameters))
            return None if p is None else f'{head}, "parameters": {p}'
        text = self.summarizer.text
        a = text(args)
        k = text(kwargs) if kwargs else "{}"
        if a is None or k is None:
            return None
        if parameters is None:
            return f'{{"input_args": {a}, "input_kwargs": {k}'
        p = text(dict(parameters))
        return None if p is None else f'{{"input_args": {a}, "input_kwargs": {k}, "parameters": {p}'

    def _input_record(self, name: str, args: tuple, kwargs: dict, parameters: Any, save: bool) -> dict[str, Any]:
        """The forward record's ``input_args``, ``input_kwargs`` (and a module's ``parameters``)."""
        keep_in = self.selection.forward and self.selection.keeps("forward", "input")
        summarize = self.summarizer.summarize
        record: dict[str, Any] = {
            "input_args": summarize(list(args), f"{name}.input", save) if keep_in else [],
            "input_kwargs": summarize(kwargs, f"{name}.input", save) if keep_in else {},
        }
        if parameters is not None:
            record["parameters"] = {p: summarize(t, f"{name}.parameters.{p}" if save else None, save)
                                    for p, t in parameters} if keep_in else {}
        return record

    def end_record(self, call: Call, out: Any, grad_enabled: bool) -> None:
        """Finish ``call``'s record with its output (inside the back-end's ``_quiet()``; ``grad_enabled``:
        autograd recorded the call, so its backward record gets gradient hooks)."""
        rec = self.service.recorder or self._open_step()
        if type(call.record) is str and self._text_record(rec, call, out):
            if self.selection.backward and grad_enabled:
                self._hook_outputs(call, self._tensors_in(out))
            return
        outputs = list(out) if isinstance(out, (list, tuple)) else [out]
        keep_out = self.selection.forward and self.selection.keeps("forward", "output")
        if self._overflow_check:
            if not self._overflowed(call.record[_INPUT_FLAGS], outputs):
                return
            call.seq = rec.reserve(call.name)
            call.record = self._input_record(call.name, *call.record[_RAW_INPUTS], call.save)
            if self.cfg.extra_info:
                rec.put_stack(call.name, self._capture_stack())
        call.record["output"] = self.summarizer.summarize(outputs, f"{call.name}.output", call.save) if keep_out else []
        if self.selection.forward:
            rec.put(call.name, call.record, call.seq)
        if self._construct:
            rec.put_parent(call.name, call.parent)
        tensors = self._tensors_in(outputs)
        if self.selection.backward and grad_enabled:
            self._hook_outputs(call, tensors)
        self._sync(record_on_device=self._on_device(tensors))

    def _text_record(self, rec: Any, call: Call, out: Any) -> bool:
        """Finish a record kept as JSON text with the call's output ``out``: journaled now with its stack and
        parent, in one frame (nothing in it waits for statistics). False, with the record made a dict again,
        when an output's summary is not known at once (device statistics): the dict route finishes it."""
        fast = self._fast_text
        if not self._keep_out:
            text: Optional[str] = f'{call.record}, "output": []}}'
        elif fast is not None:
            text = fast.record(call.record, out)
        else:
            text = self.summarizer.text(list(out) if isinstance(out, (list, tuple)) else [out])
            text = None if text is None else f'{call.record}, "output": {text}}}'
        if text is None:
            call.record = json.loads(call.record + "}")
            if call.stack is not None:
                rec.put_stack(call.name, call.stack)
            return False
        rec.put_text(call.name, text, call.seq, call.stack, call.parent if self._construct else NO_PARENT)
        return True

    def _hook_outputs(self, call: Call, tensors: list) -> None:
        """The backward record's ``input``: a gradient hook on each output tensor."""
        sizes = self.step_state.bwd_sizes
        sizes[call.backward] = (len(tensors), sizes.get(call.backward, _NO_SIZES)[1])
        if self._keep_grad_in:
            if call.by_node and len(tensors) == 1 and self._grad_by_node(call, tensors[0]):
                return  # from the call's own node (its end hooks it)
            parent = call.backward_parent()
            for i, t in enumerate(tensors):
                if self._wants_grad(t):
                    self._hook_tensor_grad(t, partial(self._grad_hook, call.backward, "input", i, call.save, parent))

    def _overflowed(self, input_flags: list, outputs: list) -> bool:
        """Does the call hold Inf/NaN in an input (``input_flags``, taken when it started) or an output
        (within ``overflow_nums``)?"""
        if self.cfg.overflow_nums != -1 and self._overflows >= self.cfg.overflow_nums:
            return False
        flags = input_flags + [self._overflow_flag(t) for t in self._tensors_in(outputs)]
        if not flags or not self._any_overflow(flags):
            return False
        self._overflows += 1
        if self.cfg.overflow_nums != -1 and self._overflows >= self.cfg.overflow_nums:
            logger.warning("overflow_nums=%d reached; no further overflow is recorded", self.cfg.overflow_nums)
        return True

    def _skips_grad(self, grad: Any) -> bool:
        """overflow_check keeps only gradients holding Inf/NaN (callers test ``_overflow_check`` first)."""
        return not self._any_overflow([self._overflow_flag(grad)])

    def on_grad(self, backward: str, field: str, index: int, save: bool, parent: Optional[str], grad: Any) -> None:
        """A gradient hook: ``grad`` is slot ``index`` of the ``field`` of the backward record ``backward``."""
        rec = self.service.recorder
        if rec is None or grad is None:
            return None
        if self._grads_as_text and not save and self._put_grad_text(
                rec, backward, field, index, grad, backward_fields, self.step_state.bwd_sizes.get(backward),
                parent if self._construct else NO_PARENT, True):
            return None
        with self._own(backward), self._quiet():
            if self._overflow_check and self._skips_grad(grad):
                return None
            summary = self.summarizer.summarize(grad, f"{backward}.{field}.{index}" if save else None, save)
            sizes = self.step_state.bwd_sizes.get(backward)
            fresh = backward not in rec.data
            record = rec.put_field(backward, [field, index], summary, lambda: _backward_skeleton(sizes))
            if fresh and self._construct:
                rec.put_parent(backward, parent)
            if sizes is not None and None not in record["input"] and None not in record["output"] \
                    and len(record["input"]) == sizes[0] and len(record["output"]) == sizes[1]:
                rec.seal(backward)
            self._sync(record_on_device=self._on_device([grad]))
        return None

    def on_call_grads(self, backward: str, save: bool, parent: Optional[str], index: int, received: Any,
                      sent: Any) -> bool:
        """A call's backward record whole, from one hook: ``received``, the gradient of its one output (``input``),
        and ``sent``, the one it sends to its input ``index`` (``output``); journaled in one frame, complete. False,
        with nothing recorded, when the record takes its gradients one by one (``on_grad``): a call with more
        tensors, a record already begun (a second backward), tensor files, a summary not known at once."""
        rec = self.service.recorder
        if rec is None or save or not self._grads_as_text or index or backward in rec.data \
                or self.step_state.bwd_sizes.get(backward) != (1, 1):
            return False
        tls = self._tls
        tls.depth += 1  # the tool's own work, as ``_own``
        try:
            with self._quiet():
                fast = self._grad_text
                texts = [fast(received, False), fast(sent, True)] if fast is not None else [None, None]
                for i, grad in enumerate((received, sent)):
                    if texts[i] is None:
                        texts[i] = self._tensor_text(grad)
                        if texts[i] is None:
                            return False
                # seq None: its place in execution order taken now (``reserve`` and ``put_text`` in one call)
                rec.put_text(backward, f'{{"input": [{texts[0]}], "output": [{texts[1]}]}}', None, None,
                             parent if self._construct else NO_PARENT)
        finally:
            tls.depth -= 1
        return True

    def _put_grad_text(self, rec: Any, name: str, field: str, index: int, grad: Any,
                       fields: Callable[[Any], TextFields], arg: Any, parent: Any = NO_PARENT,
                       passed_on: bool = False) -> bool:
        """Set a gradient of the record ``name`` as its summary's text, known at once (host statistics): the
        fast route of ``on_grad`` and ``_on_param_grad`` (``StepRecorder.put_text_field``). False when the
        summary is not known at once: the caller summarizes it as a dict. ``passed_on``: the gradient goes
        on to another call's node, whose hook may read it next (its text is kept until the next gradient)."""
        tls = self._tls
        tls.depth += 1  # the tool's own work, as ``_own`` (without an object per gradient)
        try:
            with self._quiet():
                fast = self._grad_text
                text = fast(grad, passed_on) if fast is not None else None
                if text is None:
                    text = self._tensor_text(grad)
                    if text is None:
                        return False
                if rec.put_text_field(name, field, index, text, fields, arg, parent):
                    self._sync()
        except Exception as e:  # the tool must never break the user's backward
            self._error(name, e)
        finally:
            tls.depth -= 1
        return True

    # ================================================================== L0 modules
    def install_model_hooks(self, models: list, indexed: bool) -> None:
        """Hook every module of ``models`` (L0; level L1 only shows them to ``_before_hooking`` when the
        back-end ``hooks_l1_models``), once until stop() (``forget_models``). A model hooked at an earlier
        start() and unchanged gets the same hooks back (``_rehook``)."""
        backend = self.backend
        for idx, root in enumerate(models if self._uses_l0 or backend.hooks_l1_models else ()):
            prefix = f"{idx}." if indexed else ""
            if self._uses_l0 and self._rehook(root, prefix):
                continue
            named = list(self._named_modules(root))
            self._before_hooking([module for _, module in named])
            if not self._uses_l0:
                continue
            for path, module in named:
                if path and module is not root:  # a wrapped root (FSDP1, compile) is named "" as well
                    self.hook_module(module, f"{backend.module_prefix}.{prefix}{path}.{self._class_name(module)}")
            self._hooked(root, [module for _, module in named])
        self.hooked_models.extend(models)

    def hooked(self, models: list) -> bool:
        """Are some of ``models`` hooked already (since the last ``forget_models``)?"""
        return any(m in self.hooked_models for m in models)

    def forget_models(self) -> None:
        """stop() removed the module hooks: the next start() hooks its models again."""
        self.hooked_models.clear()

    def hook_module(self, module: Any, base: str, exclusive: bool = False) -> list[Any]:
        """Record ``module``'s forward, backward and parameter gradients under ``base``; returns the
        forward hook handles (also removed by stop())."""
        traced = None if exclusive else self._in_graph_hooks(module, base)
        by_node = traced is None and not exclusive and self._grads_by_node(module)
        if traced is not None:  # a compiled model: hooks its compiler traces (they replay into the two below)
            pre, post = traced
        else:
            pre = self._opaque(self._hook_fn(self._module_pre, base, exclusive, by_node))
            post = self._opaque(self._hook_fn(self._module_post, base))
            if by_node and self._fast_modules:
                pre, post = self._fast_hooks(base, pre, post)
        handles = [module.register_forward_pre_hook(pre, with_kwargs=True),
                   module.register_forward_hook(post, with_kwargs=True)]
        self._keep_forward_handles(handles)
        if self.selection.backward:
            params = self._grad_parameters(module)
            for pname, p in params:
                hook = self._hook_fn(self._on_param_grad, base, pname, len(params))
                if self._fast_modules and by_node and self.grads_by_c:
                    hook = self._fast_param_hook(base, pname, len(params), hook)
                self._hook_param_grad(p, hook)
        return handles

    def _hook_fn(self, method: Callable, *args: Any) -> Callable:
        """``partial(method, *args)``, made once per process: the module hooks installed at every start()
        then make no new objects step after step (objects that live until the backward would be promoted to
        the garbage collector's oldest generation and make its full collections frequent)."""
        key = (method, *args)
        fn = self._hook_fns.get(key)
        if fn is None:
            fn = self._hook_fns[key] = partial(method, *args)
        return fn

    def _fast_hooks(self, base: str, pre: Callable, post: Callable) -> tuple[Callable, Callable]:
        """The back-end's faster hooks for ``pre`` and ``post`` (``_module_hooks``), made once per process as
        ``_hook_fn``'s; ``pre`` and ``post`` themselves where it has none."""
        key = (self._fast_hooks, base)
        hooks = self._hook_fns.get(key)
        if hooks is None:
            hooks = self._hook_fns[key] = self._module_hooks(base, pre, post) or (pre, post)
        return hooks

    def _fast_param_hook(self, base: str, pname: str, count: int, hook: Callable) -> Callable:
        """The back-end's faster ``hook`` of a parameter's gradient (``_param_grad_hook``), made once per process."""
        key = (self._fast_param_hook, base, pname, count)
        fast = self._hook_fns.get(key)
        if fast is None:
            fast = self._hook_fns[key] = self._param_grad_hook(base, pname, count, hook, _param_fields)
        return fast

    def _module_pre(self, base: str, exclusive: bool, by_node: bool, module: Any, args: tuple, kwargs: dict):
        if _thread_id() != self.service.dumping_thread:  # another thread's call: neither recorded nor in the stacks
            self._other_thread()
            return None
        allowed = self._may_record_exclusive() if exclusive else self.should_record()
        state = self.step_state
        calls = state.module_calls.get(id(module))
        if calls is None:
            calls = state.module_calls[id(module)] = []
        if not allowed:
            calls.append(SKIPPED)
            return None
        calls.append(SKIPPED)  # replaced below once the call is set up
        new_args = new_kwargs = None
        tls = self._tls
        tls.depth += 1  # the tool's own work, as ``_own`` (without an object per call)
        try:
            n = state.counters.get(base, 0)
            state.counters[base] = n + 1
            name = f"{base}.forward.{n}"
            call = None
            if not self._filters or self.selection.record(name):
                parent = state.module_stack[-1] if state.module_stack else None
                call = self.begin(name, f"{base}.backward.{n}", args, kwargs, parent, self._own_parameters(module))
                call.by_node = by_node
                state.recorded_modules.add(base)
                new_args, new_kwargs = self._call_inputs(call, args, kwargs, "")
            calls[-1] = call
            state.module_stack.append(name)
        except Exception as e:  # the tool must never break the user's call
            self._error(base, e)
        finally:
            tls.depth -= 1
        if new_args is not None and (new_args is not args or new_kwargs is not kwargs):
            return new_args, new_kwargs  # the module runs on what _call_inputs gave
        return None

    def _module_post(self, base: str, module: Any, args: tuple, kwargs: dict, output: Any):
        if _thread_id() != self.service.dumping_thread:
            return None
        module_calls = self.step_state.module_calls
        calls = module_calls.get(id(module))
        if not calls:
            return None
        call = calls.pop()
        if not calls:  # no list left for the collector to track until the step ends (one per module)
            del module_calls[id(module)]
        if call is SKIPPED:
            return None
        tls = self._tls
        tls.depth += 1
        try:
            if self.step_state.module_stack:
                self.step_state.module_stack.pop()
            if call is not None:
                self._end(call, output)
                if self._filters:
                    self.selection.call_finished(call.name)
        except Exception as e:
            self._error(base, e)
        finally:
            tls.depth -= 1
        return None

    def _on_param_grad(self, base: str, pname: str, count: int, grad: Any) -> None:
        rec = self.service.recorder
        if rec is None or grad is None or base not in self.step_state.recorded_modules:
            return None
        counters = self.step_state.counters
        key = f"{base}#{pname}"
        k = counters.get(key, 0)
        counters[key] = k + 1
        name = f"{base}.parameters_grad.{k}"
        save = self._saves or self.selection.saves_tensor(name)
        # each of the module's parameters' gradients: one slot of the record
        if self._grads_as_text and not save and self._put_grad_text(rec, name, pname, 0, grad, _param_fields, count):
            return None
        self._param_grad_dict(rec, base, name, pname, count, grad, save)
        return None

    def _param_grad_dict(self, rec: Any, base: str, name: str, pname: str, count: int, grad: Any,
                         save: bool = False) -> None:
        """Parameter ``pname``'s gradient in the record ``name`` as its summary's dict (saved, checked for
        overflow, or a summary not known at once)."""
        with self._own(base), self._quiet():
            if self._overflow_check and self._skips_grad(grad):
                return
            summary = self.summarizer.summarize(grad, f"{name}.{pname}" if save else None, save)
            if len(rec.put_field(name, [pname, 0], summary, dict)) == count:  # each of the module's parameters'
                rec.seal(name)
            self._sync(record_on_device=self._on_device([grad]))
