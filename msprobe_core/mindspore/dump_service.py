"""The MindSpore dump service (native MindSpore and MSAdapter's mindtorch): Cell/Module hooks, API wrappers,
record naming and the step life cycle behind ``msprobe_core.mindspore.PrecisionDebugger``.

The core does the rest, shared with PyTorch: the config (``dump.config``), record selection
(``dump.selection``), the step journal and JSON files (``files.step_recorder``, crash-safe), call stacks
(``files.call_stack``), rank folder naming and "never overwrite" (``common.rank_folder``), the tool guard and
patch handles (``common``).

Records (msprobe's MindSpore and MSAdapter names):

- L0: ``Cell.{path}.{Class}.forward.{n}`` (native) or ``Module.{path}.{Class}.forward.{n}`` (mindtorch),
  with ``.backward.{n}`` and ``.parameters_grad.{k}``;
- L1: ``{Prefix}.{api}.{n}.forward`` / ``.backward`` (``Mint``, ``MintFunctional``, ``Functional``,
  ``Tensor``, ``Distributed``; mindtorch: ``Functional``, ``Tensor``, ``Torch``), and
  ``Primitive.{attribute}.{Class}.{n}.forward`` for the ``ops.Primitive`` instances of the model's cells.

Gradients are captured with MindSpore's tensor hooks (``Tensor.register_hook``'s registration), which
return nothing, for the calls recorded while ``value_and_grad`` / ``grad`` records the forward pass:
backward ``input`` holds the gradients of a call's outputs; backward ``output`` the gradient the call
itself sends to each tensor input (its share, when other calls use the input too, as PyTorch's dump
reports it), read on a view of the input made for that call (``_hook_inputs``); ``parameters_grad`` the
parameters' gradients. The tool's own work only reads tensors and never feeds autograd, so losses and
gradients are bit-identical with the dump on (tested).
"""

from __future__ import annotations

import atexit
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from msprobe_core.common.rank_folder import check_not_taken, rank_folder_name
from msprobe_core.common.tool_guard import TOOL
from msprobe_core.dump.config import DumpConfig, validate_token_range
from msprobe_core.dump.selection import Selection
from msprobe_core.errors import ConfigError, DumpStateError
from msprobe_core.files.call_stack import StackCapture
from msprobe_core.files.step_recorder import StepRecorder
from msprobe_core.log import setup_logging
from msprobe_core.mindspore import tensor_stats
from msprobe_core.mindspore.api_patch import ApiPatcher, PrimitiveWrapper
from msprobe_core.mindspore.runtime import (MINDTORCH, Parameter, Tensor, current_rank, framework, numel,
                                            recording_grad, register_grad_hook, tensors_on_host)
from msprobe_core.mindspore.summarize import Summarizer, tensors_in

logger = setup_logging()

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STACKS = StackCapture((_OWN_DIR,), ("mindspore/nn/cell.py", "mindtorch/nn/modules/module.py",
                                      "mindspore/ops/primitive.py", "mindspore/graph/_utils/check_jit_forbidden_api.py"))
capture_stack = _STACKS.capture
_DEFERRED_BATCH = 512  # device statistics resolved (one host copy) every this many records
_SKIPPED = object()  # a cell call the tool did not look at


class _Call:
    """A recorded forward call between its start and its end."""

    __slots__ = ("name", "backward", "seq", "record", "save", "parent", "grad")

    def __init__(self, name, backward, seq, record, save, parent, grad):
        self.name = name
        self.backward = backward
        self.seq = seq
        self.record = record
        self.save = save
        self.parent = parent
        self.grad = grad  # autograd records this call and its backward is dumped

    def backward_parent(self) -> Optional[str]:
        """The parent of its backward record in construct.json."""
        return self.parent.replace(".forward", ".backward") if self.parent else None


class _OwnWork:
    """``with service._own(where):`` the tool's own work: nothing inside is recorded, and an exception goes
    to dump_error_info.log instead of the user's training."""

    __slots__ = ("service", "where")

    def __init__(self, service: "DumpService", where: str):
        self.service = service
        self.where = where

    def __enter__(self) -> None:
        TOOL.depth += 1

    def __exit__(self, exc_type, exc, tb) -> bool:
        TOOL.depth -= 1
        if isinstance(exc, Exception):
            self.service._error(self.where, exc)
            return True
        return False


