"""What a framework's replay backend gives the framework-neutral core.

A backend (``pytorch_replay``, ``mindspore_replay``) rebuilds a recorded call,
runs it on the tested device in the recorded dtype and on the CPU in float64, forward and backward, and
returns the outputs as numpy arrays (``ArrayTensor``) in a ``Replay``. Judging, CSV writing, resuming,
progress and workers are the core's.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from msprobe_core.acc_check.api_calls import ApiCall
from msprobe_core.errors import DumpInputError, require

if TYPE_CHECKING:  # NumPy is not imported before multi_acc_check has started its fork server (``fork_server``)
    from msprobe_core.dumpdir.tensor_reader import ArrayTensor


class Unreplayable(Exception):
    """The call cannot be replayed (custom, distributed, random, in-place on a view, unrecorded argument,
    or both sides of the replay failed); the message is the reason written to the result CSV."""


@dataclass
class OutputPair:
    """One compared tensor: a forward output or the gradient of one input."""

    name: str               # details "API Name": Functional.linear.0.forward.output.0
    tested: ArrayTensor
    bench: ArrayTensor
    tested_dtype: str       # as the framework names it (torch.bfloat16)
    bench_dtype: str
    precision: str          # normalized dtype whose standard applies (see standards)
    note: str = ""
    reference: Optional[ArrayTensor] = None  # the call computed in ``precision`` by a trusted reference
    key: Any = None         # the backend's own handle on this output (to attach the reference later)


@dataclass
class Replay:
    """The result of replaying one call."""

    forward: list[OutputPair]
    backward: Optional[list[OutputPair]] = None   # None: the call has no backward
    forward_failure: str = ""    # the tested side raised while the benchmark did not: an error
    backward_failure: str = ""
    backward_skip: str = ""      # the backward could not be replayed (reason)
    notes: list[str] = field(default_factory=list)
    save: Optional[Callable[[Path, bool], None]] = None  # save(folder, with_backward): inputs and both outputs
    reference: Optional[Callable[[], None]] = None
    """Fills ``OutputPair.reference`` of the float16/bfloat16 pairs: the in-dtype reference run, only needed
    (and run) when such an output fails against the correctly rounded benchmark, which no in-dtype
    computation can beat."""


class ReplayBackend(Protocol):
    """The per-framework part of acc_check."""

    framework: str
    device: str

    def unreplayable(self, call: ApiCall) -> Optional[str]:
        """The reason ``call`` cannot be replayed, or None."""

    def replay(self, call: ApiCall, keep_data: bool) -> Replay:
        """Run ``call`` on the tested device and as the float64 CPU benchmark; ``keep_data`` keeps the inputs
        and outputs for ``Replay.save``. Raises ``Unreplayable``."""


@dataclass(frozen=True)
class BackendInfo:
    """Where a framework's backend lives: ``module`` exposes ``factory(device_index, workers)``
    (``make_backend``); ``package`` is the framework's; ``preload``: modules the framework imports lazily on a
    replay's first call, which multi_acc_check's fork server imports once instead of every worker."""

    module: str
    package: str
    factory: str = "make_backend"
    preload: tuple[str, ...] = ()


BACKENDS = {"pytorch": BackendInfo("msprobe_core.acc_check.pytorch_replay", "torch",
                                   # torch.autograd.grad's first call imports it (and sympy): ~0.5 CPU-s
                                   preload=("torch.fx.experimental.symbolic_shapes",)),
            "mindspore": BackendInfo("msprobe_core.acc_check.mindspore_replay", "mindspore"),
            "mindtorch": BackendInfo("msprobe_core.acc_check.mindspore_replay", "mindspore", "make_mindtorch_backend")}
"""framework (dump.json's "framework" field) -> its replay backend. MSAdapter (mindtorch) records are replayed
with MindSpore's PyTorch-style API (see ``mindspore_replay``)."""

MISSING_BACKENDS: dict[str, str] = {}
"""framework -> why this version cannot replay its dumps (none at present)."""


def check_framework(framework: str) -> BackendInfo:
    """The backend of ``framework``; ``DumpInputError`` naming the framework when there is none."""
    entry = BACKENDS.get(framework)
    if entry is None:
        reason = MISSING_BACKENDS.get(framework, f"allowed: {', '.join(sorted(BACKENDS))}")
        raise DumpInputError(f"dump.json field 'framework' = {framework!r}: {reason}")
    return entry


def load_backend(framework: str, device_index: Optional[int] = None, workers: int = 1) -> ReplayBackend:
    """The replay backend for ``framework`` on accelerator ``device_index`` (the CPU when there is none),
    sharing the machine with ``workers`` processes.

    A replay runs thousands of small kernels; between them OpenMP's default busy-waiting threads doubled
    the CPU time and halved the speed of a run on a shared 2-CPU machine (measured: 21 CPU-s and 44 s for
    7.7 CPU-s and 18 s). So when the framework is not imported yet, its OpenMP runtime is asked to wait
    passively (``OMP_WAIT_POLICY=PASSIVE``) unless the environment says otherwise.
    """
    backend = prefer_passive_openmp(framework)
    require(backend.package, backend.package, f"acc_check of a {framework} dump")
    return getattr(importlib.import_module(backend.module), backend.factory)(device_index, workers)


def prefer_passive_openmp(framework: str) -> BackendInfo:
    """Ask for passive OpenMP waiting (see ``load_backend``) if ``framework`` is not imported yet; returns its
    backend."""
    backend = check_framework(framework)
    if backend.package not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return backend
