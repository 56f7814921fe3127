"""The monitor config's mixture-of-experts parts, validated (no torch).

``"moe"`` (top-level key)::

    "moe": {"routers": ["model.layers.*.mlp.router"], "per_expert": true, "router_stats": true}

* ``routers``: module names (``fnmatch`` patterns) of routers the monitor does not find by itself (HF
  ``*TopKRouter`` gates of Qwen3-MoE/Mixtral-style blocks and megatron-core ``TopKRouter`` are found
  automatically). A named router's output must hold its logits (a float tensor ``[..., num_experts]``)
  and its choice (an int tensor of expert indices ``[..., top_k]`` or a bool routing map).
* ``per_expert``: per-expert rows for fused expert tensors and names ending in the expert index for
  per-expert modules (default true).
* ``router_stats``: router health per MoE layer and step (default true).

Alert rules (entries of ``alert.rules`` like ``AnomalyTurbulence``), each naming the layer and the expert:

* ``ExpertStarvation`` ``{"share": 0.05, "steps": 5}``: an expert received less than ``share`` x its fair
  share (1 / num_experts) of the routed tokens for ``steps`` monitored steps in a row.
* ``ImbalanceJump`` ``{"threshold": 1.0, "warmup": 5, "window": 20}``: the load's max/mean rose above
  (1 + threshold) x its median over the last ``window`` steps.
* ``EntropyCollapse`` ``{"ratio": 0.5, "warmup": 5, "window": 20}``: the mean per-token router entropy fell
  below ``ratio`` x its median over the last ``window`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from msprobe_core.errors import ConfigError, UnknownKeyError

STARVATION_RULE = "ExpertStarvation"
IMBALANCE_RULE = "ImbalanceJump"
ENTROPY_RULE = "EntropyCollapse"
MOE_RULE_NAMES = (STARVATION_RULE, IMBALANCE_RULE, ENTROPY_RULE)
BELOW_RULES = (STARVATION_RULE, ENTROPY_RULE)
"""Rules whose value fell below its baseline (the others rose above it)."""
_MOE_KEYS = ("routers", "per_expert", "router_stats")


@dataclass(frozen=True)
class MoEConfig:
    """The ``moe`` section (defaults: everything found automatically is monitored)."""

    routers: tuple[str, ...] = ()
    per_expert: bool = True
    router_stats: bool = True


@dataclass(frozen=True)
class MoERuleConfig:
    """One MoE alert rule: its name and arguments (the unused ones keep their defaults)."""

    rule: str
    share: float = 0.05
    steps: int = 5
    threshold: float = 1.0
    ratio: float = 0.5
    warmup: int = 5
    window: int = 20


_RULE_ARGS = {STARVATION_RULE: ("share", "steps"), IMBALANCE_RULE: ("threshold", "warmup", "window"),
              ENTROPY_RULE: ("ratio", "warmup", "window")}
_ARG_ALLOWED = {
    "share": (float, 0.0, 1.0, "a number > 0 and <= 1 (a fraction of the expert's fair share 1/num_experts)"),
    "steps": (int, 1, None, "an int >= 1 (monitored steps in a row)"),
    "threshold": (float, 0.0, None, "a number > 0 (the rise over the median, 1.0 = doubling)"),
    "ratio": (float, 0.0, 1.0, "a number > 0 and < 1 (the fraction of the median entropy)"),
    "warmup": (int, 1, None, "an int >= 1 (steps observed before the rule arms)"),
    "window": (int, 3, None, "an int >= 3 (steps the median is taken over)"),
}


def parse_moe(value: Any, source: str | None) -> MoEConfig:
    """Validate the ``moe`` section (None/absent: the defaults)."""
    if value is None:
        return MoEConfig()
    allowed = '{"routers": ["module.name.pattern", ...], "per_expert": true, "router_stats": true}'
    if not isinstance(value, Mapping):
        raise ConfigError("moe", value, allowed, source)
    for key in value:
        if key not in _MOE_KEYS:
            raise UnknownKeyError(f"moe.{key}", [f"moe.{k}" for k in _MOE_KEYS], source)
    routers = value.get("routers", [])
    if isinstance(routers, str):
        routers = [routers]
    if not isinstance(routers, (list, tuple)) or not all(isinstance(r, str) and r for r in routers):
        raise ConfigError("moe.routers", routers, "a list of module names or fnmatch patterns (non-empty strings)",
                          source)
    flags = {}
    for key in ("per_expert", "router_stats"):
        flag = value.get(key, True)
        if not isinstance(flag, bool):
            raise ConfigError(f"moe.{key}", flag, "true or false", source)
        flags[key] = flag
    return MoEConfig(routers=tuple(dict.fromkeys(routers)), **flags)


def parse_moe_rule(name: str, args: Mapping[str, Any], where: str, source: str | None) -> MoERuleConfig:
    """Validate one MoE alert rule's ``args``."""
    known = _RULE_ARGS[name]
    for key in args:
        if key not in known:
            raise UnknownKeyError(f"{where}.args.{key}", [f"{where}.args.{k}" for k in known], source)
    values: dict[str, Any] = {}
    for key in known:
        if key not in args:
            continue
        kind, lo, hi, allowed = _ARG_ALLOWED[key]
        v = args[key]
        ok = not isinstance(v, bool) and isinstance(v, (int, float) if kind is float else int)
        if kind is float:
            ok = ok and v > lo and (hi is None or v <= hi) and not (key == "ratio" and v >= 1)
        else:
            ok = ok and v >= lo
        if not ok:
            raise ConfigError(f"{where}.args.{key}", v, allowed, source)
        values[key] = kind(v)
    rule = MoERuleConfig(rule=name, **values)
    if rule.window < rule.warmup:
        rule = MoERuleConfig(**{**rule.__dict__, "window": rule.warmup})
    return rule
