"""vLLM integration: dump only the forward passes that produce tokens ``start..end`` (msprobe's ``token_range``).

    session = dump_tokens(llm, "config.json", [1, 3])
    llm.generate(prompts, sampling_params)
    session.finish()    # stop() + step() in every worker: dump.json written, one rank folder per worker

or ``with dump_tokens(llm, "config.json", [1, 3]): llm.generate(...)``. This module is thin: it finds the
model(s), checks that the engine runs eagerly, and drives ``PrecisionDebugger`` where the model lives. The
token counting and every file are the dump core's (``msprobe_core.pytorch``).

Where the model is (``route``):

* ``in_process``: vLLM V0, or V1 with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; msprobe's documented path
  ``llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()`` and its variants
  (``IN_PROCESS_PATHS``). Used when the LLM has no ``collective_rpc``.
* ``collective_rpc``: the V1 engine keeps the model in worker processes. ``LLM.collective_rpc`` runs
  ``worker_start`` / ``worker_finish`` (module-level functions of this file) with each worker object; the
  worker's rank names its folder (``rank{R}``). vLLM ships a callable to its engine process only with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the environment *before* ``LLM(...)`` is created.
* ``extension``: the same without pickled callables: create the LLM with
  ``worker_extension_cls="msprobe_integrations.vllm.MsprobeWorkerExtension"``; then only method names and
  plain arguments (a config path or dict, two ints, a path) travel. Chosen automatically when configured.
* ``apply_model``: ``LLM.apply_model(func)`` runs ``func(model)`` in each worker (no worker object: the
  folder is named by ``torch.distributed``'s rank, or ``proc{pid}``). Used when ``collective_rpc`` is missing.

Eager mode: CUDA graphs replay captured kernels without running Python, and vLLM's torch.compile dispatches
straight to compiled code, so neither the token counter (a forward-pre-hook on the root model) nor the dump
hooks would fire. ``dump_tokens`` refuses with ``EagerModeRequiredError`` unless the engine runs eagerly:
create the LLM with ``enforce_eager=True``. The check runs on the engine's config in this process and again
inside every worker.

Counting (the core's): forward call 0 is the prefill, each later call one engine step. Under continuous
batching one step produces one token for every running request; chunked prefill of a long prompt,
speculative decoding and requests that arrive mid-generation break the one-call-per-token mapping (as in
msprobe). Create the debugger's engine first and call ``dump_tokens`` after ``LLM(...)``: vLLM's profiling and
warm-up forward passes at start-up must not be counted.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from msprobe_core.dump.config import load_dump_config
from msprobe_core.errors import ConfigError, DumpStateError, MsprobeError
from msprobe_core.log import setup_logging
from msprobe_core.pytorch.debugger import PrecisionDebugger
from msprobe_core.pytorch.dump_service import current_rank, validate_token_range

setup_logging()
logger = logging.getLogger("msprobe_core.vllm")

EXTENSION_CLASS = "msprobe_integrations.vllm.MsprobeWorkerExtension"
"""The ``worker_extension_cls`` value that lets ``dump_tokens`` call workers by method name."""

INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"

ROUTES = ("auto", "in_process", "collective_rpc", "extension", "apply_model")

IN_PROCESS_PATHS = (
    "llm_engine.model_executor.driver_worker.worker.model_runner.get_model()",  # msprobe's documented path
    "llm_engine.model_executor.driver_worker.worker.model_runner.model",
    "llm_engine.model_executor.driver_worker.model_runner.get_model()",
    "llm_engine.model_executor.driver_worker.model_runner.model",
    "llm_engine.model_executor.driver_worker.worker.get_model()",
    "llm_engine.model_executor.driver_worker.get_model()",
)
"""Attribute paths from an ``LLM`` to its model when the engine runs in this process (V0 and in-process V1)."""

WORKER_MODEL_PATHS = (
    "get_model()",
    "model_runner.get_model()",
    "model_runner.model",
    "worker.get_model()",
    "worker.model_runner.get_model()",
    "worker.model_runner.model",
)
"""Attribute paths from a vLLM worker (or its ``WorkerWrapperBase``) to the model."""

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any]]


# ============================================================================================ errors
class EagerModeRequiredError(MsprobeError, ValueError):
    """The engine runs the model under CUDA graphs or torch.compile, which bypass Python hooks."""

    def __init__(self, reasons: Sequence[str], where: Optional[str] = None):
        self.reasons = list(reasons)
        self.where = where or "the vLLM engine"
        super().__init__(
            f"token_range dumping needs vLLM in eager mode, but in {self.where}: " + "; ".join(self.reasons)
            + ". Captured CUDA graphs and compiled code do not run Python hooks, so neither the token counter "
            "nor the dump would see the forward passes. Create the engine with LLM(..., enforce_eager=True) "
            "and without a compilation_config that turns torch.compile on.")


class WorkerDumpError(MsprobeError, RuntimeError):
    """Starting or finishing the dump failed inside a vLLM worker (the message carries the worker's error)."""


# ======================================================================================= eager check
def _mode_is_off(value: Any) -> Optional[bool]:
    """True when a compilation / CUDA-graph mode means off, False when on, None when it does not say."""
    if value is None:
        return None
    if isinstance(value, bool):
        return not value
    name = getattr(value, "name", None)  # vLLM's CompilationMode / CompilationLevel / CUDAGraphMode enums
    if isinstance(name, str):
        return name.upper() in ("NONE", "NO_COMPILATION")
    if isinstance(value, int):
        return value == 0
    if isinstance(value, str):
        return value.strip().upper() in ("NONE", "NO_COMPILATION", "0")
    return None


def _show(value: Any) -> str:
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else repr(value)


def eager_mode_problems(vllm_config: Any) -> Optional[list[str]]:
    """What in a vLLM config would bypass Python hooks: ``[]`` when the model runs eagerly, ``None`` when the
    object says nothing about it (no ``model_config.enforce_eager`` and no ``compilation_config``).

    Reads ``model_config.enforce_eager`` and ``compilation_config.mode`` (``level`` in older vLLM),
    ``cudagraph_mode`` (``use_cudagraph`` in older vLLM). Without ``enforce_eager=True`` and without an explicit
    ``cudagraph_mode`` of NONE, CUDA graphs count as on (vLLM captures them for decode by default).
    """
    if vllm_config is None:
        return None
    model_config = getattr(vllm_config, "model_config", None)
    compilation = getattr(vllm_config, "compilation_config", None)
    enforce_eager = getattr(model_config, "enforce_eager", None)
    if enforce_eager is None and compilation is None:
        return None
    problems: list[str] = []
    for field in ("mode", "level"):
        mode = getattr(compilation, field, None)
        if mode is not None:
            if _mode_is_off(mode) is False:
                problems.append(f"torch.compile is on (compilation_config.{field}={_show(mode)})")
            break
    if enforce_eager is not True:
        graphs = getattr(compilation, "cudagraph_mode", None)
        use_graphs = getattr(compilation, "use_cudagraph", None)
        if graphs is not None:
            on, why = _mode_is_off(graphs) is not True, f"compilation_config.cudagraph_mode={_show(graphs)}"
        elif use_graphs is not None:
            on, why = bool(use_graphs), f"compilation_config.use_cudagraph={use_graphs!r}"
        else:
            on, why = True, "vLLM captures CUDA graphs unless enforce_eager=True"
        if on:
            problems.append(f"CUDA graphs are on (model_config.enforce_eager={enforce_eager!r}, {why})")
    return problems


def check_eager_mode(vllm_config: Any, where: Optional[str] = None) -> bool:
    """Raise ``EagerModeRequiredError`` when ``vllm_config`` runs the model under CUDA graphs or torch.compile;
    return True when the config shows eager execution and False when it says nothing."""
    problems = eager_mode_problems(vllm_config)
    if problems:
        raise EagerModeRequiredError(problems, where)
    return problems is not None


# ==================================================================================== finding things
def _walk(obj: Any, path: str) -> Any:
    """Follow ``a.b.get_model()``-style paths; None as soon as a step is missing."""
    for part in path.split("."):
        call = part.endswith("()")
        name = part[:-2] if call else part
        try:
            obj = getattr(obj, name)
        except AttributeError:  # includes WorkerWrapperBase.__getattr__ on a missing worker attribute
            return None
        if obj is None:
            return None
        if call:
            if not callable(obj):
                return None
            try:
                obj = obj()
            except (AttributeError, NotImplementedError):
                return None
            if obj is None:
                return None
    return obj


def _as_module(obj: Any) -> Optional[torch.nn.Module]:
    """The ``nn.Module`` itself, or the module a graph wrapper runs (``.runnable``), else None."""
    for _ in range(3):
        if isinstance(obj, torch.nn.Module):
            return obj
        obj = getattr(obj, "runnable", None)
        if obj is None:
            return None
    return None


def _first_module(root: Any, paths: Iterable[str]) -> Optional[tuple[torch.nn.Module, str]]:
    for path in paths:
        module = _as_module(_walk(root, path))
        if module is not None:
            return module, path
    return None


def find_in_process_model(llm: Any) -> Optional[tuple[torch.nn.Module, str]]:
    """``(model, path)`` when the engine's model lives in this process (``IN_PROCESS_PATHS``), else None."""
    return _first_module(llm, IN_PROCESS_PATHS)


def find_vllm_config(llm: Any) -> Any:
    """The engine's ``VllmConfig`` (``llm.llm_engine.vllm_config``), a stand-in built from the engine's
    ``model_config`` / ``compilation_config``, or None."""
    engine = getattr(llm, "llm_engine", None)
    for owner in (engine, llm):
        config = getattr(owner, "vllm_config", None)
        if config is not None:
            return config
    model_config = getattr(engine, "model_config", None)
    if model_config is None:
        return None
    return SimpleNamespace(model_config=model_config,
                           compilation_config=getattr(engine, "compilation_config", None),
                           parallel_config=getattr(engine, "parallel_config", None))


def _uses_extension(vllm_config: Any) -> bool:
    ext = getattr(getattr(vllm_config, "parallel_config", None), "worker_extension_cls", None)
    if isinstance(ext, str):
        return ext == EXTENSION_CLASS or ext.rsplit(".", 1)[-1] == MsprobeWorkerExtension.__name__
    return isinstance(ext, type) and issubclass(ext, MsprobeWorkerExtension)


def _engine_out_of_process(llm: Any) -> bool:
    """True when requests to the engine are serialized to another process (vLLM V1's multiprocess client)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return core is not None and "inproc" not in type(core).__name__.lower()


def _insecure_serialization_allowed() -> bool:
    return os.environ.get(INSECURE_SERIALIZATION_ENV, "0").strip() not in ("", "0")


# ============================================================================ inside a worker / here
def _worker_config(worker: Any) -> Any:
    for path in ("vllm_config", "worker.vllm_config"):
        config = _walk(worker, path)
        if config is not None:
            return config
    model_config = getattr(worker, "model_config", None)
    if model_config is None:
        return None
    return SimpleNamespace(model_config=model_config, compilation_config=getattr(worker, "compilation_config", None))


def worker_rank(worker: Any) -> Optional[int]:
    """The folder rank of a worker: ``torch.distributed``'s rank (global, vLLM initializes it in every
    worker), else the worker's own ``rank`` / ``rpc_rank`` / ``local_rank``, else None (``proc{pid}``)."""
    rank = current_rank()
    if rank is not None:
        return rank
    for name in ("rank", "rpc_rank", "local_rank"):
        try:
            value = getattr(worker, name, None)
        except Exception:  # a wrapper whose worker is not built yet
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def _start_here(model: torch.nn.Module, config: ConfigSource, token_range: Sequence[int], dump_path: Optional[str],
                rank_id: Optional[int], vllm_config: Any, where: str) -> dict[str, Any]:
    """Check eager mode, then ``PrecisionDebugger(config).start(model, token_range, rank_id)`` in this process."""
    problems = eager_mode_problems(vllm_config)
    base = {"rank": rank_id, "pid": os.getpid()}
    if problems:
        return {**base, "ok": False, "kind": "eager", "reasons": problems, "where": where}
    if problems is None:
        logger.warning("%s has no vLLM config to check for eager mode; make sure the engine was "
                       "created with enforce_eager=True", where)
    debugger = PrecisionDebugger(config, dump_path=dump_path)
    debugger.start(model=model, token_range=list(token_range), rank_id=rank_id)
    return {**base, "ok": True, "model": type(model).__name__, "dump_path": str(Path(debugger.config.dump_path).absolute()),
            "step": debugger.service.current_step}


