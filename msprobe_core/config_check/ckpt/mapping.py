"""Renaming one checkpoint's parameters to another's naming (Megatron -> Hugging Face by default).

Rules come from ``name_mapping.yaml`` (shipped next to this module; its header documents the format) or
a user file of the same format. A rule renames a parameter or splits it: ``qkv`` regroups Megatron's
fused QKV into q/k/v with the attention layout of either checkpoint's config, ``glu`` halves a fused
gate/up projection. Split parts are loaded from one source tensor, kept until the next source is asked
for (``source.LastTensor``). Names no rule matches keep their name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import yaml

from msprobe_core.config_check.ckpt.source import Checkpoint, Entry, LastTensor
from msprobe_core.errors import ConfigError

DEFAULT_MAPPING = Path(__file__).resolve().parent / "name_mapping.yaml"
SPLITS = (None, "qkv", "glu")


@dataclass
class Rule:
    pattern: re.Pattern
    targets: list[str]
    split: Optional[str]


def _compile(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)") + "$")


def load_rules(path: Optional[str | Path] = None) -> list[Rule]:
    """The rules of ``path`` (default: the shipped Megatron -> Hugging Face mapping)."""
    source = Path(path) if path else DEFAULT_MAPPING
    try:
        doc = yaml.safe_load(source.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError("name_mapping", str(source), f"a readable YAML file ({e})") from None
    rules = []
    for n, item in enumerate(doc.get("rules") or []):
        where = f"rules[{n}]"
        if not isinstance(item, dict) or "megatron" not in item or "hf" not in item:
            raise ConfigError(where, item, "a mapping with 'megatron' and 'hf' (and optionally 'split')", str(source))
        split = item.get("split")
        targets = item["hf"] if isinstance(item["hf"], list) else [item["hf"]]
        if split not in SPLITS or (split == "qkv" and len(targets) != 3) or (split == "glu" and len(targets) != 2) \
                or (split is None and len(targets) != 1):
            raise ConfigError(f"{where}.split", split, "none with one hf name, 'qkv' with three, 'glu' with two",
                              str(source))
        rules.append(Rule(_compile(str(item["megatron"])), [str(t) for t in targets], split))
    return rules


def _qkv_layout(rows: int, config: dict[str, Any]) -> Optional[tuple[int, int, int]]:
    heads, groups = config.get("num_attention_heads"), config.get("num_query_groups")
    if not heads or not groups or heads % groups or rows % (heads + 2 * groups):
        return None
    return groups, heads // groups, rows // (heads + 2 * groups)


def _part(cache: LastTensor, key: str, entry: Entry,
          pick: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
    return lambda: pick(cache.get(key, entry.load))


def apply_rules(ckpt: Checkpoint, rules: list[Rule], config: dict[str, Any]) -> Checkpoint:
    """A view of ``ckpt`` under the target names (``config``: heads and query groups for ``qkv``)."""
    out = Checkpoint(ckpt.path, f"{ckpt.kind} (names mapped)", config=ckpt.config, notes=list(ckpt.notes))
    cache = LastTensor()
    for name, entry in ckpt.entries.items():
        found = next(((r, m) for r in rules for m in [r.pattern.match(name)] if m), None)
        if found is None:
            out.entries[name] = entry
            continue
        rule, match = found
        targets = [t.format(**match.groupdict()) for t in rule.targets]
        rest = entry.shape[1:]
        if rule.split is None:
            out.entries[targets[0]] = entry
        elif rule.split == "glu":
            half = entry.shape[0] // 2
            for k, target in enumerate(targets):
                out.entries[target] = Entry((half, *rest), entry.dtype,
                                            _part(cache, name, entry, lambda t, k=k: t.chunk(2, dim=0)[k]))
        else:
            layout = _qkv_layout(entry.shape[0], config)
            if layout is None:
                out.notes.append(f"{name}: q/k/v not split (attention heads and query groups unknown or "
                                 "inconsistent with its shape)")
                out.entries[name] = entry
                continue
            groups, per_group, head_dim = layout
            sizes = ((0, per_group), (per_group, per_group + 1), (per_group + 1, per_group + 2))
            for (lo, hi), target in zip(sizes, targets):
                pick = (lambda t, lo=lo, hi=hi, view=(groups, per_group + 2, head_dim, *rest), rest=rest:
                        t.reshape(view)[:, lo:hi].reshape(-1, *rest))
                out.entries[target] = Entry((groups * (hi - lo) * head_dim, *rest), entry.dtype,
                                            _part(cache, name, entry, pick))
    return out


def overlap(a: Checkpoint, b: Checkpoint) -> float:
    """Share of the smaller checkpoint's names the other has too."""
    smaller = min(len(a.entries), len(b.entries)) or 1
    return len(a.entries.keys() & b.entries.keys()) / smaller


def align_names(a: Checkpoint, b: Checkpoint, rules: list[Rule]) -> tuple[Checkpoint, Checkpoint]:
    """``(a, b)`` with one side renamed when that makes their names match better (names that already
    mostly match are left alone)."""
    if overlap(a, b) >= 0.5:
        return a, b
    config_a = {**b.config, **a.config}
    config_b = {**a.config, **b.config}
    options = [(a, b), (apply_rules(a, rules, config_a), b), (a, apply_rules(b, rules, config_b))]
    return max(options, key=lambda pair: overlap(*pair))
