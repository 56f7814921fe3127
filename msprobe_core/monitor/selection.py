"""Which modules get activation hooks and which parameters are monitored, from ``targets``.

Names are ``named_modules()``/``named_parameters()`` names, prefixed with ``{chunk}:`` when the model is
a list of chunks (msprobe's ``vpp_stage:`` prefix). A target names a module: its activations are
monitored (msprobe: exact name) and so are the parameters in its subtree. No targets (or ``all_xy``
for activations) means everything.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from torch import nn

from msprobe_core.monitor.config import ALL_IO, IOSpec, MonitorConfig
from msprobe_core.monitor.module_hooks import ROOT_NAME
from msprobe_core.pytorch.wrapper_names import unwrapped_modules, unwrapped_name

logger = logging.getLogger("msprobe_core.monitor")


def normalise_targets(config: MonitorConfig, n_chunks: int) -> dict[str, IOSpec]:
    """Targets with msprobe's ``0:`` prefix dropped for a single-chunk model."""
    out: dict[str, IOSpec] = {}
    for name, spec in config.targets.items():
        if n_chunks == 1 and name.startswith("0:"):
            name = name[2:]
        out[name] = spec
    return out


class Selection:
    """Answers 'is this module / parameter monitored?' for one config and model."""

    def __init__(self, config: MonitorConfig, n_chunks: int):
        self.config = config
        self.targets = normalise_targets(config, n_chunks)

    def module_spec(self, qualified: str) -> IOSpec | None:
        """The activation spec of a module, or None when its activations are not monitored."""
        if not self.config.xy_distribution:
            return None
        spec = self.targets.get(qualified)
        if spec is not None:
            return spec
        return ALL_IO if self.config.monitors_all_modules else None

    def selects_param(self, qualified: str) -> bool:
        if not self.targets:
            return True
        return any(qualified == t or qualified.startswith(t + ".") or t == ROOT_NAME for t in self.targets)

    def warn_unmatched(self, module_names: Iterable[str]) -> None:
        names = set(module_names)
        missing = [t for t in self.targets if t not in names and t != ROOT_NAME]
        if missing:
            sample = ", ".join(sorted(names)[:8])
            logger.warning("monitor: targets %s match no module; module names look like: %s "
                           "(set print_struct to true to list them all)", missing, sample)


def named_parameters(chunks: Sequence[nn.Module]) -> dict[str, nn.Parameter]:
    """Every trainable parameter of the chunks under its qualified, unwrapped name (shared ones once)."""
    multi = len(chunks) > 1
    seen: set[int] = set()
    out: dict[str, nn.Parameter] = {}
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            out[(f"{c}:" if multi else "") + unwrapped_name(name)] = p
    return out


def module_names(chunks: Sequence[nn.Module]) -> list[str]:
    multi = len(chunks) > 1
    return [(f"{c}:" if multi else "") + (name or ROOT_NAME) for c, chunk in enumerate(chunks)
            for name, _ in unwrapped_modules(chunk)]


def owner_module(param_name: str) -> str:
    """The module a parameter belongs to: its name without the last component."""
    head, sep, _ = param_name.rpartition(".")
    if sep:
        return head
    prefix, colon, _ = param_name.rpartition(":")
    return f"{prefix}:{ROOT_NAME}" if colon else ROOT_NAME


def model_structure(chunks: Sequence[nn.Module]) -> dict[str, dict]:
    """``{module name: {"class": ..., "params": {name: shape}}}`` for ``print_struct``."""
    multi = len(chunks) > 1
    out: dict[str, dict] = {}
    for c, chunk in enumerate(chunks):
        for name, m in unwrapped_modules(chunk):
            qualified = (f"{c}:" if multi else "") + (name or ROOT_NAME)
            out[qualified] = {"class": type(m).__name__,
                              "params": {p: list(t.shape) for p, t in m.named_parameters(recurse=False)}}
    return out