def _finish_here(rank_id: Optional[int]) -> dict[str, Any]:
    """``stop()`` + ``step()`` of this process's debugger; reports the rank folder that was written."""
    base = {"rank": rank_id, "pid": os.getpid()}
    try:
        PrecisionDebugger.stop()  # class-level: DumpStateError when no debugger exists in this process
    except DumpStateError:
        return {**base, "ok": False, "kind": "error", "error": "no msprobe dump was started in this process"}
    debugger = PrecisionDebugger()  # the existing singleton
    step = debugger.service.current_step
    debugger.step()
    rank = rank_id if rank_id is not None else current_rank()
    name = f"rank{rank}" if rank is not None else f"proc{os.getpid()}"  # the core's folder naming
    folder = Path(debugger.config.dump_path).absolute() / f"step{step}" / name
    return {**base, "ok": True, "rank_dir": str(folder) if (folder / "dump.json").is_file() else None}


def _failure(exc: BaseException, rank: Optional[int]) -> dict[str, Any]:
    return {"ok": False, "kind": "error", "error": f"{type(exc).__name__}: {exc}", "rank": rank, "pid": os.getpid()}


def worker_start(worker: Any, config: ConfigSource, token_range: Sequence[int],
                 dump_path: Optional[str] = None) -> dict[str, Any]:
    """Runs inside a vLLM worker (``collective_rpc``): find the model, check eager mode, start the dump.
    Returns a small dict (``ok``, ``rank``, ``pid``, and ``error`` / ``reasons`` on failure); never raises."""
    rank = None
    try:
        rank = worker_rank(worker)
        found = _first_module(worker, WORKER_MODEL_PATHS)
        if found is None:
            return {"ok": False, "kind": "error", "rank": rank, "pid": os.getpid(),
                    "error": f"no torch.nn.Module found in the worker ({type(worker).__name__}); tried "
                             + ", ".join(WORKER_MODEL_PATHS)}
        window = validate_token_range(list(token_range))
        return _start_here(found[0], config, window, dump_path, rank, _worker_config(worker), f"worker rank {rank}")
    except Exception as e:  # reported to the caller, who raises WorkerDumpError
        return _failure(e, rank)


