"""The L1 dump's fast route for the usual API call: autograd off (an optimizer's in-place updates, anything
under ``torch.no_grad()``), its record kept as JSON text, with the least Python work per call.

Whether the route exists at all is decided once, when the patch plan is built (``FastApi.usable``): the
record text made in C (``SummarizerBase.record_text``: statistics or structure without checksums, the kernel
built and not turned off), no tensor file, no overflow check, no scope or list filter, inputs and outputs
both kept. Per API, the record's ``{prefix}.{api}`` key is made once; collectives (``Distributed``, whose
record shows what they wrote) and the APIs whose output only rearranges their input (``same_values``, whose
statistics are shared) keep the usual route.

A call takes the route when it is recorded; its record is then exactly what ``CallRecords.on_api_call``
writes (the same text, stack, parent and journal frame). With autograd on, the C route also sets up its
backward record as ``on_api_call`` does (sizes, output gradient hooks, the call's own nodes hooked; its
gradients by the C ``ApiGrad``: ``stats/_fast_gradapi.c``); without ``ApiGrad``, and in the Python route, such
calls go through ``on_api_call``. Anything else (Dynamo tracing, an argument or output the C text does not
read, an error) goes through ``on_api_call`` as before.

Each API of the route gets, when the plan is built, one call object holding what its calls need (``call``):
the compiled ``ApiCall`` (``stats/_fast_api.c``: gates, inputs' text, name, stack, parent, the original, the
output's text and the journal frame in one C call), or, without it in the extension, the same steps in Python
(``_python_call``); the two write the same bytes. The function standing for the API stays a Python function,
which sends a call Dynamo traces to the usual wrapper, so torch.compile sees what it saw before."""

from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch.utils.hooks import RemovableHandle

from msprobe_core.dump.api_wrap import next_call
from msprobe_core.dump.call import Call
from msprobe_core.dump.call_records import backward_fields
from msprobe_core.files.step_recorder import NO_PARENT
from msprobe_core.pytorch.backward_capture import ACCUMULATE_GRAD, InputEdges, capture, usual_capture
from msprobe_core.pytorch.summarize import tensors_in
from msprobe_core.stats.kernel import KERNEL


_graph_task_id = torch._C._current_graph_task_id
_is_grad_enabled = torch._C.is_grad_enabled
_no_torch_function = torch._C.DisableTorchFunction  # the tool's own tensor reads skip every TorchFunctionMode
_dynamo_compiling = torch.compiler.is_dynamo_compiling  # (folded to a constant True while Dynamo traces)
_compiler = torch.compiler  # its ``_is_compiling_flag``: True while export traces
_thread_id = threading.get_ident
# the torch function mode stack, as ``api_patch.ApiPatcher.call`` reads it
_stack_len = torch._C._len_torch_function_stack
_stack_pop = torch._C._pop_torch_function_stack
_stack_push = torch._C._push_on_torch_function_stack
_ApiCall = getattr(KERNEL, "ApiCall", None)
"""The route's call in C (``stats/_fast_api.c``); None without the extension (the same steps in Python)."""
_ApiGrad = getattr(KERNEL, "ApiGrad", None)
"""A backward record's gradient in C (``stats/_fast_gradapi.c``); None: calls with autograd on take ``on_api_call``."""
_sequence_nr = torch._C._autograd._get_sequence_nr


