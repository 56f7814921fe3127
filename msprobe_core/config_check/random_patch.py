"""Where a training calls random-number APIs: patches that record call sites with their stacks.

``apply_patches("pytorch")`` wraps torch's random functions (``torch.manual_seed``, ``rand``/``randn``/
``randint``/``randperm``/..., the ``*_like`` variants, the in-place ``Tensor.uniform_``/``normal_``/
``random_``/..., ``torch.nn.functional.dropout`` and friends, ``torch.cuda.manual_seed[_all]``), numpy's
``numpy.random.*`` functions and Python's ``random.*``; ``"mindspore"`` wraps MindSpore's (``set_seed``,
``ops``/``mint`` random functions) plus numpy's and Python's. Each wrapper calls the original with the
same arguments (the numbers drawn are unchanged) and counts the call under (micro-step, API, call site):
the call site is the first frame outside torch, numpy, the standard library and this toolkit, with the
full stack kept the first time a site is seen and the arguments of seeding calls. ``remove_patches()``
puts every original back (a wrapper that another tool has wrapped in turn is left in place, inert).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import sysconfig
import threading
from typing import Any, Callable

from msprobe_core.common.patch import PatchHandle, mark, marked, patch

TORCH_FUNCTIONS = {
    "torch": ["manual_seed", "seed", "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
              "normal", "bernoulli", "multinomial", "poisson"],
    "torch.random": ["manual_seed", "seed"],
    "torch.cuda": ["manual_seed", "manual_seed_all", "seed", "seed_all"],
    "torch.nn.functional": ["dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                            "gumbel_softmax", "rrelu"],
}
TENSOR_METHODS = ["random_", "uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_"]
MINDSPORE_FUNCTIONS = {
    "mindspore": ["set_seed"],
    "mindspore.ops": ["uniform", "standard_normal", "normal", "randint", "rand", "randn", "rand_like", "randn_like",
                      "randint_like", "randperm", "multinomial", "bernoulli", "shuffle", "dropout", "gamma", "poisson"],
    "mindspore.mint": ["rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "rand_like",
                       "randn_like", "randint_like"],
    "mindspore.mint.nn.functional": ["dropout"],
}
COMMON_FUNCTIONS = {
    "numpy.random": ["seed", "rand", "randn", "randint", "random", "random_sample", "choice", "shuffle", "permutation",
                     "normal", "uniform", "default_rng"],
    "random": ["seed", "random", "randint", "randrange", "choice", "choices", "shuffle", "sample", "uniform", "gauss",
               "normalvariate", "getrandbits"],
}
SEEDING = {"manual_seed", "seed", "manual_seed_all", "set_seed", "default_rng"}
_MAX_STACK = 32
INIT_STEP = "init"


def _library_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_paths()["stdlib"], os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    for name in ("torch", "numpy", "mindspore"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            roots.add(os.path.dirname(module.__file__))
    return tuple(sorted(os.path.abspath(r) + os.sep for r in roots))


class RandomRecorder:
    """Counts random API calls per (step, API, call site); thread-safe; ignores nested patched calls."""

    def __init__(self) -> None:
        self.enabled = True
        self.step: Any = INIT_STEP
        self._entries: dict[tuple, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._roots: tuple[str, ...] = ()
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        """Called with each new call site's entry when it is first seen (``random_save`` writes it out)."""

    def refresh_roots(self) -> None:
        self._roots = _library_roots()

    def _is_library(self, filename: str) -> bool:
        return filename.startswith(self._roots) or filename.startswith("<")

    def call(self, api: str, original: Callable, args: tuple, kwargs: dict) -> Any:
        if not self.enabled or getattr(self._local, "busy", False):
            return original(*args, **kwargs)
        self._local.busy = True  # also while the original runs: its own random calls are not call sites
        try:
            self._record(api, args, kwargs, sys._getframe(2))
            return original(*args, **kwargs)
        finally:
            self._local.busy = False

    def _record(self, api: str, args: tuple, kwargs: dict, caller) -> None:
        frame = caller
        while frame is not None and self._is_library(os.path.abspath(frame.f_code.co_filename)):
            frame = frame.f_back
        site = frame or caller
        location = f"{os.path.basename(site.f_code.co_filename)}:{site.f_lineno} in {site.f_code.co_name}"
        key = (self.step, api, location)
        with self._lock:
            entry = self._entries.get(key)
            fresh = entry is None
            if fresh:
                stack, f = [], caller
                while f is not None and len(stack) < _MAX_STACK:
                    stack.append(f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}")
                    f = f.f_back
                entry = self._entries[key] = {"step": self.step, "api": api, "location": location, "count": 0,
                                              "stack": stack}
            entry["count"] += 1
            if api.rsplit(".", 1)[-1] in SEEDING and (args or kwargs):
                values = entry.setdefault("seeds", [])
                value = repr(args[0] if args else next(iter(kwargs.values())))
                if value not in values:
                    values.append(value)
        if fresh:
            for listener in list(self.listeners):
                listener(entry)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every recorded call site, in the order first seen."""
        with self._lock:
            return [dict(e) for e in self._entries.values()]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
        self.step = INIT_STEP


RECORDER = RandomRecorder()
_PATCHES: list[PatchHandle] = []
_PATCH_LOCK = threading.Lock()


def _wrap(api: str, original: Callable, method: bool = False) -> Callable:
    if method:
        def wrapper(self, *args, **kwargs):
            return RECORDER.call(api, original, (self, *args), kwargs)
    else:
        def wrapper(*args, **kwargs):
            return RECORDER.call(api, original, args, kwargs)
    try:
        functools.update_wrapper(wrapper, original)
    except (AttributeError, TypeError):
        pass
    return mark(wrapper, "random_patch", original)


def _patch(owner: Any, name: str, api: str, method: bool = False) -> None:
    original = getattr(owner, name, None)
    if original is None or marked(original, "random_patch"):
        return
    _PATCHES.append(patch(owner, name, lambda found: _wrap(api, found, method)))


def _patch_modules(table: dict[str, list[str]], import_missing: bool) -> None:
    for module_name, names in table.items():
        module = sys.modules.get(module_name)
        if module is None and import_missing:
            try:
                module = importlib.import_module(module_name)
            except Exception:  # a framework that is not installed or not importable here
                module = None
        if module is None:
            continue
        for name in names:
            _patch(module, name, f"{module_name}.{name}")


def apply_patches(fmk: str = "pytorch") -> None:
    """Install the recording wrappers for ``fmk`` ("pytorch" or "mindspore"); idempotent."""
    with _PATCH_LOCK:
        if not _PATCHES:
            RECORDER.clear()
        if fmk == "pytorch":
            import torch

            _patch_modules(TORCH_FUNCTIONS, import_missing=False)
            for name in TENSOR_METHODS:
                _patch(torch.Tensor, name, f"torch.Tensor.{name}", method=True)
        else:
            _patch_modules(MINDSPORE_FUNCTIONS, import_missing=True)
        _patch_modules(COMMON_FUNCTIONS, import_missing=True)
        RECORDER.refresh_roots()
        RECORDER.enabled = True


def remove_patches() -> None:
    """Put every original back; recording stops."""
    with _PATCH_LOCK:
        RECORDER.enabled = False
        while _PATCHES:
            _PATCHES.pop().remove()  # wrapped again by someone else: ours stays, inert


def patched() -> bool:
    """Whether any recording wrapper is installed."""
    return bool(_PATCHES)