def worker_finish(worker: Any) -> dict[str, Any]:
    """Runs inside a vLLM worker: ``stop()`` + ``step()``, so the worker's dump.json is written."""
    rank = None
    try:
        rank = worker_rank(worker)
        return _finish_here(rank)
    except Exception as e:
        return _failure(e, rank)


def model_start(config: ConfigSource, token_range: Sequence[int], dump_path: Optional[str], model: Any) -> dict[str, Any]:
    """``apply_model`` form of ``worker_start`` (bind the first three arguments with ``functools.partial``)."""
    rank = current_rank()
    try:
        module = _as_module(model)
        if module is None:
            return {"ok": False, "kind": "error", "rank": rank, "pid": os.getpid(),
                    "error": f"apply_model gave a {type(model).__name__}, not a torch.nn.Module"}
        window = validate_token_range(list(token_range))
        return _start_here(module, config, window, dump_path, rank, None, f"worker pid {os.getpid()}")
    except Exception as e:
        return _failure(e, rank)


def model_finish(model: Any) -> dict[str, Any]:
    """``apply_model`` form of ``worker_finish``."""
    try:
        return _finish_here(current_rank())
    except Exception as e:
        return _failure(e, current_rank())


class MsprobeWorkerExtension:
    """vLLM worker extension: ``LLM(..., worker_extension_cls="msprobe_integrations.vllm.MsprobeWorkerExtension")``
    adds these methods to every worker, so ``dump_tokens`` calls them by name and nothing is pickled."""

    def msprobe_start(self, config: ConfigSource, token_range: Sequence[int],
                      dump_path: Optional[str] = None) -> dict[str, Any]:
        """Start the token_range dump in this worker (see ``worker_start``)."""
        return worker_start(self, config, token_range, dump_path)

    def msprobe_finish(self) -> dict[str, Any]:
        """Stop and write this worker's dump (see ``worker_finish``)."""
        return worker_finish(self)


