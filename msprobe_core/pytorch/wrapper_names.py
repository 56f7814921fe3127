"""Module and parameter names as in the model without PyTorch's wrappers; hooks on compiled models.

FSDP1 (``FullyShardedDataParallel``) puts each wrapped unit under ``_fsdp_wrapped_module.``, activation
checkpointing's ``CheckpointWrapper`` under ``_checkpoint_wrapped_module.``, ``torch.compile``'s
``OptimizedModule`` under ``_orig_mod.``; FSDP2 (``fully_shard``) keeps the names but swaps each module's
class for a generated ``FSDP<Name>``. The dump and the monitor name modules and parameters as the
unwrapped model does, so a sharded or compiled run pairs with a single-device eager one in ``compare``.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Name components the wrappers insert; they are dropped from every name."""
FRAME_STRATEGIES = hasattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "set_code_exec_strategy")
"""Whether Dynamo has frame strategies (torch 2.6 has not): ``never_traced`` then skips what the function calls too."""

_FSDP2_PREFIX = "FSDP"


def unwrapped_name(name: str) -> str:
    """``name`` without the wrappers' components (``_fsdp_wrapped_module.0.weight`` -> ``0.weight``)."""
    if "_" not in name:
        return name
    parts = name.split(".")
    if not WRAPPER_PARTS.intersection(parts):
        return name
    return ".".join(p for p in parts if p not in WRAPPER_PARTS)


def _loaded(module: str, name: str) -> Optional[type]:
    """``module.name`` when ``module`` is already imported, else None: no instance of a class of a module
    nobody imported can exist, and importing Dynamo or FSDP only to ask would cost every start() up to a second."""
    return getattr(sys.modules.get(module), name, None)


def optimized_module_class() -> Optional[type]:
    """``torch.compile``'s ``OptimizedModule`` when Dynamo is loaded (``torch.compile`` loads it), else None."""
    return _loaded("torch._dynamo.eval_frame", "OptimizedModule")


def fsdp1_class() -> Optional[type]:
    """FSDP1's ``FullyShardedDataParallel`` when it is loaded, else None."""
    return _loaded("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel")


def _wrapper_types() -> tuple[type, ...]:
    """The wrapper classes loaded now: compiled module, FSDP1 unit, activation checkpoint wrapper."""
    found = (optimized_module_class(), fsdp1_class(),
             _loaded("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper"))
    return tuple(t for t in found if t is not None)


def unwrapped_class_name(module: nn.Module) -> str:
    """The module's class name; for FSDP2's generated ``FSDP<Name>`` class, ``Name``'s."""
    cls = type(module)
    name = cls.__name__
    if name.startswith(_FSDP2_PREFIX) and len(cls.__bases__) > 1:
        try:
            from torch.distributed.fsdp import FSDPModule
        except Exception:  # pragma: no cover
            return name
        if FSDPModule in cls.__bases__:
            for base in cls.__bases__:
                if base is not FSDPModule and not issubclass(base, FSDPModule):
                    return base.__name__
    return name


def unwrapped_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``root.named_modules()`` under unwrapped names, wrapper modules left out (the wrapped module takes
    the wrapper's name; the root's is ``""``)."""
    wrappers = _wrapper_types()
    for name, module in root.named_modules():
        if not isinstance(module, wrappers):
            yield unwrapped_name(name), module


def is_compiled(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` (or a submodule) runs under ``torch.compile`` (an ``OptimizedModule``
    wrapper, or ``Module.compile()`` in place)."""
    optimized = optimized_module_class() or ()
    return any(isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None
               for root in modules for m in root.modules())


def opaque_to_compiler(fn: Callable) -> Callable:
    """``fn`` run eagerly when called from code ``torch.compile`` traces: one graph break where it is
    called, and none of the tool's state (counters, step flags) in the compiled code's guards, so the tool
    never makes Dynamo recompile. Installed only on compiled models (it costs a few microseconds a call)."""
    return torch._dynamo.disable(fn, recursive=True)


def never_traced(fn: Callable) -> Callable:
    """Mark the plain function ``fn`` (no wrapper: nothing added to a call) so that ``torch.compile`` never
    traces it: Dynamo breaks the graph where traced code would call it, and compiles no frame of it, nor of
    anything it calls, when it runs inside compiled code (Dynamo's "skip" strategy for its code, for the frame
    and recursively). Needs only torch's C extension, not the ``torch._dynamo`` package (a second to import).
    torch 2.6 has no frame strategies: there its ``skip_code`` skips the frame itself (the calls it makes are
    Dynamo's to judge, as every call of an eager region's code is there)."""
    from torch._C._dynamo import eval_frame

    fn._torchdynamo_disable = True  # type: ignore[attr-defined]  # Dynamo's own mark of a disabled function
    if FRAME_STRATEGIES:
        skip = eval_frame._FrameAction.SKIP
        eval_frame.set_code_exec_strategy(fn.__code__, eval_frame._FrameExecStrategy(skip, skip))
    else:
        eval_frame.skip_code(fn.__code__)
    return fn
