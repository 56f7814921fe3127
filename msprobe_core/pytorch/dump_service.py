"""The PyTorch dump service: hooks, naming and step life cycle behind ``PrecisionDebugger``.

Decide once, run fast: the API patch plan and the module hook plan are built when dumping starts; a call
that is not recorded costs one flag test. Gradients are captured with tensor hooks and autograd node hooks
that return None (never ``register_full_backward_hook``, which inserts identity nodes and can change the
order in which autograd sums gradients), so losses and gradients are bit-identical with the tool on or off.

Backward records: ``input`` holds the gradients of the call's outputs (tensor hooks); ``output`` the
gradients the call itself sends to its tensor inputs, read on the edges of its own graph nodes
(``backward_capture``): for an input that other calls also use, this call's share only.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from msprobe_core.files.call_stack import StackCapture
from msprobe_core.common.patch import PatchHandle, patch
from msprobe_core.common.rank_folder import check_not_taken, rank_folder_name
from msprobe_core.dump.config import DumpConfig, validate_token_range
from msprobe_core.dump.selection import Selection
from msprobe_core.files.step_recorder import StepRecorder
from msprobe_core.errors import ConfigError
from msprobe_core.pytorch.api_patch import ApiPatcher, make_wrapper
from msprobe_core.pytorch.backward_capture import InputEdges, capture
from msprobe_core.pytorch.inplace_comm import written_tensors
from msprobe_core.pytorch.ranks import current_rank
from msprobe_core.pytorch.summarize import Summarizer, tensors_in
from msprobe_core.pytorch.tensor_stats import has_inf_or_nan
from msprobe_core.pytorch.pt_writer import TensorFiles
from msprobe_core.common.tool_guard import TOOL

from msprobe_core.log import setup_logging

logger = setup_logging()

_graph_task_id = torch._C._current_graph_task_id
_is_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_no_torch_function = torch._C.DisableTorchFunction  # the tool's own tensor work skips every TorchFunctionMode
_thread_id = threading.get_ident
_Uninitialized = torch.nn.parameter.UninitializedTensorMixin
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEFERRED_BATCH = 512  # device statistics resolved (one host copy) every this many records
_WARNED_ERRORS = 10  # a step's first errors are also logged (a full disk must not flood the training's output)


class _no_grad:
    """``torch.no_grad()`` for the tool's own work at a fraction of its cost (two C calls, and none when
    autograd is already off, as in backward hooks)."""

    __slots__ = ("prev",)

    def __enter__(self) -> bool:
        """Returns whether autograd was on."""
        self.prev = _is_grad_enabled()
        if self.prev:
            _set_grad_enabled(False)
        return self.prev

    def __exit__(self, *exc) -> None:
        if self.prev:
            _set_grad_enabled(True)


class _OwnWork:
    """``with service._own(where):`` the tool's own work: nothing inside is recorded, and an exception
    goes to dump_error_info.log instead of the user's training."""

    __slots__ = ("service", "where")

    def __init__(self, service: "DumpService", where: str):
        self.service = service
        self.where = where

    def __enter__(self) -> None:
        self.service._tls.depth += 1

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.service._tls.depth -= 1
        if isinstance(exc, Exception):
            self.service._error(self.where, exc)
            return True
        return False


_STACKS = StackCapture((_OWN_DIR,), ("torch/nn/modules/module.py", "torch/utils/hooks.py"))
capture_stack = _STACKS.capture


# APIs whose output holds exactly the input's values (same multiset): statistics are shared, not recomputed
_SAME_VALUES = frozenset({"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "contiguous",
                          "flatten", "squeeze", "unsqueeze", "movedim", "swapaxes", "swapdims", "clone", "detach",
                          "unflatten", "adjoint"})

_SKIPPED = object()  # a module call the tool did not look at (not recording, or nested in a recorded API)
_RAW_INPUTS = "#inputs"   # overflow_check: a call's inputs, summarized once the call is known to overflow
_INPUT_FLAGS = "#flags"   # overflow_check: whether each input held Inf/NaN when the call started


