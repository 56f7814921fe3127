"""The PyTorch dump service: hooks, naming and step life cycle behind ``PrecisionDebugger``.

Decide once, run fast: the API patch plan and the module hook plan are built when dumping starts; a call
that is not recorded costs one flag test. Gradients are captured with tensor hooks that return None
(never ``register_full_backward_hook``, which inserts identity nodes and can change the order in which
autograd sums gradients), so losses and gradients are bit-identical with the tool on or off.

Backward records: ``input`` holds the gradients of the call's outputs; ``output`` the gradients of its
tensor inputs, as autograd delivers them to each input tensor (for an input that other calls also use,
this is its full gradient, summed over every use).
"""

from __future__ import annotations

import atexit
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from msprobe_core.dump.call_stack import StackCapture
from msprobe_core.dump.config import DumpConfig
from msprobe_core.dump.selection import Selection
from msprobe_core.dump.step_recorder import StepRecorder
from msprobe_core.errors import ConfigError, DumpPathError, TokenRangeError
from msprobe_core.pytorch.api_patch import ApiPatcher, make_wrapper
from msprobe_core.pytorch.summarize import Summarizer, tensors_in
from msprobe_core.pytorch.tensor_stats import has_inf_or_nan
from msprobe_core.pytorch.pt_writer import TensorFiles
from msprobe_core.pytorch.tool_guard import TOOL

from msprobe_core.log import setup_logging

logger = setup_logging()

_graph_task_id = torch._C._current_graph_task_id
_is_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_no_torch_function = torch._C.DisableTorchFunction  # the tool's own tensor work skips every TorchFunctionMode
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEFERRED_BATCH = 512  # device statistics resolved (one host copy) every this many records


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


def validate_token_range(token_range: Any) -> Optional[tuple[int, int]]:
    """``None`` or two ints [start, end] with 0 <= start <= end; else ``TokenRangeError``."""
    if token_range is None:
        return None
    if (not isinstance(token_range, (list, tuple)) or len(token_range) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in token_range)
            or token_range[0] < 0 or token_range[0] > token_range[1]):
        raise TokenRangeError(token_range)
    return int(token_range[0]), int(token_range[1])


