"""Hyperparameter names matched across spellings and values compared by meaning.

``canonical_name("--learning-rate")`` and ``canonical_name("lr")`` are both ``learning_rate``: a key is
lower-cased, loses its leading dashes, reads ``-`` as ``_`` and is then looked up in the synonym table
(``resource/hyperparameter.yaml`` on top of ``msprobe_core.hparams.ALIASES``). ``same_value`` compares
what two values mean: ``"1e-4"`` equals ``0.0001``, ``"true"`` equals ``True``, ``"8"`` equals ``8.0``,
``"none"`` equals ``None``, lists element by element.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from msprobe_core import hparams

RESOURCE = Path(__file__).resolve().parent / "resource"
_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}
_NONE = {"none", "null", "nil", ""}
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_?KEY|CREDENTIAL|PRIVATE_?KEY|AUTH", re.IGNORECASE)
REDACTED = "<redacted>"


def load_resource(name: str) -> dict[str, Any]:
    """One of the YAML files shipped in ``resource/`` (parsed once)."""
    return _load_resource(name)


@functools.lru_cache(maxsize=None)
def _load_resource(name: str) -> dict[str, Any]:
    with open(RESOURCE / name, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def looks_secret(name: str) -> bool:
    """True for names such as ``HF_TOKEN`` or ``--wandb-api-key`` whose values must never be packed."""
    return bool(_SECRET.search(name))


def key_form(name: str) -> str:
    """``--Num-Layers`` -> ``num_layers`` (the spelling-independent form of one key)."""
    return str(name).strip().lstrip("-").lower().replace("-", "_")


@functools.lru_cache(maxsize=None)
def _synonym_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for canonical, names in hparams.ALIASES.items():
        for name in (canonical, *names):
            index.setdefault(key_form(name), canonical)
    for canonical, names in (load_resource("hyperparameter.yaml").get("synonyms") or {}).items():
        for name in (canonical, *names):
            index[key_form(name)] = canonical
    return index


def canonical_name(name: str) -> str:
    """The canonical name of a hyperparameter key; a dotted path keeps its prefix (``optimizer.lr`` ->
    ``optimizer.learning_rate``)."""
    form = key_form(name)
    prefix, dot, leaf = form.rpartition(".")
    canonical = _synonym_index().get(leaf, leaf)
    return f"{prefix}{dot}{canonical}"


@functools.lru_cache(maxsize=None)
def informational_names() -> frozenset[str]:
    """Canonical names whose difference is shown but never fails (output folders, ports, run names)."""
    names = load_resource("hyperparameter.yaml").get("informational") or []
    return frozenset(canonical_name(n) for n in names)


def meaning(value: Any) -> Any:
    """The comparable meaning of a value: bools, floats, None, tuples of meanings, or the stripped text."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return tuple(meaning(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), meaning(v)) for k, v in value.items()))
    text = str(value).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1].strip()
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    if low in _NONE:
        return None
    try:
        return float(text.replace("_", "")) if re.fullmatch(r"[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?inf|nan",
                                                             low) else text
    except ValueError:
        return text


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, (bool, float)) and isinstance(b, (bool, float)):
        x, y = float(a), float(b)
        if math.isnan(x) and math.isnan(y):
            return True
        return x == y or math.isclose(x, y, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def same_value(a: Any, b: Any) -> bool:
    """Whether two values mean the same (``"1e-4"`` == ``0.0001``, ``"true"`` == ``True``)."""
    return _equal(meaning(a), meaning(b))
