"""Hyperparameters from YAML/JSON configuration files (a training YAML, a DeepSpeed ``ds_config.json``,
an ``accelerate`` config, a Hugging Face ``config.json``).

Nested sections are flattened: a key whose last name is unique in the file is kept under that name
(``training: {lr: 1e-4}`` gives ``lr``), so it matches the same setting given on a command line; names
that occur in several sections keep their dotted path (``optimizer.params.lr`` and ``scheduler.lr``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import yaml

from msprobe_core.config_check.values import REDACTED, looks_secret


def _walk(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            _walk(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = value


def flatten(content: Mapping[str, Any]) -> dict[str, Any]:
    """Leaf values keyed by their last name when unique in ``content``, else by their dotted path."""
    paths: dict[str, Any] = {}
    _walk("", content, paths)
    leaf_count = Counter(path.rsplit(".", 1)[-1] for path in paths)
    flat: dict[str, Any] = {}
    for path, value in paths.items():
        leaf = path.rsplit(".", 1)[-1]
        key = leaf if leaf_count[leaf] == 1 else path
        flat[key] = REDACTED if looks_secret(leaf) else value
    return flat


def load_config(path: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(flattened content, None)`` or ``(None, reason)`` when the file cannot be read as YAML/JSON."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        return None, f"cannot read: {e.strerror or e}"
    try:
        content = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        return None, f"not valid {'JSON' if p.suffix.lower() == '.json' else 'YAML'}: {str(e).splitlines()[0]}"
    if not isinstance(content, Mapping):
        return None, f"the top level is a {type(content).__name__}, not a mapping of settings"
    return flatten(content), None
