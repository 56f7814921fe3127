"""Eager mode: CUDA graphs replay captured kernels without running Python, and vLLM's torch.compile dispatches
straight to compiled code, so neither the token counter nor the dump hooks would fire. ``check_eager_mode``
reads a vLLM config (``model_config.enforce_eager``, ``compilation_config``) and refuses anything else."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from msprobe_core.errors import MsprobeError


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
