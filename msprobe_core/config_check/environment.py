"""The environment variables and installed package versions a config_check pack records.

Which variables: ``resource/env.yaml`` (prefixes such as ``NCCL_``/``HCCL_``/``CUDA_``/``TORCH_``, single
names, the defaults an unset variable has, names that are information only, names never collected).
Names that look like credentials are never collected. Packages: every installed distribution
(``importlib.metadata``); ``resource/dependency.yaml`` lists those whose version difference fails.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from typing import Any, Mapping, Optional

from msprobe_core.config_check.values import load_resource, looks_secret


def _env_rules() -> dict[str, Any]:
    return load_resource("env.yaml")


def wanted_variable(name: str) -> bool:
    """Whether an environment variable is one config_check records."""
    rules = _env_rules()
    ignored = name in (rules.get("ignore") or []) or name.startswith(tuple(rules.get("ignore_prefixes") or ()))
    if ignored or looks_secret(name):
        return False
    return name in (rules.get("names") or []) or name in (rules.get("defaults") or {}) or \
        name in (rules.get("info") or []) or name.startswith(tuple(rules.get("prefixes") or ()))


def collect_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The recorded variables of ``environ`` (default: this process's environment), sorted by name."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if wanted_variable(k)}


def env_default(name: str) -> Optional[str]:
    """The value an unset variable has (``resource/env.yaml``'s defaults), or None."""
    return (_env_rules().get("defaults") or {}).get(name)


def env_is_info(name: str) -> bool:
    """A variable whose difference is information only (machine-specific paths and endpoints)."""
    return name in (_env_rules().get("info") or [])


def normalize_package(name: str) -> str:
    """PEP 503 normal form: ``Megatron_Core`` and ``megatron-core`` are the same package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def collect_packages() -> dict[str, str]:
    """``{normalised name: version}`` of every installed distribution."""
    packages: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name") if dist.metadata else None
        if name:
            packages.setdefault(normalize_package(name), dist.version)
    return dict(sorted(packages.items()))


def pip_document() -> dict[str, Any]:
    """What ``pip.json`` holds: the interpreter and the installed packages."""
    return {"python": platform.python_version(), "implementation": platform.python_implementation(),
            "packages": collect_packages()}


def relevant_packages() -> frozenset[str]:
    """Packages whose version difference fails the pip check (``resource/dependency.yaml``)."""
    return frozenset(normalize_package(p) for p in load_resource("dependency.yaml").get("packages") or [])