# ============================================================================================ client
def _collective_rpc(llm: Any, method: Union[str, Callable[..., Any]], args: tuple = ()) -> list[Any]:
    try:
        return list(llm.collective_rpc(method, args=args))
    except TypeError as e:
        if INSECURE_SERIALIZATION_ENV in str(e):
            raise _insecure_error() from e
        raise


def _apply_model(llm: Any, func: Callable[[Any], Any]) -> list[Any]:
    try:
        return list(llm.apply_model(func))
    except TypeError as e:
        if INSECURE_SERIALIZATION_ENV in str(e):
            raise _insecure_error() from e
        raise


def _insecure_error() -> ConfigError:
    return ConfigError(
        INSECURE_SERIALIZATION_ENV, os.environ.get(INSECURE_SERIALIZATION_ENV),
        f"'1' in the environment before LLM(...) is created (vLLM then pickles the function that installs the "
        f"hooks in each worker), or create the LLM with worker_extension_cls='{EXTENSION_CLASS}'")


def _check_results(results: Any, what: str) -> list[dict[str, Any]]:
    results = list(results or [])
    if not results:
        raise WorkerDumpError(f"{what}: the engine answered for no worker")
    for r in results:
        if not isinstance(r, Mapping):
            raise WorkerDumpError(f"{what}: unexpected worker answer {r!r}")
    eager = [r for r in results if not r.get("ok") and r.get("kind") == "eager"]
    if eager:
        raise EagerModeRequiredError(eager[0].get("reasons", []), eager[0].get("where"))
    failed = [r for r in results if not r.get("ok")]
    if failed:
        raise WorkerDumpError(f"{what} failed in " + "; ".join(
            f"worker rank {r.get('rank')} (pid {r.get('pid')}): {r.get('error')}" for r in failed))
    return [dict(r) for r in results]