def current_rank() -> Optional[int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return None


_STACKS = StackCapture((_OWN_DIR,), ("torch/nn/modules/module.py", "torch/utils/hooks.py"))
capture_stack = _STACKS.capture


# APIs whose output holds exactly the input's values (same multiset): statistics are shared, not recomputed
_SAME_VALUES = frozenset({"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "contiguous",
                          "flatten", "squeeze", "unsqueeze", "movedim", "swapaxes", "swapdims", "clone", "detach",
                          "unflatten", "adjoint"})

_SKIPPED = object()  # a module call the tool did not look at (not recording, or nested in a recorded API)


class _Call:
    """A recorded forward call between its start and its end."""

    __slots__ = ("name", "backward", "seq", "record", "save", "parent")

    def __init__(self, name, backward, seq, record, save, parent):
        self.name = name
        self.backward = backward
        self.seq = seq
        self.record = record
        self.save = save
        self.parent = parent


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
        self.debug_recorder: Optional[StepRecorder] = None
        self._uses_l1 = cfg.level in ("L1", "mix")
        self._uses_l0 = cfg.level in ("L0", "mix")
        self._construct = cfg.level in ("L0", "mix")
        self.patcher = ApiPatcher(self._on_api_call, self.should_record, wrap_list,
                                   silence=self._silenced) if self._uses_l1 else None
        if self.patcher is not None:
            self.patcher.prepare()  # a bad wrap list fails here, not mid-training
        saves = cfg.task == "tensor" or bool(cfg.tensor_list)
        self.files = TensorFiles() if saves else None
        self.summarizer = Summarizer(statistics=cfg.task != "structure", md5=cfg.summary_mode == "md5", files=self.files)
        self._saves = cfg.task == "tensor"
        self._counters: dict[str, int] = {}
        self._module_stack: list[str] = []
        self._module_calls: dict[int, list[Optional[_Call]]] = {}
        self._bwd_sizes: dict[str, list[int]] = {}
        self._forward_handles: list[Any] = []   # removed at stop()
        self._step_handles: list[Any] = []      # grad hooks on leaves: removed at step()
        self._hooked_models: list[torch.nn.Module] = []
        self._recorded_modules: set[str] = set()
        self._overflows = 0
        self._deferred = 0
        self._custom: dict[tuple[int, str], tuple[Any, Any, bool]] = {}
        self._module_dump_handles: list[Any] = []
        atexit.register(self.close)

    # ================================================================== life cycle
    def _update_recording(self) -> None:
        self._recording = self._collecting and self._token_ok and self._exclusive is None

    def should_record(self) -> bool:
        """Hot path of every wrapped API: record this call?"""
        return self._recording and self._tls.depth == 0 and _graph_task_id() == -1

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
        # every tensor file is on disk; with async_dump the writer finishes them while training goes on
        # (close(), also at exit, waits), and a file that fails is logged beside it by the writer
        failed = self.files.flush() if self.files is not None and not self.cfg.async_dump else 0
        self._sync(force=True)  # every statistic on the host, for both recorders at once
        for rec in (self.recorder, self.debug_recorder):
            if rec is not None and rec.has_content:
                if failed:
                    rec.log_error(f"{failed} tensor files could not be written (see the writer's messages)")
                rec.finish()
                logger.info("%s is at %s", rec.json_name, rec.rank_dir)
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
        rank = self._rank()
        name = f"rank{rank}" if rank is not None else f"proc{os.getpid()}"
        if name not in self._checked_dirs:
            self._check_not_taken(name)
            self._checked_dirs.add(name)
        return Path(self.cfg.dump_path) / f"step{self.current_step}" / name

    def _check_not_taken(self, rank_dir_name: str) -> None:
        root = Path(self.cfg.dump_path)
        if root.exists() and not root.is_dir():
            raise DumpPathError(f"dump_path '{root}' is a file; allowed: a directory or a path that does not exist yet")
        if not root.is_dir():
            return
        taken = sorted(p for p in root.glob(f"step*/{rank_dir_name}") if p.is_dir() and any(p.iterdir()))
        if taken:
            raise DumpPathError(
                f"dump_path '{root}' already holds a dump for {rank_dir_name} ({taken[0]}); a dump never "
                "overwrites another run's files: choose a new dump_path or remove the old dump")

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
        if self.recorder is not None:
            self.recorder.sync_journal()
        if self.debug_recorder is not None:
            self.debug_recorder.sync_journal()

    def _own(self, where: str) -> _OwnWork:
        return _OwnWork(self, where)

    def _error(self, where: str, exc: BaseException) -> None:
        rec = self.recorder or self._open_step()
        rec.log_error(f"{where}: {exc!r}")
        logger.warning("error while dumping %s: %r (see dump_error_info.log)", where, exc)

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
            if call is not None:
                try:
                    self._end(call, out, args[0] if api in _SAME_VALUES and args else None)
                except Exception as e:
                    self._error(name, e)
            self.selection.call_finished(name)
            return out
        finally:
            tls.depth -= 1

    # ================================================================== shared record logic
    def _begin(self, name: str, backward: str, args: tuple, kwargs: dict, parent: Optional[str],
               parameters: Optional[Sequence[tuple[str, torch.Tensor]]] = None) -> _Call:
        with _no_torch_function(), _no_grad() as grad_enabled:
            return self._begin_inner(name, backward, args, kwargs, parent, parameters, grad_enabled)

    def _begin_inner(self, name, backward, args, kwargs, parent, parameters, grad_enabled) -> _Call:
        rec = self.recorder or self._open_step()
        overflow = self.cfg.task == "overflow_check"
        seq = -1 if overflow else rec.reserve(name)
        save = self._saves or self.selection.saves_tensor(name)
        keep_in = self.selection.forward and self.selection.keeps("forward", "input")
        summarize = self.summarizer.summarize
        record: dict[str, Any] = {
            "input_args": summarize(list(args), f"{name}.input", save) if keep_in else [],
            "input_kwargs": summarize(kwargs, f"{name}.input", save) if keep_in else {},
        }
        if parameters is not None:
            record["parameters"] = {p: summarize(t, f"{name}.parameters.{p}", save) for p, t in parameters} if keep_in else {}
        call = _Call(name, backward, seq, record, save, parent)
        if self.selection.backward and grad_enabled:
            tensors = tensors_in((args, kwargs))
            self._bwd_sizes.setdefault(backward, [0, 0])[1] = len(tensors)
            if self.selection.keeps("backward", "output"):
                self._hook_grads(tensors, call, "output")
        if not overflow and self.cfg.extra_info:
            rec.put_stack(name, capture_stack(3))
        return call

    def _end(self, call: _Call, out: Any, same_values_as: Any = None) -> None:
        """Finish ``call`` with its output; ``same_values_as`` is an input the output only rearranges (a view,
        reshape, ...): its statistics are reused."""
        with _no_torch_function(), _no_grad() as grad_enabled:
            if same_values_as is not None and type(out) is torch.Tensor and isinstance(same_values_as, torch.Tensor) \
                    and out.dtype == same_values_as.dtype and out.numel() == same_values_as.numel():
                self.summarizer.share(same_values_as, out)
            self._end_inner(call, out, grad_enabled)

    def _end_inner(self, call: _Call, out: Any, grad_enabled: bool) -> None:
        rec = self.recorder or self._open_step()
        outputs = list(out) if isinstance(out, (list, tuple)) else [out]
        keep_out = self.selection.forward and self.selection.keeps("forward", "output")
        if self.cfg.task == "overflow_check":
            if not self._overflowed(outputs):
                return
            call.seq = rec.reserve(call.name)
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

    def _overflowed(self, outputs: list) -> bool:
        if self.cfg.overflow_nums != -1 and self._overflows >= self.cfg.overflow_nums:
            return False
        flags = [has_inf_or_nan(t) for t in tensors_in(outputs)]
        if not flags or not bool(torch.stack([f.to("cpu") for f in flags]).any()):
            return False
        self._overflows += 1
        if self.cfg.overflow_nums != -1 and self._overflows >= self.cfg.overflow_nums:
            logger.warning("overflow_nums=%d reached; no further overflow is recorded", self.cfg.overflow_nums)
        return True

    def _hook_grads(self, tensors: list, call: _Call, field: str) -> None:
        for i, t in enumerate(tensors):
            if not t.requires_grad:
                continue
            handle = t.register_hook(partial(self._on_grad, call.backward, field, i, call.save,
                                             call.parent.replace(".forward", ".backward") if call.parent else None))
            if t.is_leaf:  # hooks on leaves outlive the graph: remove them when the step ends
                self._step_handles.append(handle)

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
                if p is not None and p.requires_grad:
                    self._step_handles.append(p.register_hook(partial(self._on_param_grad, base, pname)))
        return handles

    def _module_pre(self, base: str, exclusive: bool, module, args, kwargs):
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
        finally:
            tls.depth -= 1

    def _hook_saved_grads(self, obj: Any, key: str, path: list) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
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
        owned = api in getattr(module, "__dict__", {})
        self._custom[(id(module), api)] = (module, module.__dict__.get(api, original) if owned else original, owned)
        setattr(module, api, make_wrapper(original, prefix, api, self._on_api_call, self.should_record))

    def restore_custom_api(self, module: Any, api: str) -> None:
        entry = self._custom.pop((id(module), api), None)
        if entry is None:
            return
        owner, original, owned = entry
        if owned:
            setattr(owner, api, original)
        else:
            delattr(owner, api)


def _check_model(model: Any) -> None:
    models = model if isinstance(model, (list, tuple)) else [model]
    if not models or not all(isinstance(m, torch.nn.Module) for m in models):
        raise ConfigError("model", type(model).__name__, "a torch.nn.Module, or a list/tuple of them")
