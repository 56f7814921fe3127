"""The dump service every framework shares: the record life cycle behind ``PrecisionDebugger``.

``DumpServiceBase`` holds everything that does not touch a framework's API: start/stop/step and the
dumping-thread policy, the recording gates (collecting, token window, ``module_dump`` window, ``limit_to``),
the step's folders and recorders (``files.step_recorder``: the crash-safe journal,
dump.json/stack.json/construct.json, debug.json of ``save()``), "never overwrite" (``common.rank_folder``),
JSON files at stop() once the backward ran, close at interpreter exit (an interrupted step says so). Errors
of the tool's own work go to dump_error_info.log, never to the user's training. It is composed of:

- ``records`` (``dump.call_records.CallRecords``): the records of API and module calls (begin and end of a
  record, overflow_check, gradient records, module pre/post hooks), with the open step's
  ``dump.step_state.StepState``;
- ``user_api`` (``dump.user_api.UserApi``): ``save`` (debug.json), ``module_dump`` and custom APIs;
- its framework back-end, ``dump.backend.DumpBackend``: the documented methods a framework's subclass
  supplies (``msprobe_core.pytorch.dump_service``, ``msprobe_core.mindspore.dump_service``).

Both parts are given the service at construction and bind what they call once; the service's public
methods (``start``, ``stop``, ``step``, ``save``, ``module_dump``, ...) are what ``PrecisionDebugger`` calls.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any, Optional

from msprobe_core.common.exit_close import close_at_exit
from msprobe_core.common.rank_folder import check_not_taken, rank_folder_name
from msprobe_core.common.tool_guard import TOOL
from msprobe_core.dump.call import Call
from msprobe_core.dump.call_records import CallRecords
from msprobe_core.dump.config import DumpConfig, validate_token_range
from msprobe_core.dump.backend import DumpBackend
from msprobe_core.dump.selection import RecordSelection
from msprobe_core.dump.user_api import UserApi
from msprobe_core.errors import ConfigError
from msprobe_core.files.journal import release_spares
from msprobe_core.files.step_recorder import StepRecorder
from msprobe_core.log import setup_logging

__all__ = ["Call", "DumpServiceBase", "saves_files"]  # Call: the framework services import it from here

logger = setup_logging()

_thread_id = threading.get_ident
DEFERRED_BATCH = 512  # device statistics resolved (one host copy) every this many records
_WARNED_ERRORS = 10  # a step's first errors are also logged (a full disk must not flood the training's output)


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


def saves_files(cfg: DumpConfig) -> bool:
    """Does this configuration write tensor files (task tensor, overflow_check: the overflowing calls'
    tensors, or a tensor_list)?"""
    return cfg.task in ("tensor", "overflow_check") or bool(cfg.tensor_list)


class DumpServiceBase(DumpBackend):
    """One process's dump: configuration, current step, the recording gates and the step's recorders,
    composed of its ``records`` (``CallRecords``) and ``user_api`` (``UserApi``); a framework's subclass
    is its back-end (the ``DumpBackend`` methods).

    What its parts read of it (besides the back-end's methods and ``_open_step``, ``_open_debug``,
    ``_sync``, ``_own``, ``_error``, ``_other_thread``, ``_in_configured_step``): ``cfg``, ``selection``,
    ``summarizer``, ``recorder``, ``debug_recorder``, ``dumping_thread``, ``collecting``, ``finished``,
    ``forward_handles``, ``uses_l0``, ``saves_tensors``; ``set_exclusive`` opens and closes the
    ``module_dump`` window."""

    def __init__(self, cfg: DumpConfig, summarizer: Any, files: Any = None):
        self.cfg = cfg
        self.selection = RecordSelection(cfg)
        self.summarizer = summarizer
        self.files = files
        self.patcher: Any = None  # set_patcher()
        self.current_step = 0
        self.finished = False
        self._tls = TOOL  # shared with the monitor: > 0 inside any of the toolkit's own work
        self._collecting = False       # between start() and stop()
        self._token_ok = True          # inside token_range (or no token_range)
        self._exclusive: Any = None    # module_dump() window
        self._inside = True            # inside the module given to limit_to() (or no such module)
        self._recording = False        # the conjunction of the four above, kept current
        self._rank_id: Optional[int] = None
        self._checked_dirs: set[str] = set()
        self.recorder: Optional[StepRecorder] = None
        self.last_rank_dir: Optional[Path] = None  # the rank folder whose dump.json the last finished step wrote
        self.debug_recorder: Optional[StepRecorder] = None
        self._uses_l1 = cfg.level in ("L1", "mix")
        self.uses_l0 = cfg.level in ("L0", "mix")
        self.saves_tensors = cfg.task == "tensor"
        self.forward_handles: list[Any] = []   # removed at stop()
        self._step_handles: list[Any] = []      # gradient hooks: removed at step()
        self._deferred = 0
        self.dumping_thread = _thread_id()  # the one that called start() (see _other_thread)
        self._other_threads: set[int] = set()
        self._closes_at_exit = False  # registered with the first step folder (a service never used holds nothing)
        self.records = CallRecords(self, self)  # the service is its own back-end (a framework's subclass)
        self.user_api = UserApi(self, self, self.records)
        # the records' entries a back-end gives its patchers and hooks
        self._on_api_call = self.records.on_api_call
        self._on_grad = self.records.on_grad
        self._end_record = self.records.end_record

    def set_patcher(self, patcher: Any) -> None:
        """The back-end's L1 API patcher (``prepare``/``patch``/``restore``/``call``), or None; a bad wrap
        list fails here, not mid-training."""
        self.patcher = self.records.patcher = patcher
        if patcher is not None:
            patcher.prepare()

    # ================================================================== what users call by name
    def save(self, variable: Any, name: str, save_backward: bool = True) -> None:
        """``UserApi.save``."""
        self.user_api.save(variable, name, save_backward)

    def module_dump(self, module: Any, name: str) -> None:
        """``UserApi.module_dump``."""
        self.user_api.module_dump(module, name)

    def module_dump_end(self) -> None:
        """``UserApi.module_dump_end``."""
        self.user_api.module_dump_end()

    def register_custom_api(self, module: Any, api: str, api_prefix: Optional[str] = None) -> None:
        """``UserApi.register_custom_api``."""
        self.user_api.register_custom_api(module, api, api_prefix)

    def restore_custom_api(self, module: Any, api: str) -> None:
        """``UserApi.restore_custom_api``."""
        self.user_api.restore_custom_api(module, api)

    def hook_module(self, module: Any, base: str, exclusive: bool = False) -> list[Any]:
        """``CallRecords.hook_module``."""
        return self.records.hook_module(module, base, exclusive)

    # ================================================================== life cycle
    @property
    def collecting(self) -> bool:
        """Between start() and stop()."""
        return self._collecting

    def set_exclusive(self, module: Any) -> None:
        """Record only ``module`` (``module_dump``), or everything again (None)."""
        self._exclusive = module
        self._update_recording()

    def _update_recording(self) -> None:
        self._recording = self._collecting and self._token_ok and self._exclusive is None and self._inside

    def should_record(self) -> bool:
        """Hot path of every wrapped API: record this call? Only the dumping thread's calls are recorded
        (``_other_thread``)."""
        if not (self._recording and self._tls.depth == 0):
            return False
        return _thread_id() == self.dumping_thread or self._other_thread()

    def _may_record_exclusive(self) -> bool:
        """Inside a ``module_dump`` window: may the module given to it record now?"""
        return self._collecting and self._tls.depth == 0

    def _end(self, call: Call, out: Any, same_values_as: Any = None) -> None:
        """Finish ``call``'s record with its output (``same_values_as``: an input the output only
        rearranges, for a back-end that reuses its statistics)."""
        with self._quiet():
            self._end_record(call, out, call.grad)

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
        if self.uses_l0 and model is None and not self.records.hooked_models:
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
        self.dumping_thread = _thread_id()
        if models and not self.records.hooked(models):
            if window is not None:
                self._install_token_window(models[0], window)
            self.records.install_model_hooks(models, isinstance(model, (list, tuple)))
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
        for h in self.forward_handles:
            h.remove()
        self.forward_handles.clear()
        self.records.forget_models()
        self._token_ok = True  # the token window (if any) ends with its hooks
        self._inside = True  # and so does limit_to()'s
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
            release_spares()  # no step journals after this one: no spare journal stays in its folder
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
            release_spares()
            self.user_api.restore_all()
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
        self.records.new_step()
        self.selection.reset_step()
        self.summarizer.reset()

    # ================================================================== folders
    def _rank(self) -> Optional[int]:
        return self._rank_id if self._rank_id is not None else self._current_rank()

    def _rank_dir(self) -> Path:
        if not self._closes_at_exit:
            close_at_exit(self._close_at_exit)
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
            if self.saves_tensors:
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
        self.forward_handles.append(root.register_forward_pre_hook(pre, prepend=True))