class FastApi:
    """Makes the wrappers of the fast route for one dump service (``wrapper``), when it can have one."""

    def __init__(self, service: Any):  # the PyTorch DumpService (it imports this module)
        self.service = service
        records = service.records
        self.usable = (records._fast_text is not None and records._as_text and not records._saves
                       and not records._tensor_list and not records._filters and records._keep_in
                       and records._keep_out)
        """Can any call take the route under this configuration (decided once)?"""
        self._env: Optional[tuple] = None  # what the C calls read (``_c_env``), built with the first one

    def wants(self, prefix: str, api: str) -> bool:
        """Does ``{prefix}.{api}`` take the route (its record needs nothing the usual route alone does)?"""
        return self.usable and prefix != "Distributed" and api not in self.service.same_values

    def wrapper(self, original: Callable, prefix: str, api: str, plain: Callable) -> Callable:
        """The function standing for ``original`` while patched: ``plain`` (the usual wrapper) while Dynamo
        traces, otherwise the route's call (``call``), which records a call with autograd off itself."""
        call = self.call(original, prefix, api)

        def api_call(*args: Any, **kwargs: Any) -> Any:
            # Dynamo traces what it traced before (the usual wrapper), never the C call: ``is_compiling()`` without
            # its ``torch.jit.is_scripting()`` call (one Python call fewer before every call of the route)
            if _dynamo_compiling() or _compiler._is_compiling_flag:
                return plain(*args, **kwargs)
            return call(args, kwargs)

        return api_call

    def call(self, original: Callable, prefix: str, api: str) -> Callable[[tuple, dict], Any]:
        """``original``'s call on the route, (args, kwargs) -> its result: the compiled ``ApiCall`` where the
        extension has it, the same steps in Python (``_python_call``) otherwise."""
        if _ApiCall is None:
            return self._python_call(original, prefix, api)
        if self._env is None:
            self._env = self._c_env()
        return _ApiCall(original, (f"{prefix}.{api}", prefix, api), self._env)

    def _c_env(self) -> tuple:
        """What every ``ApiCall`` reads, in ``_fast_api.c``'s ENV_* order."""
        svc = self.service
        records = svc.records
        guard = _no_torch_function()  # one guard for every call: only the dumping thread enters it, never nested
        return (svc, svc._tls, records, records._fast_text, svc.patcher, self._capture(), svc.stacks.interned,
                records._construct, NO_PARENT, svc._on_api_call, partial(_end_as_dict, svc), _graph_task_id,
                _is_grad_enabled, guard.__enter__, guard.__exit__, _stack_len, _stack_pop, _stack_push,
                self._grad_env(guard), _plain_vars(svc, ("_recording", "dumping_thread", "recorder")),
                _plain_vars(records, ("step_state",)), _plain_vars(svc.patcher, ("_mode",)))

    def _grad_env(self, guard: Any) -> Optional[tuple]:
        """What a call with autograd on reads in C (``_fast_gradapi.c``'s G_* order: ``on_api_call``'s
        ``_begin_record``, ``_hook_outputs`` and ``_hook_own_grads``, their gradients by ``ApiGrad``); None
        without ``ApiGrad`` (``on_api_call`` takes those calls)."""
        if _ApiGrad is None:
            return None
        svc = self.service
        records = svc.records

        def report(field: str) -> Callable:
            return _ApiGrad(records=records, service=svc, text=records._fast_text, field=field,
                            fields=backward_fields, construct=records._construct, no_parent=NO_PARENT,
                            grad_enabled=_is_grad_enabled, tls=svc._tls, tf_off=guard.__enter__,
                            tf_on=guard.__exit__)

        report_in, report_out = report("input"), report("output")
        hooks: dict = {}  # the hooks of calls with one edge to one input, reused step after step
        own = usual_capture(capture, report_out, svc._on_own_grad_error, report_in, report_in, svc._keep_hook, hooks)
        return (bool(records.selection.backward), records.selection.keeps("backward", "output"),
                records._keep_grad_in, records._tensors_in, InputEdges, report_in, report_out, partial,
                svc._hook_tensor_grad, capture, svc._on_own_grad_error, svc._keep_hook, hooks, own, _sequence_nr,
                ACCUMULATE_GRAD, torch.Tensor, svc._keep_keys, RemovableHandle, OrderedDict,
                records._tensors_in is tensors_in)

    def _capture(self) -> Optional[Callable[[], Any]]:
        """The caller's stack (frames of the toolkit left out), without a method call on the way; None
        without stacks."""
        svc = self.service
        return partial(svc.stacks.capture, 1) if svc.cfg.extra_info else None

    def _python_call(self, original: Callable, prefix: str, api: str) -> Callable[[tuple, dict], Any]:
        """``ApiCall`` in Python: the route where the extension does not have it (``_fast_api.c`` says why
        each step is there)."""
        svc = self.service
        records = svc.records
        tls = svc._tls
        patcher = svc.patcher
        on_api_call = svc._on_api_call
        inputs = records._fast_text.inputs
        text_of = records._fast_text.record
        capture = self._capture()
        construct = records._construct
        key = f"{prefix}.{api}"

        def api_call(args: tuple, kwargs: dict) -> Any:
            if not svc._recording or tls.depth or _graph_task_id() != -1:
                return original(*args, **kwargs)
            if svc.dumping_thread != _thread_id():
                svc._other_thread()
                return original(*args, **kwargs)
            if _is_grad_enabled():
                return on_api_call(original, prefix, api, args, kwargs)
            tls.depth += 1  # the tool's own work, as in ``on_api_call``
            try:
                with _no_torch_function():
                    head = inputs(args, kwargs)
            except Exception:  # the usual route says what went wrong
                head = None
            except BaseException:
                tls.depth -= 1
                raise
            if head is None:  # an argument the C text does not read: the usual record, from its start
                tls.depth -= 1
                return on_api_call(original, prefix, api, args, kwargs)
            try:
                state = records.step_state
                n, name = next_call(state.counters, key)
                try:
                    rec = svc.recorder or svc._open_step()
                    stack = capture() if capture is not None else None
                    parent = (state.module_stack[-1] if state.module_stack else None) if construct else NO_PARENT
                except Exception as e:  # the tool must never break the user's call
                    svc._error(name, e)
                    head = None
                try:
                    out = patcher.call(original, args, kwargs)
                except BaseException:  # what the usual route leaves of a call that raised: its place and stack
                    if head is not None:
                        try:
                            rec.reserve(name, stack)
                        except Exception as e:
                            svc._error(name, e)
                    raise
                if head is not None:
                    try:
                        with _no_torch_function():
                            text = text_of(head, out)
                        if text is not None:  # nothing was recorded during the call: its place is taken now
                            rec.put_text(name, text, None, stack, parent)
                        else:  # an output the C text does not read: the usual end makes it a dict
                            _end_as_dict(svc, key, name, n, head, rec, stack, parent, out)
                    except Exception as e:
                        svc._error(name, e)
                return out
            finally:
                tls.depth -= 1

        return api_call


