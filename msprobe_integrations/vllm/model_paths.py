"""Where a vLLM engine keeps its model and its config: attribute paths from an ``LLM`` (engine in this
process) or from a worker, and the engine's ``VllmConfig``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable, Optional

import torch

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


def find_worker_config(worker: Any) -> Any:
    """A worker's ``VllmConfig`` (or a stand-in with its model and compilation configs), or None."""
    for path in ("vllm_config", "worker.vllm_config"):
        config = _walk(worker, path)
        if config is not None:
            return config
    model_config = getattr(worker, "model_config", None)
    if model_config is None:
        return None
    return SimpleNamespace(model_config=model_config, compilation_config=getattr(worker, "compilation_config", None))