class TokenDump:
    """A running token_range dump in one vLLM engine (returned by ``dump_tokens``).

    ``workers``: one dict per worker (``rank``, ``pid``, ``model``, ``dump_path``, ``step``). ``finish()`` stops
    and writes every worker's dump and returns the rank folders; also called on leaving a ``with`` block.
    """

    def __init__(self, llm: Any, route: str, workers: list[dict[str, Any]]):
        self.llm = llm
        self.route = route
        self.workers = workers
        self.rank_dirs: list[str] = []
        self.finished = False

    def finish(self) -> list[str]:
        """``stop()`` + ``step()`` in every worker (once); the rank folders that hold a dump.json."""
        if self.finished:
            return self.rank_dirs
        results = _check_results(_run_finish(self.llm, self.route), "finishing the dump")
        self.finished = True
        self.rank_dirs = sorted(r["rank_dir"] for r in results if r.get("rank_dir"))
        return self.rank_dirs

    def __enter__(self) -> "TokenDump":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
            return
        try:  # flush what was recorded, without hiding the original error
            self.finish()
        except Exception as e:
            logger.warning("finishing the dump after an error failed too: %r", e)

    def __repr__(self) -> str:
        return f"TokenDump(route={self.route!r}, workers={len(self.workers)}, finished={self.finished})"


def _run_finish(llm: Any, route: str) -> list[Any]:
    if route == "in_process":
        return [_finish_here(None)]
    if route == "extension":
        return _collective_rpc(llm, "msprobe_finish")
    if route == "collective_rpc":
        return _collective_rpc(llm, worker_finish)
    return _apply_model(llm, model_finish)


def _choose_route(llm: Any, route: str, vllm_config: Any) -> str:
    if route not in ROUTES:
        raise ConfigError("route", route, ", ".join(ROUTES))
    has_rpc = callable(getattr(llm, "collective_rpc", None))
    if route == "auto":
        if has_rpc:
            return "extension" if _uses_extension(vllm_config) else "collective_rpc"
        if find_in_process_model(llm) is not None:
            return "in_process"
        if callable(getattr(llm, "apply_model", None)):
            return "apply_model"
        raise ConfigError("llm", type(llm).__name__,
                          "a vllm.LLM: one with collective_rpc / apply_model (vLLM V1), or whose engine runs in this "
                          "process (llm.llm_engine.model_executor.driver_worker...model_runner.get_model())")
    if route in ("collective_rpc", "extension") and not has_rpc:
        raise ConfigError("route", route, f"a route this LLM offers ({type(llm).__name__} has no collective_rpc)")
    if route == "apply_model" and not callable(getattr(llm, "apply_model", None)):
        raise ConfigError("route", route, f"a route this LLM offers ({type(llm).__name__} has no apply_model)")
    return route


