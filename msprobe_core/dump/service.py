"""The dump service every framework shares: the record life cycle behind ``PrecisionDebugger``.

``DumpServiceBase`` holds everything that does not touch a framework's API: start/stop/step and the
dumping-thread policy, the step's folders and recorders (``files.step_recorder``: the crash-safe journal,
dump.json/stack.json/construct.json, debug.json of ``save()``), "never overwrite" (``common.rank_folder``),
JSON files at stop() once the backward ran, close at interpreter exit (an interrupted step says so), the
begin and end of a record (forward inputs, outputs, construct.json parents, overflow_check on inputs and
outputs), module pre/post hooks, gradient records, the token window, ``module_dump``, ``save`` and custom
APIs. Errors of the tool's own work go to dump_error_info.log, never to the user's training.

A framework's service (``msprobe_core.pytorch.dump_service``, ``msprobe_core.mindspore.dump_service``)
subclasses it with what touches its tensors and models: the hooks named in "framework hooks" below.
"""

from __future__ import annotations

import atexit
import sys
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from msprobe_core.common.patch import patch
from msprobe_core.common.rank_folder import check_not_taken, rank_folder_name
from msprobe_core.common.tool_guard import TOOL
from msprobe_core.dump.api_wrap import make_wrapper
from msprobe_core.dump.config import DumpConfig, validate_token_range
from msprobe_core.dump.selection import Selection
from msprobe_core.errors import ConfigError
from msprobe_core.files.step_recorder import StepRecorder
from msprobe_core.log import setup_logging

logger = setup_logging()

_thread_id = threading.get_ident
DEFERRED_BATCH = 512  # device statistics resolved (one host copy) every this many records
_WARNED_ERRORS = 10  # a step's first errors are also logged (a full disk must not flood the training's output)
SKIPPED = object()  # a module call the tool did not look at (not recording, or nested in a recorded API)
_RAW_INPUTS = "#inputs"   # overflow_check: a call's inputs, summarized once the call is known to overflow
_INPUT_FLAGS = "#flags"   # overflow_check: whether each input held Inf/NaN when the call started


@dataclass(slots=True, eq=False)
class Call:
    """A recorded forward call between its start and its end."""

    name: str
    backward: str
    seq: int
    record: dict
    save: bool
    parent: Optional[str]
    grad: bool = False  # autograd records this call and its backward is dumped
    edges: Any = None   # framework data for its backward ``output`` (PyTorch: its inputs' gradient edges)

    def backward_parent(self) -> Optional[str]:
        """The parent of its backward record in construct.json."""
        return self.parent.replace(".forward", ".backward") if self.parent else None


class OwnWork:
    """``with service._own(where):`` the tool's own work: nothing inside is recorded, and an exception
    goes to dump_error_info.log instead of the user's training."""

    __slots__ = ("service", "where")

    def __init__(self, service: "DumpServiceBase", where: str):
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