def _plain_vars(obj: Any, names: tuple) -> Optional[dict]:
    """``obj``'s instance dict, where the C call reads these attributes of ``obj`` (a dict lookup instead of
    getattr), or None (getattr) when ``obj`` has none or its class makes any of them a data descriptor (a
    property, a slot: the instance dict is then not what getattr reads)."""
    try:
        found = vars(obj)
    except TypeError:
        return None
    cls = type(obj)
    if any(inspect.isdatadescriptor(inspect.getattr_static(cls, name, None)) for name in names):
        return None
    return found


def _end_as_dict(svc: Any, key: str, name: str, n: int, head: str, rec: Any, stack: Any, parent: Any,
                 out: Any, edges: Any = None, grad: bool = False) -> None:
    """The end of a call on the route whose output the C text does not read: the usual end makes the record a
    dict (its place in execution order taken now: nothing was recorded during the call); ``grad``: autograd
    recorded it and its backward is dumped (``edges``: its inputs' gradient edges, as ``_begin_record`` left them)."""
    call = Call(name, f"{key}.{n}.backward", rec.reserve(name, stack), head, False,
                None if parent is NO_PARENT else parent, grad)
    call.stack = stack
    call.edges = edges
    svc._end(call, out)


def fast_wrapper_maker(service: Any) -> Optional[Callable[[Callable, str, str, Callable], Optional[Callable]]]:
    """``ApiPatcher``'s ``fast``: (original, prefix, api, plain wrapper) -> the fast route's wrapper, or None where
    that API keeps the usual one; None when no call can take the route."""
    fast = FastApi(service)
    if not fast.usable:
        return None
    return lambda original, prefix, api, plain: fast.wrapper(original, prefix, api, plain) \
        if fast.wants(prefix, api) else None