class DumpService:
    """One process's MindSpore dump: configuration, current step, hooks and the step's recorder."""

    def __init__(self, cfg: DumpConfig, wrap_list: Optional[str] = None):
        if cfg.level == "debug":
            raise ConfigError("level", "debug", "L0, L1, mix (the MindSpore dump has no debug level)", cfg.source)
        self.cfg = cfg
        self.framework = framework()
        self.cell_prefix = "Module" if self.framework == MINDTORCH else "Cell"
        self.selection = Selection(cfg)
        self.current_step = 0
        self.finished = False
        self.last_rank_dir: Optional[Path] = None
        self.recorder: Optional[StepRecorder] = None
        self._collecting = False   # between start() and stop()
        self._token_ok = True      # inside token_range (or no token_range)
        self._recording = False    # both of the above
        self._rank_id: Optional[int] = None
        self._checked_dirs: set[str] = set()
        self._uses_l0 = cfg.level in ("L0", "mix")
        self._uses_l1 = cfg.level in ("L1", "mix")
        self.patcher = ApiPatcher(self.framework, self._on_api_call, self.should_record, wrap_list) \
            if self._uses_l1 else None
        if self.patcher is not None:
            self.patcher.prepare()  # a bad wrap list fails here, not mid-training
        self.primitives = PrimitiveWrapper(self._on_api_call, self.should_record) \
            if self._uses_l1 and self.framework != MINDTORCH else None
        self._on_host = tensors_on_host()
        self.summarizer = Summarizer(statistics=cfg.task != "structure", md5=cfg.summary_mode == "md5",
                                     on_host=self._on_host, read_pointers=self.framework != MINDTORCH)
        self._saves = cfg.task == "tensor"
        self._overflow_check = cfg.task == "overflow_check"
        self._counters: dict[str, int] = {}
        self._cell_stack: list[str] = []
        self._cell_calls: dict[int, list] = {}
        self._bwd_sizes: dict[str, list[int]] = {}
        self._forward_handles: list[Any] = []  # removed at stop()
        self._step_handles: list[Any] = []     # parameter and leaf gradient hooks: removed at step()
        self._param_hooked: set[int] = set()
        self._hooked_models: list[Any] = []
        self._recorded_cells: set[str] = set()
        self._overflows = 0
        self._deferred = 0
        self._custom: dict[tuple[int, str], Any] = {}
        atexit.register(self.close)

    # ================================================================== life cycle
    def should_record(self) -> bool:
        """Hot path of every wrapped API: record this call?"""
        return self._recording and TOOL.depth == 0

    def _update_recording(self) -> None:
        self._recording = self._collecting and self._token_ok

    @property
    def idle(self) -> bool:
        """No step is open: not collecting, and nothing recorded since the last ``step()``."""
        return not self._collecting and self.recorder is None

    def start(self, model: Any = None, token_range: Any = None, rank_id: Optional[int] = None) -> None:
        window = validate_token_range(token_range)
        if rank_id is not None:
            if isinstance(rank_id, bool) or not isinstance(rank_id, int) or rank_id < 0:
                raise ConfigError("rank_id", rank_id, "an int >= 0")
            self._rank_id = rank_id
        kind = "a torch.nn.Module (mindtorch)" if self.framework == MINDTORCH else "a mindspore.nn.Cell"
        if window is not None and model is None:
            raise ConfigError("model", None, f"{kind} (token_range counts the model's forward calls)")
        if self._uses_l0 and model is None:
            raise ConfigError("model", None, f"{kind} or a list of them (level '{self.cfg.level}' dumps "
                                             f"{'modules' if self.framework == MINDTORCH else 'cells'})")
        models = _models(model, kind)
        if self._collecting:
            logger.warning("start() called while already dumping: ignored (call stop() first)")
            return
        if self.finished:
            return
        rank = self._rank()
        if (rank is not None and rank not in self.cfg.rank) or self.current_step not in self.cfg.step:
            return
        self._open_step()
        if models:
            self._install_model_hooks(models, isinstance(model, (list, tuple)), window)
        if self.patcher is not None:
            self.patcher.patch()
        self._collecting = True
        self._update_recording()

    def stop(self) -> None:
        if not self._collecting:
            return
        self._collecting = False
        self._update_recording()
        if self.patcher is not None:
            self.patcher.restore()
        if self.primitives is not None:
            self.primitives.restore()
        for h in self._forward_handles:
            h.remove()
        self._forward_handles.clear()
        self._hooked_models.clear()
        self._token_ok = True
        self._sync(force=True)

    def step(self) -> None:
        self.stop()
        self._finish_step()
        self.current_step += 1
        last = self.cfg.step.last()
        if last is not None and self.current_step > last and not self.finished:
            self.finished = True
            logger.info("the last configured step (%d) is dumped; msprobe ends successfully", last)

    def set_init_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError("step", step, "an int >= 0")
        self.current_step = step

    def close(self) -> None:
        """Finish the open step (also at interpreter exit) and restore everything."""
        self.stop()
        self._finish_step()
        for key in list(self._custom):
            self._custom.pop(key)[1].remove()

    def _finish_step(self) -> None:
        for h in self._step_handles:
            h.remove()
        self._step_handles.clear()
        self._param_hooked.clear()
        self._sync(force=True)
        self.last_rank_dir = None
        rec = self.recorder
        if rec is not None and rec.has_content:
            rec.finish()
            self.last_rank_dir = rec.rank_dir
            logger.info("%s is at %s", rec.json_name, rec.rank_dir)
        self.recorder = None
        self._counters.clear()
        self._cell_stack.clear()
        self._cell_calls.clear()
        self._bwd_sizes.clear()
        self._recorded_cells.clear()
        self.selection.reset_step()

    # ================================================================== folders
    def _rank(self) -> Optional[int]:
        return self._rank_id if self._rank_id is not None else current_rank()

    def _open_step(self) -> StepRecorder:
        if self.recorder is None:
            name = rank_folder_name(self._rank())
            if name not in self._checked_dirs:
                check_not_taken(self.cfg.dump_path, name)
                self._checked_dirs.add(name)
            rank_dir = Path(self.cfg.dump_path) / f"step{self.current_step}" / name
            header = {"task": self.cfg.task, "level": self.cfg.level, "framework": self.framework,
                      "dump_data_dir": None}
            if self._saves or self.cfg.tensor_list:
                header["dump_data_dir"] = str((rank_dir / "dump_tensor_data").absolute())
            self.recorder = StepRecorder(rank_dir, header, "dump.json")
            self.summarizer.tensor_dir = self.recorder.tensor_dir
        return self.recorder

    def _sync(self, force: bool = False) -> None:
        """Resolve statistics and journal the records: at once on the CPU backend (a crash loses none), in
        batches of records for device tensors (one host copy per batch); with ``async_dump`` at stop()/step()."""
        if not force:
            if self.cfg.async_dump:
                return
            if not self._on_host:
                self._deferred += 1
                if self._deferred < _DEFERRED_BATCH:
                    return
        self._deferred = 0
        if self.summarizer.has_pending:
            with self._own("resolving statistics"):
                self.summarizer.resolve()
        if self.recorder is not None:
            self.recorder.sync_journal()

    def _own(self, where: str) -> _OwnWork:
        return _OwnWork(self, where)

    def _error(self, where: str, exc: BaseException) -> None:
        rec = self.recorder or self._open_step()
        rec.log_error(f"{where}: {exc!r}")
        logger.warning("error while dumping %s: %r (see dump_error_info.log)", where, exc)

    # ================================================================== L1 APIs
    def _on_api_call(self, original: Callable, prefix: str, api: str, args: tuple, kwargs: dict):
        key = f"{prefix}.{api}"
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        name = f"{key}.{n}.forward"
        TOOL.depth += 1
        try:
            call = None
            if self.selection.record(name):
                try:
                    parent = self._cell_stack[-1] if (self._uses_l0 and self._cell_stack) else None
                    call = self._begin(name, f"{key}.{n}.backward", args, kwargs, parent)
                    args, kwargs = self._hook_inputs(call, args, kwargs, _in_place(api))
                except Exception as e:  # the tool must never break the user's call
                    self._error(name, e)
            out = original(*args, **kwargs)
            if call is not None:
                try:
                    self._end(call, out)
                except Exception as e:
                    self._error(name, e)
            self.selection.call_finished(name)
            return out
        finally:
            TOOL.depth -= 1

    # ================================================================== shared record logic
    def _begin(self, name: str, backward: str, args: tuple, kwargs: dict, parent: Optional[str],
               parameters: Optional[Sequence[tuple[str, Tensor]]] = None) -> _Call:
        rec = self.recorder or self._open_step()
        seq = -1 if self._overflow_check else rec.reserve(name)
        save = self._saves or self.selection.saves_tensor(name)
        keep_in = self.selection.forward and self.selection.keeps("forward", "input")
        summarize = self.summarizer.summarize
        record: dict[str, Any] = {
            "input_args": summarize(list(args), f"{name}.input", save) if keep_in else [],
            "input_kwargs": summarize(kwargs, f"{name}.input", save) if keep_in else {},
        }
        if parameters is not None:
            record["parameters"] = {p: summarize(t, f"{name}.parameters.{p}", save) for p, t in parameters} \
                if keep_in else {}
        call = _Call(name, backward, seq, record, save, parent, self.selection.backward and recording_grad())
        if call.grad:
            self._bwd_sizes.setdefault(backward, [0, 0])[1] = len(tensors_in((args, kwargs)))
        if not self._overflow_check and self.cfg.extra_info:
            rec.put_stack(name, capture_stack(3))
        return call

    def _end(self, call: _Call, out: Any) -> None:
        rec = self.recorder or self._open_step()
        outputs = list(out) if isinstance(out, (list, tuple)) else [out]
        if self._overflow_check:
            if not self._overflowed(outputs):
                return
            call.seq = rec.reserve(call.name)
            if self.cfg.extra_info:
                rec.put_stack(call.name, capture_stack(3))
        keep_out = self.selection.forward and self.selection.keeps("forward", "output")
        call.record["output"] = self.summarizer.summarize(outputs, f"{call.name}.output", call.save) \
            if keep_out else []
        if self.selection.forward:
            rec.put(call.name, call.record, call.seq)
        if self._uses_l0:
            rec.put_parent(call.name, call.parent)
        if call.grad:
            tensors = tensors_in(outputs)
            self._bwd_sizes.setdefault(call.backward, [0, 0])[0] = len(tensors)
            if self.selection.keeps("backward", "input"):
                for i, t in enumerate(tensors):
                    if _differentiable(t):
                        self._hook_grad(t, partial(self._on_grad, call.backward, "input", i, call.save,
                                                   call.backward_parent()))
        self._sync()

    def _overflowed(self, outputs: list) -> bool:
        """overflow_check: does any output hold an Inf or a NaN (within ``overflow_nums``)?"""
        if self.cfg.overflow_nums != -1 and self._overflows >= self.cfg.overflow_nums:
            return False
        if not any(self._has_inf_or_nan(t) for t in tensors_in(outputs)):
            return False
        self._overflows += 1
        if self.cfg.overflow_nums != -1 and self._overflows >= self.cfg.overflow_nums:
            logger.warning("overflow_nums=%d reached; no further overflow is recorded", self.cfg.overflow_nums)
        return True

    def _has_inf_or_nan(self, t: Tensor) -> bool:
        if not numel(t) or tensor_stats.kind_of(t.dtype) not in ("float", "complex"):
            return False
        if self._on_host:
            return tensor_stats.overflowed(tensor_stats.host_stats(t, self.summarizer.read_pointers))
        return not bool(tensor_stats.host_array(tensor_stats.device_all_finite(t), read_pointer=False))

    def _hook_grad(self, t: Tensor, hook: Callable) -> None:
        handle = register_grad_hook(t, hook)
        if isinstance(t, Parameter):  # hooks on parameters outlive the step's graph
            self._step_handles.append(handle)

    def _hook_inputs(self, call: _Call, args: tuple, kwargs: dict, in_place: bool) -> tuple[tuple, dict]:
        """The call's arguments for its backward ``output`` record: the gradient this call sends to each of
        its tensor inputs (its share, for an input other calls also use, as PyTorch's dump reports it).
        Each input is passed as a view made for this call alone, whose gradient hook sees exactly that
        share; a view is free (no copy, no kernel) and leaves autograd's sums as they are. Parameters and
        the inputs of in-place APIs are hooked themselves (a view would take the in-place write)."""
        if not (call.grad and self.selection.keeps("backward", "output")):
            return args, kwargs
        index = iter(range(1 << 30))
        parent = call.backward_parent()

        def hook(t: Tensor) -> Tensor:
            i = next(index)
            if not _differentiable(t):
                return t
            on_grad = partial(self._on_grad, call.backward, "output", i, call.save, parent)
            if in_place or isinstance(t, Parameter):
                self._hook_grad(t, on_grad)
                return t
            alias = _view(t, t.shape)
            register_grad_hook(alias, on_grad)
            return alias

        return _map_tensors(args, hook), _map_tensors(kwargs, hook)

    def _on_grad(self, backward: str, field: str, index: int, save: bool, parent: Optional[str], grad) -> None:
        rec = self.recorder
        if rec is None or grad is None:
            return None
        with self._own(backward):
            if self._overflow_check and not self._has_inf_or_nan(grad):
                return None
            summary = self.summarizer.summarize(grad, f"{backward}.{field}.{index}", save)
            sizes = self._bwd_sizes.get(backward, [0, 0])
            fresh = backward not in rec.data
            rec.put_field(backward, [field, index], summary,
                          lambda: {"input": [None] * sizes[0], "output": [None] * sizes[1]})
            if fresh and self._uses_l0:
                rec.put_parent(backward, parent)
            self._sync()
        return None

    # ================================================================== L0 cells / modules
    def _install_model_hooks(self, models: list, indexed: bool, window: Optional[tuple[int, int]]) -> None:
        if any(m in self._hooked_models for m in models):
            return
        if window is not None:
            self._install_token_window(models[0], window)
        for idx, root in enumerate(models):
            named = list(_named_cells(root))
            if self.primitives is not None:
                self.primitives.hook_cells(cell for _, cell in named)
            if not self._uses_l0:
                continue
            prefix = f"{idx}." if indexed else ""
            for path, cell in named:
                if cell is not root:
                    self._hook_cell(cell, f"{self.cell_prefix}.{prefix}{path}.{type(cell).__name__}")
        self._hooked_models.extend(models)

    def _hook_cell(self, cell: Any, base: str) -> None:
        self._forward_handles.append(cell.register_forward_pre_hook(partial(self._cell_pre, base), with_kwargs=True))
        self._forward_handles.append(cell.register_forward_hook(partial(self._cell_post, base), with_kwargs=True))
        if self.selection.backward:
            for pname, p in _own_parameters(cell):
                if p.requires_grad and id(p) not in self._param_hooked:
                    self._param_hooked.add(id(p))
                    self._step_handles.append(register_grad_hook(p, partial(self._on_param_grad, base, pname)))

    def _cell_pre(self, base: str, cell: Any, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        calls = self._cell_calls.setdefault(id(cell), [])
        if not self.should_record():
            calls.append(_SKIPPED)
            return None
        calls.append(_SKIPPED)  # replaced below once the call is set up
        call = new_args = new_kwargs = None
        with self._own(base):
            n = self._counters.get(base, 0)
            self._counters[base] = n + 1
            name = f"{base}.forward.{n}"
            if self.selection.record(name):
                parent = self._cell_stack[-1] if self._cell_stack else None
                call = self._begin(name, f"{base}.backward.{n}", args, kwargs, parent, _own_parameters(cell))
                self._recorded_cells.add(base)
                new_args, new_kwargs = self._hook_inputs(call, args, kwargs, in_place=False)
            calls[-1] = call
            self._cell_stack.append(name)
        if new_args is not None and (new_args is not args or new_kwargs is not kwargs):
            return new_args, new_kwargs  # the cell runs on its inputs' views (see _hook_inputs)
        return None

    def _cell_post(self, base: str, cell: Any, args: tuple, kwargs: dict, output: Any) -> None:
        calls = self._cell_calls.get(id(cell))
        if not calls:
            return None
        call = calls.pop()
        if call is _SKIPPED:
            return None
        with self._own(base):
            if self._cell_stack:
                self._cell_stack.pop()
            if call is not None:
                self._end(call, output)
                self.selection.call_finished(call.name)
        return None

    def _on_param_grad(self, base: str, pname: str, grad) -> None:
        rec = self.recorder
        if rec is None or grad is None or base not in self._recorded_cells:
            return None
        with self._own(base):
            key = f"{base}#{pname}"
            k = self._counters.get(key, 0)
            self._counters[key] = k + 1
            name = f"{base}.parameters_grad.{k}"
            if self._overflow_check and not self._has_inf_or_nan(grad):
                return None
            summary = self.summarizer.summarize(grad, f"{name}.{pname}", self._saves or self.selection.saves_tensor(name))
            rec.put_field(name, [pname, 0], summary, dict)
            self._sync()
        return None

    # ================================================================== token range
    def _install_token_window(self, root: Any, window: tuple[int, int]) -> None:
        """Count the root's forward calls (0 = prefill, then one per decode step): dumping is on from the
        start of call ``start`` until the start of call ``end + 1`` (or ``stop()``)."""
        start, end = window
        counter = {"calls": 0}

        def pre(cell, args):
            idx = counter["calls"]
            counter["calls"] = idx + 1
            self._token_ok = start <= idx <= end
            self._update_recording()

        self._token_ok = False
        self._update_recording()
        self._forward_handles.append(root.register_forward_pre_hook(pre, prepend=True))

    # ================================================================== custom APIs
    def register_custom_api(self, module: Any, api: str, api_prefix: Optional[str] = None) -> None:
        """Dump ``module.api`` as ``{api_prefix}.{api}.{n}.forward`` from now on."""
        from msprobe_core.common.patch import patch
        from msprobe_core.dump.api_wrap import make_wrapper

        if not isinstance(api, str) or not callable(getattr(module, api, None)):
            raise ConfigError("api", api, f"the name of a callable attribute of {getattr(module, '__name__', module)!r}")
        if (id(module), api) in self._custom:
            return
        prefix = api_prefix if api_prefix is not None else str(getattr(module, "__name__", type(module).__name__))
        handle = patch(module, api, lambda original: make_wrapper(original, prefix, api, self._on_api_call,
                                                                  self.should_record))
        self._custom[(id(module), api)] = (module, handle)

    def restore_custom_api(self, module: Any, api: str) -> None:
        """Undo ``register_custom_api``."""
        entry = self._custom.pop((id(module), api), None)
        if entry is not None:
            entry[1].remove()

    def save(self, variable: Any, name: str, save_backward: bool = True) -> None:
        raise DumpStateError("save() is not available in the MindSpore dump; dump the calls around the value "
                             "with level L1 or mix instead")

    def module_dump(self, module: Any, name: str) -> None:
        raise DumpStateError("module_dump() is not available in the MindSpore dump; pass the cell to "
                             "start(model=...) with a scope or list in config.json instead")

    module_dump_end = module_dump


_view = Tensor.view  # captured before any API is wrapped


def _differentiable(t: Tensor) -> bool:
    """Float and complex tensors get gradients; integer and bool tensors do not."""
    return tensor_stats.kind_of(t.dtype) in ("float", "complex")


def _in_place(api: str) -> bool:
    """Does the API write into its input (``add_``, ``__iadd__``, ``ops.assign``, ``inplace_add``,
    ``scatter_update``, an ``Assign`` primitive)?"""
    name = api.rsplit(".", 1)[-1]
    lower = name.lower()
    return ((name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
            or lower.startswith(("assign", "inplace")) or "update" in lower)


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``, in ``tensors_in``'s order."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(v, fn) for v in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _models(model: Any, kind: str) -> list:
    """``model`` as a list of cells/modules (empty for None); anything else is a ``ConfigError``."""
    if model is None:
        return []
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if not models or not all(_is_model(m) for m in models):
        raise ConfigError("model", type(model).__name__, f"{kind}, or a list/tuple of them")
    return models


def _is_model(obj: Any) -> bool:
    from mindspore import nn

    if isinstance(obj, nn.Cell):
        return True
    if framework() == MINDTORCH:
        import torch  # mindtorch's

        return isinstance(obj, torch.nn.Module)
    return False


def _named_cells(root: Any):
    """(path, cell) of ``root`` and everything inside it, root first (path '')."""
    if hasattr(root, "cells_and_names"):
        return root.cells_and_names()
    return root.named_modules()


def _own_parameters(cell: Any) -> list[tuple[str, Any]]:
    """The parameters a cell or module holds itself (not its children's), by attribute name."""
    params = getattr(cell, "_params", None)
    if params is None:
        params = getattr(cell, "_parameters", None) or {}
    return [(k, v) for k, v in params.items() if v is not None]