class _Call:
    """A recorded forward call between its start and its end."""

    __slots__ = ("name", "backward", "seq", "record", "save", "parent", "edges")

    def __init__(self, name, backward, seq, record, save, parent):
        self.name = name
        self.backward = backward
        self.seq = seq
        self.record = record
        self.save = save
        self.parent = parent
        self.edges: Optional[InputEdges] = None  # its inputs' gradient edges, until its end hooks its own nodes

    def backward_parent(self) -> Optional[str]:
        """The parent of its backward record in construct.json."""
        return self.parent.replace(".forward", ".backward") if self.parent else None


class DumpService:
    """One process's dump: configuration, current step, hooks and recorders."""

    def __init__(self, cfg: DumpConfig, wrap_list: Optional[str] = None):
        self.cfg = cfg
        self.selection = Selection(cfg)
        self.current_step = 0
        self.finished = False
        self._tls = TOOL  # shared with the monitor: > 0 inside any of the toolkit's own work
        self._collecting = False       # between start() and stop()
        self._token_ok = True          # inside token_range (or no token_range)
        self._exclusive: Optional[torch.nn.Module] = None  # module_dump() window
        self._recording = False        # the conjunction of the three above, kept current
        self._rank_id: Optional[int] = None
        self._rank_dir_name: Optional[str] = None
        self._checked_dirs: set[str] = set()
        self.recorder: Optional[StepRecorder] = None
        self.last_rank_dir: Optional[Path] = None  # the rank folder whose dump.json the last finished step wrote
        self.debug_recorder: Optional[StepRecorder] = None
        self._uses_l1 = cfg.level in ("L1", "mix")
        self._uses_l0 = cfg.level in ("L0", "mix")
        self._construct = cfg.level in ("L0", "mix")
        self.patcher = ApiPatcher(self._on_api_call, self.should_record, wrap_list,
                                   silence=self._silenced) if self._uses_l1 else None
        if self.patcher is not None:
            self.patcher.prepare()  # a bad wrap list fails here, not mid-training
        saves = cfg.task in ("tensor", "overflow_check") or bool(cfg.tensor_list)  # overflow: the call's tensors
        self.files = TensorFiles() if saves else None
        self.summarizer = Summarizer(statistics=cfg.task != "structure", md5=cfg.summary_mode == "md5", files=self.files)
        self._saves = cfg.task == "tensor"
        self._counters: dict[str, int] = {}
        self._module_stack: list[str] = []
        self._module_calls: dict[int, list[Optional[_Call]]] = {}
        self._bwd_sizes: dict[str, list[int]] = {}
        self._forward_handles: list[Any] = []   # removed at stop()
        self._step_handles: list[Any] = []      # gradient hooks (tensors', graph nodes'): removed at step()
        self._hooked_models: list[torch.nn.Module] = []
        self._recorded_modules: set[str] = set()
        self._overflows = 0
        self._deferred = 0
        self._custom: dict[tuple[int, str], PatchHandle] = {}
        self._module_dump_handles: list[Any] = []
        self._thread = _thread_id()  # the dumping thread: the one that called start() (see _other_thread)
        self._other_threads: set[int] = set()
        atexit.register(self._close_at_exit)

    # ================================================================== life cycle
    def _update_recording(self) -> None:
        self._recording = self._collecting and self._token_ok and self._exclusive is None

    def should_record(self) -> bool:
        """Hot path of every wrapped API: record this call? Only the dumping thread's calls are recorded
        (``_other_thread``)."""
        if not (self._recording and self._tls.depth == 0 and _graph_task_id() == -1):
            return False
        return _thread_id() == self._thread or self._other_thread()

    def _other_thread(self) -> bool:
        """A call from a thread other than the one that called start() (a pin-memory thread, an asynchronous
        checkpoint, a user's thread): not recorded, by design. Records are named by call counts in execution
        order, which threads would make depend on scheduling (and two runs would no longer compare); the
        dumping thread's records stay complete and in order. Said once per thread. Returns False."""
        ident = _thread_id()
        if ident not in self._other_threads:
            self._other_threads.add(ident)
            logger.info("calls from thread '%s' are not dumped: the dump records the thread that called start()",
                        threading.current_thread().name)
        return False

    @property
    def idle(self) -> bool:
        """No step is open: not collecting, and nothing recorded since the last ``step()``."""
        return not self._collecting and self.recorder is None and self.debug_recorder is None

    def start(self, model=None, token_range=None, rank_id: Optional[int] = None) -> None:
        window = validate_token_range(token_range)
        if rank_id is not None:
            if isinstance(rank_id, bool) or not isinstance(rank_id, int) or rank_id < 0:
                raise ConfigError("rank_id", rank_id, "an int >= 0")
            self._rank_id = rank_id
        if window is not None and model is None:
            raise ConfigError("model", None, "a torch.nn.Module (token_range counts the model's forward calls)")
        if self._uses_l0 and model is None and not self._hooked_models:
            raise ConfigError("model", None, f"a torch.nn.Module or a list of them (level '{self.cfg.level}' dumps modules)")
        if model is not None:
            _check_model(model)
        if self._collecting:
            logger.warning("start() called while already dumping: ignored (call stop() first)")
            return
        if self.finished:
            return
        rank = self._rank()
        if rank is not None and rank not in self.cfg.rank:
            return
        if self.current_step not in self.cfg.step:
            return
        self._open_step()
        self._thread = _thread_id()
        if model is not None and (self._uses_l0 or window is not None):
            self._install_model_hooks(model, window)
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
        for h in self._forward_handles:
            h.remove()
        self._forward_handles.clear()
        self._hooked_models.clear()
        self._token_ok = True  # the token window (if any) ends with its hooks
        self._sync(force=True)
        if self._backward_ran():
            try:
                self._write_json()
            except OSError as e:  # the files are written again at step(); training goes on
                self._error("writing the step's JSON files at stop()", e)

    def _backward_ran(self) -> bool:
        """Has the step's backward run, i.e. is its latest record a backward one (or a parameter gradient)?
        Then stop() writes the JSON files. Otherwise the backward may still record, or the step is
        forward-only (an inference loop may stop() many times a step): step() writes them."""
        rec = self.recorder
        last = next(reversed(rec.data), "") if rec is not None else ""
        return ".backward" in last or ".parameters_grad." in last

    def _write_json(self, finish: bool = False) -> list[StepRecorder]:
        """Write dump.json, stack.json, construct.json (and debug.json) of the open step as it stands:
        at stop() once the step's backward has run (step() rewrites them only if records came after), and
        with ``finish`` at step(), which also drops the journal. Returns the recorders written."""
        # every tensor file is on disk; with async_dump the writer finishes them while training goes on
        # (close(), also at exit, waits), and a file that fails is logged beside it by the writer
        failed = self.files.flush() if self.files is not None and not self.cfg.async_dump else 0
        self._sync(force=True)  # every statistic on the host, for both recorders at once
        written = []
        for rec in (self.recorder, self.debug_recorder):
            if rec is not None and rec.has_content:
                if failed:
                    rec.log_error(f"{failed} tensor files could not be written (see the writer's messages)")
                    rec.drop_missing_files()  # no record names a file that is not there
                try:
                    if finish:
                        rec.finish()
                    else:
                        rec.write_files()
                except Exception as e:  # a full disk: training goes on; the journal stays for `recover`
                    rec.log_error(f"writing {rec.json_name}: {e!r}")
                    if finish:  # (at stop() they are written again at step())
                        logger.error("%s of %s could not be written (%s); what the journal holds can be rebuilt"
                                     " with `python -m msprobe_core recover %s`", rec.json_name, rec.rank_dir,
                                     getattr(e, "strerror", None) or e, self.cfg.dump_path)
                    continue
                written.append(rec)
        return written

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

    def _close_at_exit(self) -> None:
        """``close()`` at interpreter exit. When the program ends on an uncaught exception (Ctrl-C's
        KeyboardInterrupt included) the open step was cut short: its files say so (``"interrupted": true``)
        instead of looking like a finished step."""
        if getattr(sys, "last_value", None) is not None:
            for rec in (self.recorder, self.debug_recorder):
                if rec is not None:
                    rec.set_header("interrupted", True)
        self.close()

    def close(self) -> None:
        """Finish the open step (also at interpreter exit) and restore everything."""
        try:
            self.stop()
            self._finish_step()
        finally:
            if self.files is not None:
                self.files.close()

    def _finish_step(self) -> None:
        for h in self._step_handles:
            h.remove()
        self._step_handles.clear()
        self.last_rank_dir = None
        for rec in self._write_json(finish=True):
            logger.info("%s is at %s", rec.json_name, rec.rank_dir)
            if rec is self.recorder:
                self.last_rank_dir = rec.rank_dir
        self.recorder = None
        self.debug_recorder = None
        self._counters.clear()
        self._module_stack.clear()
        self._module_calls.clear()
        self._bwd_sizes.clear()
        self._recorded_modules.clear()
        self.selection.reset_step()
        self.summarizer.reset()

    # ================================================================== folders
    def _rank(self) -> Optional[int]:
        return self._rank_id if self._rank_id is not None else current_rank()

    def _rank_dir(self) -> Path:
        name = rank_folder_name(self._rank())
        if name not in self._checked_dirs:
            self._check_not_taken(name)
            self._checked_dirs.add(name)
        return Path(self.cfg.dump_path) / f"step{self.current_step}" / name

    def _check_not_taken(self, rank_dir_name: str) -> None:
        check_not_taken(self.cfg.dump_path, rank_dir_name)

    def _header(self, level: str) -> dict[str, Any]:
        return {"task": self.cfg.task, "level": level, "framework": "pytorch", "dump_data_dir": None}

    def _open_step(self) -> StepRecorder:
        if self.recorder is None:
            rank_dir = self._rank_dir()
            header = self._header(self.cfg.level)
            if self.files is not None:
                header["dump_data_dir"] = str((rank_dir / "dump_tensor_data").absolute())
            self.recorder = StepRecorder(rank_dir, header, "dump.json")
            self.summarizer.tensor_dir = self.recorder.tensor_dir
        return self.recorder

    def _open_debug(self) -> StepRecorder:
        if self.debug_recorder is None:
            rank_dir = self._rank_dir()
            header = self._header("debug")
            if self._saves:
                header["dump_data_dir"] = str((rank_dir / "dump_tensor_data").absolute())
            self.debug_recorder = StepRecorder(rank_dir, header, "debug.json")
            self.summarizer.tensor_dir = self.debug_recorder.tensor_dir
        return self.debug_recorder

    def _sync(self, record_on_device: bool = False, force: bool = False) -> None:
        """Resolve statistics and append journal lines: at once for CPU records (a crash loses none), in
        batches of records for accelerator tensors (one host copy per batch). With ``async_dump`` both wait
        for stop()/step(): fastest, but a crash loses the records of the unfinished step."""
        if not force:
            if self.cfg.async_dump:
                return
            if record_on_device:
                self._deferred += 1
                if self._deferred < _DEFERRED_BATCH:
                    return
        self._deferred = 0
        if self.summarizer.has_pending:
            self._tls.depth += 1
            try:
                with _no_torch_function():
                    self.summarizer.resolve()
            finally:
                self._tls.depth -= 1
        try:
            if self.recorder is not None:
                self.recorder.sync_journal()
            if self.debug_recorder is not None:
                self.debug_recorder.sync_journal()
        except OSError as e:  # a full disk: the records stay in memory for dump.json; training goes on
            self._error("journal", e)

    def _own(self, where: str) -> _OwnWork:
        return _OwnWork(self, where)

    def _error(self, where: str, exc: BaseException) -> None:
        rec = self.recorder or self._open_step()
        rec.log_error(f"{where}: {exc!r}")
        if rec.errors <= _WARNED_ERRORS:
            logger.warning("error while dumping %s: %r (see dump_error_info.log)", where, exc)
            if rec.errors == _WARNED_ERRORS:
                logger.warning("further errors of this step go only to dump_error_info.log")

    # ================================================================== L1 APIs
    def _silenced(self, original: Callable) -> Callable:
        tls = self._tls

        def silent(*args, **kwargs):
            tls.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                tls.depth -= 1

        silent.__wrapped__ = original  # type: ignore[attr-defined]
        return silent

    def _on_api_call(self, original: Callable, prefix: str, api: str, args: tuple, kwargs: dict):
        key = f"{prefix}.{api}"
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        name = f"{key}.{n}.forward"
        tls = self._tls
        tls.depth += 1
        try:
            call = None
            if self.selection.record(name):
                try:
                    parent = self._module_stack[-1] if (self._construct and self._module_stack) else None
                    call = self._begin(name, f"{key}.{n}.backward", args, kwargs, parent)
                except Exception as e:  # the tool must never break the user's call
                    self._error(name, e)
            out = self.patcher.call(original, args, kwargs) if self.patcher is not None else original(*args, **kwargs)
            shown = self._collective_result(name, api, original, args, kwargs, out) if prefix == "Distributed" else out
            if call is not None:
                try:
                    self._end(call, shown, args[0] if api in _SAME_VALUES and args else None)
                except Exception as e:
                    self._error(name, e)
            self.selection.call_finished(name)
            return out
        finally:
            tls.depth -= 1

    def _collective_result(self, name: str, api: str, original: Callable, args: tuple, kwargs: dict, out: Any) -> Any:
        """What a ``Distributed`` call's record shows as output: the tensors an in-place collective wrote,
        as they are after the call (see ``inplace_comm``), whose cached statistics are dropped; else ``out``."""
        try:
            target, is_async = written_tensors(api, original, args, kwargs)
            if target is None:
                return out
            with _no_torch_function():
                for t in tensors_in(target):
                    self.summarizer.forget(t)
        except Exception as e:  # the tool must never break the user's call
            self._error(name, e)
            return out
        return out if is_async else target

    # ================================================================== shared record logic
    def _begin(self, name: str, backward: str, args: tuple, kwargs: dict, parent: Optional[str],
               parameters: Optional[Sequence[tuple[str, torch.Tensor]]] = None) -> _Call:
        with _no_torch_function(), _no_grad() as grad_enabled:
            return self._begin_inner(name, backward, args, kwargs, parent, parameters, grad_enabled)

    def _begin_inner(self, name, backward, args, kwargs, parent, parameters, grad_enabled) -> _Call:
        rec = self.recorder or self._open_step()
        overflow = self.cfg.task == "overflow_check"
        seq = -1 if overflow else rec.reserve(name)
        save = overflow or self._saves or self.selection.saves_tensor(name)
        if overflow:  # the inputs are checked now, summarized (and saved) at the end only if the call overflows
            record = {_RAW_INPUTS: (args, kwargs, parameters),
                      _INPUT_FLAGS: [has_inf_or_nan(t) for t in tensors_in((args, kwargs, parameters))]}
        else:
            record = self._input_record(name, args, kwargs, parameters, save)
        call = _Call(name, backward, seq, record, save, parent)
        if self.selection.backward and grad_enabled:
            tensors = tensors_in((args, kwargs))
            self._bwd_sizes.setdefault(backward, [0, 0])[1] = len(tensors)
            if self.selection.keeps("backward", "output"):
                call.edges = InputEdges.of(tensors)
        if not overflow and self.cfg.extra_info:
            rec.put_stack(name, capture_stack(3))
        return call

    def _input_record(self, name: str, args: tuple, kwargs: dict, parameters: Any, save: bool) -> dict[str, Any]:
        """The forward record's ``input_args``, ``input_kwargs`` (and a module's ``parameters``)."""
        keep_in = self.selection.forward and self.selection.keeps("forward", "input")
        summarize = self.summarizer.summarize
        record: dict[str, Any] = {
            "input_args": summarize(list(args), f"{name}.input", save) if keep_in else [],
            "input_kwargs": summarize(kwargs, f"{name}.input", save) if keep_in else {},
        }
        if parameters is not None:
            record["parameters"] = {p: summarize(t, f"{name}.parameters.{p}", save) for p, t in parameters} if keep_in else {}
        return record

    def _end(self, call: _Call, out: Any, same_values_as: Any = None) -> None:
        """Finish ``call`` with its output; ``same_values_as`` is an input the output only rearranges (a view,
        reshape, ...): its statistics are reused."""
        with _no_torch_function(), _no_grad() as grad_enabled:
            if same_values_as is not None and type(out) is torch.Tensor and isinstance(same_values_as, torch.Tensor) \
                    and out.dtype == same_values_as.dtype and out.numel() == same_values_as.numel():
                self.summarizer.share(same_values_as, out)
            self._end_inner(call, out, grad_enabled)
            if call.edges is not None:
                self._hook_own_grads(call, out)

    def _end_inner(self, call: _Call, out: Any, grad_enabled: bool) -> None:
        rec = self.recorder or self._open_step()
        outputs = list(out) if isinstance(out, (list, tuple)) else [out]
        keep_out = self.selection.forward and self.selection.keeps("forward", "output")
        if self.cfg.task == "overflow_check":
            if not self._overflowed(call.record[_INPUT_FLAGS], outputs):
                return
            call.seq = rec.reserve(call.name)
            call.record = self._input_record(call.name, *call.record[_RAW_INPUTS], call.save)
            if self.cfg.extra_info:
                rec.put_stack(call.name, capture_stack(3))
        call.record["output"] = self.summarizer.summarize(outputs, f"{call.name}.output", call.save) if keep_out else []
        if self.selection.forward:
            rec.put(call.name, call.record, call.seq)
        if self._construct:
            rec.put_parent(call.name, call.parent)
        tensors = tensors_in(outputs)
        if self.selection.backward and grad_enabled:
            self._bwd_sizes.setdefault(call.backward, [0, 0])[0] = len(tensors)
            if self.selection.keeps("backward", "input"):
                self._hook_grads(tensors, call, "input")
        self._sync(record_on_device=bool(tensors) and not tensors[0].is_cpu)

    def _overflowed(self, input_flags: list, outputs: list) -> bool:
        """Does the call hold Inf/NaN in an input (``input_flags``, taken when it started) or an output?"""
        if self.cfg.overflow_nums != -1 and self._overflows >= self.cfg.overflow_nums:
            return False
        flags = input_flags + [has_inf_or_nan(t) for t in tensors_in(outputs)]
        if not flags or not bool(torch.stack([f.to("cpu") for f in flags]).any()):
            return False
        self._overflows += 1
        if self.cfg.overflow_nums != -1 and self._overflows >= self.cfg.overflow_nums:
            logger.warning("overflow_nums=%d reached; no further overflow is recorded", self.cfg.overflow_nums)
        return True

    def _hook_grads(self, tensors: list, call: _Call, field: str) -> None:
        parent = call.backward_parent()
        for i, t in enumerate(tensors):
            if t.requires_grad:  # removed when the step ends (a leaf's hook outlives the graph; a backward
                # run after step() belongs to no recorded step)
                self._step_handles.append(t.register_hook(partial(self._on_grad, call.backward, field, i, call.save, parent)))

    def _hook_own_grads(self, call: _Call, out: Any) -> None:
        """The backward record's ``output``: each input's gradient from this call only (backward_capture)."""
        edges, call.edges = call.edges, None
        capture(edges, tensors_in(out), partial(self._on_own_grad, call.backward, call.save, call.backward_parent()),
                partial(self._error, call.backward), self._step_handles)

    def _on_own_grad(self, backward: str, save: bool, parent: Optional[str], index: int, grad) -> None:
        self._on_grad(backward, "output", index, save, parent, grad)

    def _skips_grad(self, grad) -> bool:
        """overflow_check keeps only gradients holding Inf/NaN."""
        return self.cfg.task == "overflow_check" and not bool(has_inf_or_nan(grad))

    def _on_grad(self, backward: str, field: str, index: int, save: bool, parent: Optional[str], grad):
        rec = self.recorder
        if rec is None or grad is None:
            return None
        with self._own(backward), _no_torch_function(), _no_grad():
            if self._skips_grad(grad):
                return None
            summary = self.summarizer.summarize(grad, f"{backward}.{field}.{index}", save)
            sizes = self._bwd_sizes.get(backward, [0, 0])
            fresh = backward not in rec.data
            rec.put_field(backward, [field, index], summary,
                          lambda: {"input": [None] * sizes[0], "output": [None] * sizes[1]})
            if fresh and self._construct:
                rec.put_parent(backward, parent)
            self._sync(record_on_device=grad.device.type != "cpu")
        return None

    # ================================================================== L0 modules
    def _install_model_hooks(self, model, window: Optional[tuple[int, int]]) -> None:
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        if any(m in self._hooked_models for m in models):
            return
        indexed = isinstance(model, (list, tuple))
        if window is not None:
            self._install_token_window(models[0], window)
        if not self._uses_l0:
            self._hooked_models.extend(models)
            return
        for idx, root in enumerate(models):
            prefix = f"{idx}." if indexed else ""
            for path, module in root.named_modules():
                if module is root:
                    continue
                self.hook_module(module, f"Module.{prefix}{path}.{type(module).__name__}")
        self._hooked_models.extend(models)

    def hook_module(self, module: torch.nn.Module, base: str, exclusive: bool = False) -> list[Any]:
        """Record ``module``'s forward, backward and parameter gradients under ``base``; returns the
        forward hook handles (also removed by stop())."""
        handles = [
            module.register_forward_pre_hook(partial(self._module_pre, base, exclusive), with_kwargs=True),
            module.register_forward_hook(partial(self._module_post, base), with_kwargs=True),
        ]
        self._forward_handles.extend(handles)
        if self.selection.backward:
            for pname, p in module._parameters.items():  # named_parameters(recurse=False), without its generator
                # a lazy module's parameter is not a tensor yet (hooked from the next start() on)
                if p is not None and p.requires_grad and not isinstance(p, _Uninitialized):
                    self._step_handles.append(p.register_hook(partial(self._on_param_grad, base, pname)))
        return handles

    def _module_pre(self, base: str, exclusive: bool, module, args, kwargs):
        if _thread_id() != self._thread:  # another thread's call: neither recorded nor in the call stacks
            self._other_thread()
            return None
        allowed = (self._collecting and self._tls.depth == 0 and _graph_task_id() == -1) if exclusive \
            else self.should_record()
        calls = self._module_calls.setdefault(id(module), [])
        if not allowed:
            calls.append(_SKIPPED)
            return None
        calls.append(_SKIPPED)  # replaced below once the call is set up
        with self._own(base):
            n = self._counters.get(base, 0)
            self._counters[base] = n + 1
            name = f"{base}.forward.{n}"
            call = None
            if self.selection.record(name):
                parent = self._module_stack[-1] if self._module_stack else None
                params = [(k, v) for k, v in module._parameters.items() if v is not None]
                call = self._begin(name, f"{base}.backward.{n}", args, kwargs, parent, params)
                self._recorded_modules.add(base)
            calls[-1] = call
            self._module_stack.append(name)
        return None

    def _module_post(self, base: str, module, args, kwargs, output):
        if _thread_id() != self._thread:
            return None
        calls = self._module_calls.get(id(module))
        if not calls:
            return None
        call = calls.pop()
        if call is _SKIPPED:
            return None
        with self._own(base):
            if self._module_stack:
                self._module_stack.pop()
            if call is not None:
                self._end(call, output)
                self.selection.call_finished(call.name)
        return None

    def _on_param_grad(self, base: str, pname: str, grad):
        rec = self.recorder
        if rec is None or grad is None or base not in self._recorded_modules:
            return None
        with self._own(base), _no_torch_function(), _no_grad():
            key = f"{base}#{pname}"
            k = self._counters.get(key, 0)
            self._counters[key] = k + 1
            name = f"{base}.parameters_grad.{k}"
            if self._skips_grad(grad):
                return None
            summary = self.summarizer.summarize(grad, f"{name}.{pname}", self._saves or self.selection.saves_tensor(name))
            rec.put_field(name, [pname, 0], summary, dict)
            self._sync(record_on_device=grad.device.type != "cpu")
        return None

    # ================================================================== token range
    def _install_token_window(self, root: torch.nn.Module, window: tuple[int, int]) -> None:
        """Count the root's forward calls (0 = prefill, then one per decode step): dumping is on from the
        start of call ``start`` until the start of call ``end + 1`` (or ``stop()``), so each token's
        work after its forward pass (logits, sampling) belongs to it, as in msprobe."""
        start, end = window
        counter = {"calls": 0}

        def pre(module, args):
            idx = counter["calls"]
            counter["calls"] = idx + 1
            self._token_ok = start <= idx <= end
            self._update_recording()

        self._token_ok = False
        self._update_recording()
        self._forward_handles.append(root.register_forward_pre_hook(pre, prepend=True))

    # ================================================================== module_dump / save
    def module_dump(self, module: torch.nn.Module, name: str) -> None:
        """Until ``module_dump_end()``, dump only ``module`` itself (named ``Module.{name}.{Class}``)."""
        if not isinstance(module, torch.nn.Module):
            raise ConfigError("module", type(module).__name__, "a torch.nn.Module")
        if not isinstance(name, str) or not name:
            raise ConfigError("module_name", name, "a non-empty string")
        if not self._collecting:
            return
        self._open_step()
        self._module_dump_handles = self.hook_module(module, f"Module.{name}.{type(module).__name__}", exclusive=True)
        self._exclusive = module
        self._update_recording()

    def module_dump_end(self) -> None:
        """Back to the normal dump after ``module_dump``."""
        for h in self._module_dump_handles:
            h.remove()
        self._module_dump_handles = []
        self._exclusive = None
        self._update_recording()

    def save(self, variable: Any, name: str, save_backward: bool = True) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError("name", name, "a non-empty string")
        if self.finished:
            return
        if _thread_id() != self._thread:
            self._other_thread()
            return
        rank = self._rank()
        if (rank is not None and rank not in self.cfg.rank) or self.current_step not in self.cfg.step:
            return
        rec = self._open_debug()
        tls = self._tls
        tls.depth += 1
        try:
            n = self._counters.get(f"save#{name}", 0)
            self._counters[f"save#{name}"] = n + 1
            key = f"{name}.{n}.debug"
            with _no_torch_function(), _no_grad():
                summary = self.summarizer.summarize(variable, key, self._saves)
            rec.put(key, summary, rec.reserve(key))
            if save_backward and torch.is_grad_enabled():
                self._hook_saved_grads(variable, f"{name}_grad.{n}.debug", [])
            self._sync()
        except Exception as e:  # like every recorded call: the tool never breaks the user's program
            self._error(f"save({name!r})", e)
        finally:
            tls.depth -= 1

    def _hook_saved_grads(self, obj: Any, key: str, path: list) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad and not isinstance(obj, _Uninitialized):
                handle = obj.register_hook(partial(self._on_saved_grad, key, list(path)))
                if obj.is_leaf:
                    self._step_handles.append(handle)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                self._hook_saved_grads(v, key, path + [i])
        elif isinstance(obj, dict):
            for k, v in obj.items():
                self._hook_saved_grads(v, key, path + [str(k)])

    def _on_saved_grad(self, key: str, path: list, grad):
        rec = self.debug_recorder
        if rec is None or grad is None:
            return None
        with self._own(key), _no_torch_function(), _no_grad():
            summary = self.summarizer.summarize(grad, ".".join([key, *map(str, path)]), self._saves)
            if not path:
                rec.put(key, summary, rec.reserve(key))
            else:
                rec.put_field(key, path, summary, dict)
            self._sync()
        return None

    # ================================================================== custom APIs
    def register_custom_api(self, module: Any, api: str, api_prefix: Optional[str] = None) -> None:
        if not isinstance(api, str) or not hasattr(module, api):
            raise ConfigError("api", api, f"the name of a callable attribute of {getattr(module, '__name__', module)!r}")
        original = getattr(module, api)
        if not callable(original):
            raise ConfigError("api", api, "a callable attribute")
        if (id(module), api) in self._custom:
            return
        prefix = api_prefix if api_prefix is not None else str(getattr(module, "__name__", type(module).__name__))
        self._custom[(id(module), api)] = patch(
            module, api, lambda _: make_wrapper(original, prefix, api, self._on_api_call, self.should_record))

    def restore_custom_api(self, module: Any, api: str) -> None:
        handle = self._custom.pop((id(module), api), None)
        if handle is not None:
            handle.remove()


def _check_model(model: Any) -> None:
    models = model if isinstance(model, (list, tuple)) else [model]
    if not models or not all(isinstance(m, torch.nn.Module) for m in models):
        raise ConfigError("model", type(model).__name__, "a torch.nn.Module, or a list/tuple of them")