def dump_tokens(llm: Any, config_path: ConfigSource, token_range: Sequence[int], *, dump_path: Optional[str] = None,
                route: str = "auto") -> TokenDump:
    """Dump the forward passes that produce tokens ``token_range = [start, end]`` (0 = the prefill) of the next
    generation(s) of ``llm`` (a ``vllm.LLM``), in every worker that holds the model.

    ``config_path``: msprobe's config.json (or a dict with its content); ``dump_path`` overrides its
    ``dump_path``. ``route``: ``auto`` (default), or one of ``in_process``, ``collective_rpc``, ``extension``,
    ``apply_model`` (see the module docstring). Call it after ``LLM(...)`` and before ``llm.generate``; then
    ``finish()`` the returned ``TokenDump`` (or use it as a context manager).

    Raises ``TokenRangeError`` for a bad range, ``ConfigError`` for a bad config, a route this LLM does not
    offer, or a missing ``VLLM_ALLOW_INSECURE_SERIALIZATION``, ``EagerModeRequiredError`` when CUDA graphs or
    torch.compile would bypass the hooks, and ``WorkerDumpError`` when a worker fails.
    """
    window = validate_token_range(token_range)
    if window is None:
        raise ConfigError("token_range", None, "a list or tuple of two ints [start, end] with 0 <= start <= end")
    cfg = load_dump_config(config_path, dump_path=dump_path)  # validated here, before anything reaches a worker
    config: ConfigSource = (dict(config_path) if isinstance(config_path, Mapping)
                            else str(Path(os.fspath(config_path)).absolute()))
    target = str(Path(cfg.dump_path).absolute())  # workers may not share this process's cwd
    args = (config, list(window), target)

    vllm_config = find_vllm_config(llm)
    verified = check_eager_mode(vllm_config, "the engine's config (llm.llm_engine.vllm_config)")
    chosen = _choose_route(llm, route, vllm_config)
    if not verified and chosen != "in_process":
        logger.warning("cannot read the vLLM engine's config here; each worker checks eager mode itself")

    if chosen == "in_process":
        found = find_in_process_model(llm)
        if found is None:
            raise ConfigError("llm", type(llm).__name__, "an LLM whose model is in this process: "
                              + " or ".join(f"llm.{p}" for p in IN_PROCESS_PATHS))
        model, path = found
        logger.info("dumping tokens %s of %s found at llm.%s", list(window), type(model).__name__, path)
        results = [_start_here(model, config, window, target, None, vllm_config, "this process")]
    elif chosen == "extension":
        results = _collective_rpc(llm, "msprobe_start", args)
    elif chosen == "collective_rpc":
        if _engine_out_of_process(llm) and not _insecure_serialization_allowed():
            raise _insecure_error()
        results = _collective_rpc(llm, worker_start, args)
    else:
        if _engine_out_of_process(llm) and not _insecure_serialization_allowed():
            raise _insecure_error()
        results = _apply_model(llm, partial(model_start, *args))

    try:
        workers = _check_results(results, "starting the dump")
    except MsprobeError:
        if any(isinstance(r, Mapping) and r.get("ok") for r in results):
            try:  # do not leave hooks behind in the workers that did start
                _run_finish(llm, chosen)
            except Exception as e:
                logger.warning("cleaning up the workers that started failed: %r", e)
        raise
    ranks = [w.get("rank") for w in workers if w.get("rank") is not None]
    if len(ranks) != len(set(ranks)):
        logger.warning("several vLLM workers report the same rank %s; their dumps would share a rank "
                       "folder (give each process a distinct rank_id)", ranks)
    return TokenDump(llm, chosen, workers)


__all__ = [
    "dump_tokens", "TokenDump", "EagerModeRequiredError", "WorkerDumpError", "MsprobeWorkerExtension",
    "check_eager_mode", "eager_mode_problems", "find_in_process_model", "find_vllm_config",
    "worker_start", "worker_finish", "model_start", "model_finish", "worker_rank",
    "EXTENSION_CLASS", "IN_PROCESS_PATHS", "WORKER_MODEL_PATHS", "ROUTES",
]
