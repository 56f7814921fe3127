"""The worker side: what runs in each process that holds the model (a vLLM worker, or this process).

``worker_start`` / ``worker_finish`` (``collective_rpc`` with a pickled function: module-level, pickled by
reference), ``model_start`` / ``model_finish`` (``apply_model``) and ``MsprobeWorkerExtension`` (methods
called by name) find the model, check eager mode, and drive the process's ``ProbeSession``: started with
the token window, ended (files written) at finish. Each returns a small dict and never raises; the client
turns failures into ``WorkerDumpError`` / ``EagerModeRequiredError``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from msprobe_core.errors import MsprobeError
from msprobe_core.session import ProbeSession, current_rank, validate_token_range
from msprobe_integrations.vllm.eager_mode import eager_mode_problems
from msprobe_integrations.vllm.model_paths import WORKER_MODEL_PATHS, _as_module, _first_module, find_worker_config

logger = logging.getLogger("msprobe_core.vllm")

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any]]

_SESSION: Optional[ProbeSession] = None
"""This process's token_range dump, from ``_start_here`` to ``_finish_here``."""


class WorkerDumpError(MsprobeError, RuntimeError):
    """Starting or finishing the dump failed inside a vLLM worker (the message carries the worker's error)."""


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
    """Check eager mode, then start this process's session on ``model`` for ``token_range``."""
    global _SESSION
    problems = eager_mode_problems(vllm_config)
    base = {"rank": rank_id, "pid": os.getpid()}
    if problems:
        return {**base, "ok": False, "kind": "eager", "reasons": problems, "where": where}
    if problems is None:
        logger.warning("%s has no vLLM config to check for eager mode; make sure the engine was "
                       "created with enforce_eager=True", where)
    session = ProbeSession(config, dump_path=dump_path)
    session.attach(model, rank_id=rank_id)
    session.begin_step(token_range=list(token_range))
    _SESSION = session
    return {**base, "ok": True, "model": type(model).__name__, "dump_path": str(session.dump_path),
            "step": session.dump_step}


def _finish_here(rank_id: Optional[int]) -> dict[str, Any]:
    """End this process's dump step (its files are written); reports the rank folder that holds dump.json."""
    global _SESSION
    base = {"rank": rank_id, "pid": os.getpid()}
    session, _SESSION = _SESSION, None
    if session is None:
        return {**base, "ok": False, "kind": "error", "error": "no msprobe dump was started in this process"}
    folder = session.end_step()
    return {**base, "ok": True, "rank_dir": str(folder.absolute()) if folder is not None else None}


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
        return _start_here(found[0], config, window, dump_path, rank, find_worker_config(worker), f"worker rank {rank}")
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
