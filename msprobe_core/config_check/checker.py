"""Dynamic collection: ``ConfigChecker`` records, per rank and micro-step, what a training really uses.

    from msprobe_core.config_check import ConfigChecker
    ConfigChecker.apply_patches(fmk="pytorch")            # first lines of the training script
    ...                                                   # build the model
    ConfigChecker(model=model, shell_path=["run.sh"], output_zip_path="./config_check_pack.zip", fmk="pytorch")

Rank 0 writes the run-wide part (environment, packages, the hyperparameters of ``shell_path`` plus
Megatron-LM's arguments when ``megatron.training.get_args()`` answers). Every rank hooks the model's
forward (a pre-hook that only reads) and, for each of the first ``micro_steps`` forwards (micro-steps),
writes ``rank{R}/step{S}/weights.json`` (every parameter's statistics and hash before that forward) and
``rank{R}/step{S}/dataset.json`` (the forward's inputs: the batch this rank sees), and keeps
``rank{R}/random.json`` (random API call sites, see ``random_patch``) up to date. The forward after the
last recorded one (or the process's exit, or ``close()``) writes the last random calls, removes the hooks
and the random patches. Each write is an atomic update of the pack (``pack.PackWriter``), so a crash
loses nothing already recorded.

Integrations call the same API: ``ConfigChecker(model=..., output_zip_path=..., hyperparameters={...})``
when the model exists, and ``record_micro_step(*args, **kwargs)`` where no forward hook can see the
batch; ``record_hyperparameters(sections)`` adds the framework's own arguments later.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from msprobe_core.common.exit_close import cancel_close_at_exit, close_at_exit
from msprobe_core.config_check import collect, pack
from msprobe_core.config_check.random_patch import RECORDER, apply_patches, patched, remove_patches
from msprobe_core.config_check.tensor_digest import is_tensor, leaves, numpy_digests, torch_digests
from msprobe_core.errors import ConfigError

logger = logging.getLogger("msprobe_core.config_check")
DEFAULT_MICRO_STEPS = 3
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def megatron_arguments() -> Optional[dict[str, Any]]:
    """Megatron-LM's parsed arguments (``megatron.training.get_args()``) when Megatron runs, else None."""
    if "megatron" not in sys.modules:  # Megatron is not running in this process
        return None
    for name in ("megatron.training.global_vars", "megatron.training"):
        module = sys.modules.get(name)
        if module is None:
            try:
                if importlib.util.find_spec(name) is None:
                    continue
                module = importlib.import_module(name)
            except Exception:  # not Megatron-LM, or not importable in this process
                continue
        get_args = getattr(module, "get_args", None)
        if get_args is None:
            continue
        try:
            args = get_args()
        except Exception:  # arguments not parsed yet (Megatron asserts)
            continue
        if args is not None:
            return dict(vars(args))
    return None