class DumpServiceBase:
    """One process's dump: configuration, current step, hooks and recorders.

    Framework hooks (a subclass defines them): ``framework`` (dump.json's ``framework``), ``model_kind``
    and ``module_word`` (for messages), ``patcher`` (L1 API wrapping, or None), ``files`` (tensor files,
    or None), ``summarizer``; ``_current_rank``, ``_is_model``, ``_named_modules``, ``_own_parameters``,
    ``_hook_param_grad``, ``_hook_tensor_grad``, ``_wants_grad``, ``_tensors_in``, ``_overflow_flag``,
    ``_any_overflow``, ``_quiet``, ``_capture_stack``; optionally ``_prepare_backward``,
    ``_call_inputs``, ``_collective_result``, ``_before_hooking``, ``_unpatch``, ``_grad_recording``,
    ``_on_device``, ``_hook_saved_tensor``, ``_may_record_exclusive`` (and ``should_record``, the hot path)."""

    framework = ""
    model_kind = "a model"
    module_word = "modules"
    module_prefix = "Module"  # L0 record names: ``{module_prefix}.{path}.{Class}.forward.{n}``
    hooks_l1_models = False  # does level L1 look into start()'s models (``_before_hooking``)?
    same_values: frozenset = frozenset()  # APIs whose output only rearranges their first input

    def __init__(self, cfg: DumpConfig):
        self.cfg = cfg
        self.selection = Selection(cfg)
        self.current_step = 0
        self.finished = False
        self.patcher: Any = None
        self.files: Any = None
        self.summarizer: Any = None
        self._tls = TOOL  # shared with the monitor: > 0 inside any of the toolkit's own work
        self._collecting = False       # between start() and stop()
        self._token_ok = True          # inside token_range (or no token_range)
        self._exclusive: Any = None    # module_dump() window
        self._recording = False        # the conjunction of the three above, kept current
        self._rank_id: Optional[int] = None
        self._checked_dirs: set[str] = set()
        self.recorder: Optional[StepRecorder] = None
        self.last_rank_dir: Optional[Path] = None  # the rank folder whose dump.json the last finished step wrote
        self.debug_recorder: Optional[StepRecorder] = None
        self._uses_l1 = cfg.level in ("L1", "mix")
        self._uses_l0 = cfg.level in ("L0", "mix")
        self._construct = self._uses_l0
        self._saves = cfg.task == "tensor"
        self._overflow_check = cfg.task == "overflow_check"
        self._counters: dict[str, int] = {}
        self._module_stack: list[str] = []
        self._module_calls: dict[int, list[Optional[Call]]] = {}
        self._bwd_sizes: dict[str, list[int]] = {}
        self._forward_handles: list[Any] = []   # removed at stop()
        self._step_handles: list[Any] = []      # gradient hooks: removed at step()
        self._hooked_models: list[Any] = []
        self._recorded_modules: set[str] = set()
        self._overflows = 0
        self._deferred = 0
        self._custom: dict[tuple[int, str], tuple[Any, Any]] = {}
        self._module_dump_handles: list[Any] = []
        self._thread = _thread_id()  # the dumping thread: the one that called start() (see _other_thread)
        self._other_threads: set[int] = set()
        self._closes_at_exit = False  # registered with the first step folder (a service never used holds nothing)

    @property
    def saves_files(self) -> bool:
        """Does this configuration write tensor files (task tensor, overflow_check: the overflowing calls'
        tensors, or a tensor_list)?"""
        return self.cfg.task in ("tensor", "overflow_check") or bool(self.cfg.tensor_list)

    # ================================================================== framework hooks
    def _current_rank(self) -> Optional[int]:
        """The framework's rank of this process (None when not distributed)."""
        return None

    def _is_model(self, obj: Any) -> bool:
        raise NotImplementedError

    def _named_modules(self, root: Any):
        """(path, module) of ``root`` and everything inside it, root first (path '')."""
        raise NotImplementedError

    def _own_parameters(self, module: Any) -> list[tuple[str, Any]]:
        """The parameters a module holds itself (not its children's), by attribute name."""
        raise NotImplementedError

    def _hook_param_grad(self, param: Any, hook: Callable) -> None:
        """Call ``hook(grad)`` with the parameter's gradients until the step ends (or not at all, where the
        parameter gets none)."""
        raise NotImplementedError

    def _hook_tensor_grad(self, t: Any, hook: Callable) -> None:
        """Call ``hook(grad)`` with the gradient of ``t`` (a forward output or input)."""
        raise NotImplementedError

    def _wants_grad(self, t: Any) -> bool:
        """Does ``t`` get a gradient worth a hook?"""
        raise NotImplementedError

    def _tensors_in(self, obj: Any) -> list:
        raise NotImplementedError

    def _overflow_flag(self, t: Any) -> Any:
        """Does ``t`` hold an Inf or a NaN? (may be a device value: ``_any_overflow`` reads it)"""
        raise NotImplementedError

    def _any_overflow(self, flags: list) -> bool:
        raise NotImplementedError

    def _quiet(self) -> Any:
        """A context for the tool's own tensor work; entering it returns whether autograd records."""
        raise NotImplementedError

    def _capture_stack(self) -> Any:
        """The user's call stack of the call being recorded (stack.json)."""
        raise NotImplementedError

    def _grad_recording(self) -> bool:
        """Does autograd record the tensors made now (``save``'s gradients)?"""
        return False

    def _prepare_backward(self, call: Call, inputs: list) -> None:
        """At a call's start (autograd on): get ready to record the gradient it sends to its inputs."""

    def _call_inputs(self, call: Call, args: tuple, kwargs: dict, api: str) -> tuple[tuple, dict]:
        """The arguments the call runs on (a framework may pass views to see each input's gradient)."""
        return args, kwargs

    def _collective_result(self, name: str, api: str, original: Callable, args: tuple, kwargs: dict, out: Any) -> Any:
        """What a ``Distributed`` call's record shows as output (default: its return value)."""
        return out

    def _before_hooking(self, modules: list) -> None:
        """Called with the modules of each model given to start(), before any is hooked."""

    def _unpatch(self) -> None:
        """Undo start()'s API wrapping."""
        if self.patcher is not None:
            self.patcher.restore()

    # ================================================================== life cycle
    def _update_recording(self) -> None:
        self._recording = self._collecting and self._token_ok and self._exclusive is None

    def should_record(self) -> bool:
        """Hot path of every wrapped API: record this call? Only the dumping thread's calls are recorded
        (``_other_thread``)."""
        if not (self._recording and self._tls.depth == 0):
            return False
        return _thread_id() == self._thread or self._other_thread()

    def _may_record_exclusive(self) -> bool:
        """Inside a ``module_dump`` window: may the module given to it record now?"""
        return self._collecting and self._tls.depth == 0

    def _other_thread(self) -> bool:
        """A call from a thread other than the one that called start() (a data-loading thread, an
        asynchronous checkpoint, a user's thread): not recorded, by design. Records are named by call counts
        in execution order, which threads would make depend on scheduling (and two runs would no longer
        compare); the dumping thread's records stay complete and in order. Said once per thread. Returns
        False."""
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

    def _models(self, model: Any) -> list:
        """``model`` as a list of models (empty for None); anything else is a ``ConfigError``."""
        if model is None:
            return []
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        if not models or not all(self._is_model(m) for m in models):
            raise ConfigError("model", type(model).__name__, f"{self.model_kind}, or a list/tuple of them")
        return models

    def start(self, model: Any = None, token_range: Any = None, rank_id: Optional[int] = None) -> None:
        window = validate_token_range(token_range)
        if rank_id is not None:
            if isinstance(rank_id, bool) or not isinstance(rank_id, int) or rank_id < 0:
                raise ConfigError("rank_id", rank_id, "an int >= 0")
            self._rank_id = rank_id
        if window is not None and model is None:
            raise ConfigError("model", None, f"{self.model_kind} (token_range counts the model's forward calls)")
        if self._uses_l0 and model is None and not self._hooked_models:
            raise ConfigError("model", None, f"{self.model_kind} or a list of them (level '{self.cfg.level}' "
                                             f"dumps {self.module_word})")
        models = self._models(model)
        if self._collecting:
            logger.warning("start() called while already dumping: ignored (call stop() first)")
            return
        if self.finished:
            return
        if not self._in_configured_step():
            return
        self._open_step()
        self._thread = _thread_id()
        if models:
            self._install_model_hooks(models, isinstance(model, (list, tuple)), window)
        if self.patcher is not None:
            self.patcher.patch()
        self._collecting = True
        self._update_recording()

    def _in_configured_step(self) -> bool:
        rank = self._rank()
        return (rank is None or rank in self.cfg.rank) and self.current_step in self.cfg.step

    def stop(self) -> None:
        if not self._collecting:
            return
        self._collecting = False
        self._update_recording()
        self._unpatch()
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
            for key in list(self._custom):
                self._custom.pop(key)[1].remove()
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
        return self._rank_id if self._rank_id is not None else self._current_rank()

    def _rank_dir(self) -> Path:
        if not self._closes_at_exit:
            atexit.register(self._close_at_exit)
            self._closes_at_exit = True
        name = rank_folder_name(self._rank())
        if name not in self._checked_dirs:
            self._check_not_taken(name)
            self._checked_dirs.add(name)
        return Path(self.cfg.dump_path) / f"step{self.current_step}" / name

    def _check_not_taken(self, rank_dir_name: str) -> None:
        check_not_taken(self.cfg.dump_path, rank_dir_name)

    def _header(self, level: str) -> dict[str, Any]:
        return {"task": self.cfg.task, "level": level, "framework": self.framework, "dump_data_dir": None}

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
        """Resolve statistics and append journal lines: at once for host records (a crash loses none), in
        batches of records for accelerator tensors (one host copy per batch). With ``async_dump`` both wait
        for stop()/step(): fastest, but a crash loses the records of the unfinished step."""
        if not force:
            if self.cfg.async_dump:
                return
            if record_on_device:
                self._deferred += 1
                if self._deferred < DEFERRED_BATCH:
                    return
        self._deferred = 0
        if self.summarizer.has_pending:
            with self._own("resolving statistics"), self._quiet():
                self.summarizer.resolve()
        try:
            if self.recorder is not None:
                self.recorder.sync_journal()
            if self.debug_recorder is not None:
                self.debug_recorder.sync_journal()
        except OSError as e:  # a full disk: the records stay in memory for dump.json; training goes on
            self._error("journal", e)

    def _own(self, where: str) -> OwnWork:
        return OwnWork(self, where)

    def _error(self, where: str, exc: BaseException) -> None:
        rec = self.recorder or self._open_step()
        rec.log_error(f"{where}: {exc!r}")
        if rec.errors <= _WARNED_ERRORS:
            logger.warning("error while dumping %s: %r (see dump_error_info.log)", where, exc)
            if rec.errors == _WARNED_ERRORS:
                logger.warning("further errors of this step go only to dump_error_info.log")

    # ================================================================== L1 APIs
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
                    args, kwargs = self._call_inputs(call, args, kwargs, api)
                except Exception as e:  # the tool must never break the user's call
                    self._error(name, e)
            out = self.patcher.call(original, args, kwargs) if self.patcher is not None else original(*args, **kwargs)
            shown = self._collective_result(name, api, original, args, kwargs, out) if prefix == "Distributed" else out
            if call is not None:
                try:
                    self._end(call, shown, args[0] if api in self.same_values and args else None)
                except Exception as e:
                    self._error(name, e)
            self.selection.call_finished(name)
            return out
        finally:
            tls.depth -= 1

    # ================================================================== shared record logic
    def _begin(self, name: str, backward: str, args: tuple, kwargs: dict, parent: Optional[str],
               parameters: Optional[Sequence[tuple[str, Any]]] = None) -> Call:
        with self._quiet() as grad_enabled:
            return self._begin_record(name, backward, args, kwargs, parent, parameters, grad_enabled)

    def _begin_record(self, name, backward, args, kwargs, parent, parameters, grad_enabled) -> Call:
        rec = self.recorder or self._open_step()
        overflow = self._overflow_check
        seq = -1 if overflow else rec.reserve(name)
        save = overflow or self._saves or self.selection.saves_tensor(name)
        if overflow:  # the inputs are checked now, summarized (and saved) at the end only if the call overflows
            record = {_RAW_INPUTS: (args, kwargs, parameters),
                      _INPUT_FLAGS: [self._overflow_flag(t) for t in self._tensors_in((args, kwargs, parameters))]}
        else:
            record = self._input_record(name, args, kwargs, parameters, save)
        call = Call(name, backward, seq, record, save, parent, self.selection.backward and grad_enabled)
        if call.grad:
            tensors = self._tensors_in((args, kwargs))
            self._bwd_sizes.setdefault(backward, [0, 0])[1] = len(tensors)
            if self.selection.keeps("backward", "output"):
                self._prepare_backward(call, tensors)
        if not overflow and self.cfg.extra_info:
            rec.put_stack(name, self._capture_stack())
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

    def _end(self, call: Call, out: Any, same_values_as: Any = None) -> None:
        """Finish ``call`` with its output."""
        with self._quiet():
            self._end_record(call, out, call.grad)

    def _end_record(self, call: Call, out: Any, grad_enabled: bool) -> None:
        rec = self.recorder or self._open_step()
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
            self._bwd_sizes.setdefault(call.backward, [0, 0])[0] = len(tensors)
            if self.selection.keeps("backward", "input"):
                parent = call.backward_parent()
                for i, t in enumerate(tensors):
                    if self._wants_grad(t):
                        self._hook_tensor_grad(t, partial(self._on_grad, call.backward, "input", i, call.save, parent))
        self._sync(record_on_device=self._on_device(tensors))

    def _on_device(self, tensors: list) -> bool:
        """Are these a device's tensors (their statistics are resolved in batches)?"""
        return False

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
        """overflow_check keeps only gradients holding Inf/NaN."""
        return self._overflow_check and not self._any_overflow([self._overflow_flag(grad)])

    def _on_grad(self, backward: str, field: str, index: int, save: bool, parent: Optional[str], grad: Any) -> None:
        rec = self.recorder
        if rec is None or grad is None:
            return None
        with self._own(backward), self._quiet():
            if self._skips_grad(grad):
                return None
            summary = self.summarizer.summarize(grad, f"{backward}.{field}.{index}", save)
            sizes = self._bwd_sizes.get(backward, [0, 0])
            fresh = backward not in rec.data
            rec.put_field(backward, [field, index], summary,
                          lambda: {"input": [None] * sizes[0], "output": [None] * sizes[1]})
            if fresh and self._construct:
                rec.put_parent(backward, parent)
            self._sync(record_on_device=self._on_device([grad]))
        return None

    # ================================================================== L0 modules
    def _install_model_hooks(self, models: list, indexed: bool, window: Optional[tuple[int, int]]) -> None:
        if any(m in self._hooked_models for m in models):
            return
        if window is not None:
            self._install_token_window(models[0], window)
        for idx, root in enumerate(models if self._uses_l0 or self.hooks_l1_models else ()):
            named = list(self._named_modules(root))
            self._before_hooking([module for _, module in named])
            if not self._uses_l0:
                continue
            prefix = f"{idx}." if indexed else ""
            for path, module in named:
                if module is not root:
                    self.hook_module(module, f"{self.module_prefix}.{prefix}{path}.{type(module).__name__}")
        self._hooked_models.extend(models)

    def hook_module(self, module: Any, base: str, exclusive: bool = False) -> list[Any]:
        """Record ``module``'s forward, backward and parameter gradients under ``base``; returns the
        forward hook handles (also removed by stop())."""
        handles = [
            module.register_forward_pre_hook(partial(self._module_pre, base, exclusive), with_kwargs=True),
            module.register_forward_hook(partial(self._module_post, base), with_kwargs=True),
        ]
        self._forward_handles.extend(handles)
        if self.selection.backward:
            for pname, p in self._own_parameters(module):
                self._hook_param_grad(p, partial(self._on_param_grad, base, pname))
        return handles

    def _module_pre(self, base: str, exclusive: bool, module: Any, args: tuple, kwargs: dict):
        if _thread_id() != self._thread:  # another thread's call: neither recorded nor in the call stacks
            self._other_thread()
            return None
        allowed = self._may_record_exclusive() if exclusive else self.should_record()
        calls = self._module_calls.setdefault(id(module), [])
        if not allowed:
            calls.append(SKIPPED)
            return None
        calls.append(SKIPPED)  # replaced below once the call is set up
        new_args = new_kwargs = None
        with self._own(base):
            n = self._counters.get(base, 0)
            self._counters[base] = n + 1
            name = f"{base}.forward.{n}"
            call = None
            if self.selection.record(name):
                parent = self._module_stack[-1] if self._module_stack else None
                call = self._begin(name, f"{base}.backward.{n}", args, kwargs, parent, self._own_parameters(module))
                self._recorded_modules.add(base)
                new_args, new_kwargs = self._call_inputs(call, args, kwargs, "")
            calls[-1] = call
            self._module_stack.append(name)
        if new_args is not None and (new_args is not args or new_kwargs is not kwargs):
            return new_args, new_kwargs  # the module runs on what _call_inputs gave
        return None

    def _module_post(self, base: str, module: Any, args: tuple, kwargs: dict, output: Any):
        if _thread_id() != self._thread:
            return None
        calls = self._module_calls.get(id(module))
        if not calls:
            return None
        call = calls.pop()
        if call is SKIPPED:
            return None
        with self._own(base):
            if self._module_stack:
                self._module_stack.pop()
            if call is not None:
                self._end(call, output)
                self.selection.call_finished(call.name)
        return None

    def _on_param_grad(self, base: str, pname: str, grad: Any) -> None:
        rec = self.recorder
        if rec is None or grad is None or base not in self._recorded_modules:
            return None
        with self._own(base), self._quiet():
            key = f"{base}#{pname}"
            k = self._counters.get(key, 0)
            self._counters[key] = k + 1
            name = f"{base}.parameters_grad.{k}"
            if self._skips_grad(grad):
                return None
            summary = self.summarizer.summarize(grad, f"{name}.{pname}", self._saves or self.selection.saves_tensor(name))
            rec.put_field(name, [pname, 0], summary, dict)
            self._sync(record_on_device=self._on_device([grad]))
        return None

    # ================================================================== token range
    def _install_token_window(self, root: Any, window: tuple[int, int]) -> None:
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
    def module_dump(self, module: Any, name: str) -> None:
        """Until ``module_dump_end()``, dump only ``module`` itself (named ``{module_prefix}.{name}.{Class}``)."""
        if not self._is_model(module):
            raise ConfigError("module", type(module).__name__, self.model_kind)
        if not isinstance(name, str) or not name:
            raise ConfigError("module_name", name, "a non-empty string")
        if not self._collecting:
            return
        self._open_step()
        self._module_dump_handles = self.hook_module(module, f"{self.module_prefix}.{name}.{type(module).__name__}",
                                                     exclusive=True)
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
        """Save ``variable`` into the step's debug.json as ``{name}.{count}.debug`` (and the gradients of its
        tensors as ``{name}_grad.{count}.debug``)."""
        if not isinstance(name, str) or not name:
            raise ConfigError("name", name, "a non-empty string")
        if self.finished:
            return
        if _thread_id() != self._thread:
            self._other_thread()
            return
        if not self._in_configured_step():
            return
        rec = self._open_debug()
        tls = self._tls
        tls.depth += 1
        try:
            n = self._counters.get(f"save#{name}", 0)
            self._counters[f"save#{name}"] = n + 1
            key = f"{name}.{n}.debug"
            with self._quiet():
                summary = self.summarizer.summarize(variable, key, self._saves)
            rec.put(key, summary, rec.reserve(key))
            if save_backward and self._grad_recording():
                self._hook_saved_grads(variable, f"{name}_grad.{n}.debug", [])
            self._sync()
        except Exception as e:  # like every recorded call: the tool never breaks the user's program
            self._error(f"save({name!r})", e)
        finally:
            tls.depth -= 1

    def _hook_saved_grads(self, obj: Any, key: str, path: list) -> None:
        if isinstance(obj, self.summarizer.tensor_types):
            if self._wants_grad(obj):
                self._hook_saved_tensor(obj, partial(self._on_saved_grad, key, list(path)))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                self._hook_saved_grads(v, key, path + [i])
        elif isinstance(obj, dict):
            for k, v in obj.items():
                self._hook_saved_grads(v, key, path + [str(k)])

    def _hook_saved_tensor(self, t: Any, hook: Callable) -> None:
        """``save()``'s gradient hook on one of its tensors (default: as a forward output's)."""
        self._hook_tensor_grad(t, hook)

    def _on_saved_grad(self, key: str, path: list, grad: Any) -> None:
        rec = self.debug_recorder
        if rec is None or grad is None:
            return None
        with self._own(key), self._quiet():
            summary = self.summarizer.summarize(grad, ".".join([key, *map(str, path)]), self._saves)
            if not path:
                rec.put(key, summary, rec.reserve(key))
            else:
                rec.put_field(key, path, summary, dict)
            self._sync()
        return None

    # ================================================================== custom APIs
    def register_custom_api(self, module: Any, api: str, api_prefix: Optional[str] = None) -> None:
        """Dump ``module.api`` as ``{api_prefix}.{api}.{n}.forward`` from now on."""
        if not isinstance(api, str) or not hasattr(module, api):
            raise ConfigError("api", api, f"the name of a callable attribute of {getattr(module, '__name__', module)!r}")
        if not callable(getattr(module, api)):
            raise ConfigError("api", api, "a callable attribute")
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

