"""The client side of ``dump_tokens``: choose how to reach the workers (``ROUTES``), start and finish the
dump there, and turn their answers into ``TokenDump`` or errors."""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from msprobe_core.errors import ConfigError, MsprobeError
from msprobe_core.log import setup_logging
from msprobe_core.session import current_rank, load_dump_config, validate_token_range
from msprobe_integrations.vllm.eager_mode import EagerModeRequiredError, check_eager_mode
from msprobe_integrations.vllm.model_paths import IN_PROCESS_PATHS, find_in_process_model, find_vllm_config
from msprobe_integrations.vllm.workers import (ConfigSource, MsprobeWorkerExtension, WorkerDumpError, _finish_here,
                                               _start_here, model_finish, model_start, worker_finish, worker_start)

setup_logging()
logger = logging.getLogger("msprobe_core.vllm")

EXTENSION_CLASS = "msprobe_integrations.vllm.MsprobeWorkerExtension"
"""The ``worker_extension_cls`` value that lets ``dump_tokens`` call workers by method name."""

INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"

ROUTES = ("auto", "in_process", "collective_rpc", "extension", "apply_model")


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
        return [_finish_here(current_rank())]
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
        # vLLM's in-process engine initializes torch.distributed here too: report the rank that names the folder
        results = [_start_here(model, config, window, target, current_rank(), vllm_config, "this process")]
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