def _unwrapped(name: str) -> str:
    """A parameter name without the prefixes of wrappers (DDP/DeepSpeed ``module.``, torch.compile's
    ``_orig_mod.``), so a wrapped and an unwrapped model record the same names."""
    while name.startswith(_WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def _rank_and_world(fmk: str) -> tuple[int, int]:
    if fmk == "pytorch":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    env = os.environ
    rank = env.get("RANK", env.get("RANK_ID", "0"))
    world = env.get("WORLD_SIZE", env.get("RANK_SIZE", "1"))
    return int(rank or 0), int(world or 1)


class _Framework:
    """What differs between PyTorch and MindSpore: parameters, digests and forward pre-hooks."""

    def __init__(self, fmk: str):
        self.fmk = fmk

    def parameters(self, model: Any) -> Iterable[tuple[str, Any]]:
        if self.fmk == "pytorch":
            return model.named_parameters()
        return ((name, p) for name, p in model.parameters_and_names())

    def digests(self, named: Iterable[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
        if self.fmk == "pytorch":
            return torch_digests(named)
        return numpy_digests((name, t.asnumpy()) for name, t in named)

    def is_tensor(self, value: Any) -> bool:
        if self.fmk == "pytorch":
            return is_tensor(value)
        return hasattr(value, "asnumpy")

    def pre_hook(self, model: Any, fn: Callable[[tuple, dict], None]) -> Any:
        if self.fmk == "pytorch":
            return model.register_forward_pre_hook(lambda module, args, kwargs: fn(args, kwargs), with_kwargs=True)
        return model.register_forward_pre_hook(lambda cell, args: fn(args, {}))


class ConfigChecker:
    """Collects a config_check pack while a training runs (see the module docstring).

    Args:
        model: the built model (a module, or a list of Megatron model chunks); None records no weights
            and no dataset.
        shell_path: launch script(s) and config file(s) whose hyperparameters rank 0 records (a path or a
            list); with Megatron-LM its arguments are recorded anyway.
        output_zip_path: the pack; all ranks of the run add to it. A file another run wrote is an error.
        fmk: "pytorch" or "mindspore".
        micro_steps: how many forwards (micro-steps) are recorded per rank.
        hyperparameters: sections an integration hands over (``{"training_args": {...}}``).
        hook_forward: record each forward of ``model`` (of its first chunk) as a micro-step; False when
            the caller calls ``record_micro_step`` itself (pipeline schedules, custom engines).
    """

    def __init__(self, model: Any = None, shell_path: Optional[str | Sequence[str]] = None,
                 output_zip_path: str = "./" + pack.DEFAULT_PACK, fmk: str = "pytorch", *,
                 micro_steps: int = DEFAULT_MICRO_STEPS,
                 hyperparameters: Optional[Mapping[str, Mapping[str, Any]]] = None, hook_forward: bool = True):
        if fmk not in collect.FRAMEWORKS:
            raise ConfigError("fmk", fmk, " or ".join(collect.FRAMEWORKS))
        if isinstance(micro_steps, bool) or not isinstance(micro_steps, int) or micro_steps < 1:
            raise ConfigError("micro_steps", micro_steps, "an int >= 1")
        self.fmk = fmk
        self.micro_steps = micro_steps
        self._framework = _Framework(fmk)
        self.rank, world = _rank_and_world(fmk)
        self._writer = pack.PackWriter(output_zip_path, pack.run_identity(world),
                                       meta={"framework": fmk, "mode": "dynamic", "micro_steps": micro_steps,
                                             "world_size": world})
        self.output_zip_path = str(self._writer.path)
        self._shell_paths = [shell_path] if isinstance(shell_path, (str, os.PathLike)) else list(shell_path or [])
        self._recorded: dict[str, Mapping[str, Any]] = {}
        megatron = megatron_arguments()
        if megatron:
            self._recorded["megatron_args"] = megatron
        self._recorded.update(hyperparameters or {})
        self.models = [] if model is None else list(model) if isinstance(model, (list, tuple)) else [model]
        self._step = 0
        self._handles: list[Any] = []
        self._closed = False
        if self.rank == 0:
            self._writer.update(collect.static_members(self._shell_paths, self._recorded))
        if self.models and hook_forward:
            self._handles.append(self._framework.pre_hook(self.models[0], self._on_forward))
        self._write_random()
        close_at_exit(self.close)

    # ------------------------------------------------------------------ public API
    @staticmethod
    def apply_patches(fmk: str = "pytorch") -> None:
        """Record random-number API calls from now on (call it at the top of the training script)."""
        if fmk not in collect.FRAMEWORKS:
            raise ConfigError("fmk", fmk, " or ".join(collect.FRAMEWORKS))
        apply_patches(fmk)

    @staticmethod
    def remove_patches() -> None:
        """Restore the random-number APIs ``apply_patches`` wrapped."""
        remove_patches()

    @staticmethod
    def compare(bench_zip_path: str, cmp_zip_path: str, output_path: str = "./config_check_result") -> Any:
        """Compare two packs into ``output_path`` (see ``msprobe_core.config_check.compare``)."""
        from msprobe_core.config_check.compare import compare_packs

        return compare_packs(bench_zip_path, cmp_zip_path, output_path)

    @property
    def step(self) -> int:
        """The next micro-step to record (equal to ``micro_steps`` once the window is over)."""
        return self._step

    def record_micro_step(self, *args: Any, **kwargs: Any) -> None:
        """Record one micro-step: the weights now and ``args``/``kwargs`` as the batch. The forward
        pre-hook calls it; with ``hook_forward=False`` the caller calls it once per micro-step. A call
        after the last recorded micro-step closes the recording (``close``)."""
        if self._closed:
            return
        if self._step >= self.micro_steps:
            self.close()
            return
        step = self._step
        RECORDER.step = step
        members: dict[str, Any] = {}
        if self.models:
            named = [(f"model{i}.{_unwrapped(n)}" if len(self.models) > 1 else _unwrapped(n), p)
                     for i, m in enumerate(self.models) for n, p in self._framework.parameters(m)]
            members[pack.step_member(self.rank, step, pack.WEIGHTS)] = self._framework.digests(named)
        members[pack.step_member(self.rank, step, pack.DATASET)] = self._inputs(args, kwargs)
        if patched():
            members[pack.rank_member(self.rank, pack.RANDOM)] = RECORDER.snapshot()
        self._writer.update(members)
        self._step += 1

    def record_hyperparameters(self, sections: Mapping[str, Mapping[str, Any]]) -> None:
        """Add sections (name -> settings) to ``hyperparameters.json`` (rank 0 writes it)."""
        self._recorded.update(sections)
        if self.rank == 0:
            self._writer.update({pack.HYPERPARAMETERS: collect.hyperparameters_document(self._shell_paths,
                                                                                        self._recorded)})

    def close(self) -> None:
        """Write the last random calls, remove the forward hook and the random patches, and let go of the
        model (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.models = []
        self._write_random()
        remove_patches()
        cancel_close_at_exit(self.close)

    # ------------------------------------------------------------------ internals
    def _on_forward(self, args: tuple, kwargs: dict) -> None:
        self.record_micro_step(*args, **kwargs)

    def _inputs(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        tensors, values = [], {}
        for name, leaf in [*leaves("args", args), *leaves("kwargs", kwargs)]:
            if self._framework.is_tensor(leaf):
                tensors.append((name, leaf))
            elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                values[name] = {"value": leaf}
        digests = self._framework.digests(tensors)
        return {**digests, **values}

    def _write_random(self) -> None:
        if patched():
            self._writer.update({pack.rank_member(self.rank, pack.RANDOM): RECORDER.snapshot()})


__all__ = ["ConfigChecker", "DEFAULT_MICRO_STEPS", "megatron_arguments"]
