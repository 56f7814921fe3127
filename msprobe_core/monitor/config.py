"""The training monitor's configuration: msprobe's monitor config.json keys, validated into ``MonitorConfig``.

An msprobe monitor config works unchanged. Keys msprobe documents but this tool does not implement
(``IGNORED_KEYS``) are accepted; a warning is logged when one of them is switched on. Any other unknown
key is an ``UnknownKeyError`` (with a did-you-mean hint); every invalid value is a ``ConfigError`` (a
``ValueError``) naming the key, the value given and what is allowed. This module does not import torch.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from msprobe_core.dump.config import check_task_and_level, read_json_object
from msprobe_core.errors import ConfigError, UnknownKeyError
from msprobe_core.monitor.moe.config import MOE_RULE_NAMES, MoEConfig, MoERuleConfig, parse_moe, parse_moe_rule

logger = logging.getLogger("msprobe_core.monitor")

OPS = ("min", "max", "norm", "mean", "zeros", "nans")
"""Statistics the monitor computes, in msprobe's spelling."""
DEFAULT_OPS = ("min", "max", "norm", "mean", "nans")
FORMATS = ("csv", "tensorboard", "api")
RULE_NAMES = ("AnomalyTurbulence", "AnomalyNan") + MOE_RULE_NAMES
TURBULENCE_METRICS = ("norm", "mean")
TURBULENCE_KINDS = ("actv", "actv_grad", "grad", "param")
DEFAULT_WARMUP = 8
"""Observations of a series before the turbulence rule judges it (its noise must be measured first)."""
DEFAULT_WINDOW = 20
"""Observations per series the turbulence rule keeps (median and MAD are taken over them)."""
INFORM_RECIPIENTS = ("database",)
SQLITE_PREFIX = "sqlite:///"
IO_KEYS = ("input", "output", "input_grad", "output_grad")
DEFAULT_COLLECT_TIMES = 100_000_000
MAX_NDIGITS = 20
MAX_STEP_COUNT_PER_RECORD = 1_000_000

KNOWN_KEYS = (
    "targets", "xy_distribution", "all_xy", "forward_only", "backward_only", "wg_distribution",
    "mv_distribution", "param_distribution", "ops", "eps", "format", "ndigits", "start_step",
    "step_interval", "collect_times", "step_count_per_record", "print_struct", "dynamic_on", "alert",
    "module_ranks", "on_anomaly", "moe",
)
# msprobe monitor keys this tool accepts and does not implement (a warning is logged when one is on).
IGNORED_KEYS = frozenset({
    "ur_distribution", "mg_direction", "cc_distribution", "l2_targets", "recording_l2_features", "sa_order",
    "stack_info", "append_output", "squash_name", "monitor_mbs_grad",
})
# msprobe adds these pseudo-ops itself; a config copied from its output may list them.
_PSEUDO_OPS = frozenset({"shape", "dtype", "id"})
_ALERT_KEYS = ("rules", "dump", "inform")
_INFORM_KEYS = ("recipient", "connection_str")
_TUPLE_SPEC = re.compile(r"^\s*tuple\[(\d+)\]\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class IOSpec:
    """Which tensors of a target module are monitored (msprobe's per-target ``input``/``output``/... specs).

    Each field is None (not monitored), -1 (every tensor) or an index into the flattened tuple.
    An empty spec in the config means every tensor in every direction.
    """

    input: int | None = -1
    output: int | None = -1
    input_grad: int | None = -1
    output_grad: int | None = -1

    def index(self, direction: str) -> int | None:
        return getattr(self, direction)


ALL_IO = IOSpec()


@dataclass(frozen=True)
class TurbulenceRuleConfig:
    """``AnomalyTurbulence``: a norm jumps above (1 + threshold) x its level and beyond its own noise; a mean
    shifts by more than ``threshold`` x the tensor's RMS (see ``msprobe_core.monitor.rules``)."""

    threshold: float
    warmup: int = DEFAULT_WARMUP
    metrics: tuple[str, ...] = TURBULENCE_METRICS
    kinds: tuple[str, ...] = TURBULENCE_KINDS
    window: int = DEFAULT_WINDOW


@dataclass(frozen=True)
class NanRuleConfig:
    """``AnomalyNan``: NaN/Inf anywhere; with a threshold also any |value| above it."""

    threshold: float | None = None


@dataclass(frozen=True)
class InformConfig:
    """``alert.inform``: where anomalies are sent besides the log. Only msprobe's ``database`` recipient, on
    SQLite (the standard library's ``sqlite3``): ``path`` is the database file."""

    recipient: str
    connection_str: str
    path: str


@dataclass(frozen=True)
class AlertConfig:
    """The ``alert`` section. ``enabled`` is True when the config has one (NaN/Inf checks are then on)."""

    enabled: bool = False
    turbulence: TurbulenceRuleConfig | None = None
    nan: NanRuleConfig = field(default_factory=NanRuleConfig)
    dump: bool = False
    inform: InformConfig | None = None
    moe_rules: tuple[MoERuleConfig, ...] = ()


@dataclass(frozen=True)
class CaptureConfig:
    """``on_anomaly.dump``: when an alert fires at step s, dump steps s+1 .. s+``steps`` with the dump core
    (``task``, ``level`` as in the dump config), scoped to the alerted module, at most ``max_captures``
    times per rank (see ``msprobe_core.monitor.capture``)."""

    task: str = "statistics"
    level: str = "L1"
    steps: int = 1
    max_captures: int = 3


CAPTURE_KEYS = ("task", "level", "steps", "max_captures")
MAX_CAPTURE_STEPS = 100


@dataclass(frozen=True)
class MonitorConfig:
    """A validated monitor configuration. Build it with ``load_monitor_config``."""

    targets: Mapping[str, IOSpec] = field(default_factory=dict)
    xy_distribution: bool = False
    all_xy: bool = False
    forward_only: bool = False
    backward_only: bool = False
    wg_distribution: bool = False
    mv_distribution: bool = False
    param_distribution: bool = False
    ops: tuple[str, ...] = DEFAULT_OPS
    eps: float = 1e-8
    formats: tuple[str, ...] = ("csv",)
    ndigits: int = 6
    start_step: int = 0
    step_interval: int = 1
    collect_times: int = DEFAULT_COLLECT_TIMES
    step_count_per_record: int = 1
    print_struct: bool = False
    dynamic_on: bool = False
    has_dynamic_on: bool = False
    alert: AlertConfig = field(default_factory=AlertConfig)
    module_ranks: tuple[int, ...] = ()
    on_anomaly: CaptureConfig | None = None
    """``on_anomaly.dump``: evidence captured when an alert fires (None: off)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    source: str | None = None

    @property
    def monitors_all_modules(self) -> bool:
        """Activations of every module (no targets, or ``all_xy``)."""
        return self.all_xy or not self.targets

    @property
    def xy_forward(self) -> bool:
        return self.xy_distribution and not self.backward_only

    @property
    def xy_backward(self) -> bool:
        return self.xy_distribution and not self.forward_only

    def selects_rank(self, rank: int) -> bool:
        return not self.module_ranks or rank in self.module_ranks


def load_monitor_config(config: str | os.PathLike | Mapping[str, Any]) -> MonitorConfig:
    """Read and validate a monitor config (a JSON file path or a mapping).

    Raises ``ConfigFileError`` for an unreadable or non-JSON file, ``UnknownKeyError`` for an unknown key
    and ``ConfigError`` for an invalid value.
    """
    if isinstance(config, Mapping):
        return parse_monitor_config(config, "config")
    source = os.fspath(config)
    return parse_monitor_config(read_json_object(source), source)


def parse_monitor_config(raw: Mapping[str, Any], source: str | None = None) -> MonitorConfig:
    """Validate a mapping in msprobe's monitor config layout."""
    for key in raw:
        if key in KNOWN_KEYS:
            continue
        if key in IGNORED_KEYS:
            if _switched_on(key, raw[key]):
                logger.warning("monitor config key '%s' is an msprobe feature this tool does not implement; ignored", key)
            continue
        raise UnknownKeyError(key, set(KNOWN_KEYS) | IGNORED_KEYS, source)

    xy = _bool(raw, "xy_distribution", False, source)
    forward_only = _bool(raw, "forward_only", False, source)
    backward_only = _bool(raw, "backward_only", False, source)
    if forward_only and backward_only:
        raise ConfigError("backward_only", True, "false when forward_only is true (at most one of them)", source)
    ops = _ops(raw.get("ops", list(DEFAULT_OPS)), source)
    eps = raw.get("eps", 1e-8)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 <= eps < 1):
        raise ConfigError("eps", eps, "a number >= 0 and < 1 (|x| <= eps counts as zero)", source)
    ndigits = _int(raw, "ndigits", 6, 1, MAX_NDIGITS, source)
    return MonitorConfig(
        targets=_targets(raw.get("targets", {}), source),
        xy_distribution=xy,
        all_xy=_bool(raw, "all_xy", False, source),
        forward_only=forward_only,
        backward_only=backward_only,
        wg_distribution=_bool(raw, "wg_distribution", False, source),
        mv_distribution=_bool(raw, "mv_distribution", False, source),
        param_distribution=_bool(raw, "param_distribution", False, source),
        ops=ops,
        eps=float(eps),
        formats=_formats(raw.get("format", "csv"), source),
        ndigits=ndigits,
        start_step=_int(raw, "start_step", 0, 0, None, source),
        step_interval=_int(raw, "step_interval", 1, 1, None, source),
        collect_times=_int(raw, "collect_times", DEFAULT_COLLECT_TIMES, 1, None, source),
        step_count_per_record=_int(raw, "step_count_per_record", 1, 1, MAX_STEP_COUNT_PER_RECORD, source),
        print_struct=_bool(raw, "print_struct", False, source),
        dynamic_on=_bool(raw, "dynamic_on", False, source),
        has_dynamic_on="dynamic_on" in raw,
        alert=_alert(raw.get("alert"), source),
        module_ranks=_ranks(raw.get("module_ranks", []), source),
        on_anomaly=_on_anomaly(raw.get("on_anomaly"), source),
        moe=parse_moe(raw.get("moe"), source),
        source=source,
    )


def parse_io_spec(field_name: str, value: Any, source: str | None) -> int:
    """msprobe's tensor spec: "tensor" (the only tensor) or "tuple[n]:i" (element i); returns the index."""
    if value == "tensor":
        return 0
    if isinstance(value, str):
        m = _TUPLE_SPEC.match(value)
        if m and int(m.group(2)) < int(m.group(1)):
            return int(m.group(2))
    raise ConfigError(field_name, value, '"tensor" or "tuple[n]:i" with 0 <= i < n, e.g. "tuple[2]:0"', source)


# ----------------------------------------------------------------------------------------- validators
def _switched_on(key: str, value: Any) -> bool:
    """Whether an ignored msprobe key asks for something (worth a warning) rather than leaving it off."""
    if key == "cc_distribution":
        return isinstance(value, Mapping) and bool(value.get("enable", False))
    if key == "squash_name":  # msprobe's default is true; a name-shortening option, harmless to ignore
        return False
    return value not in (False, None, [], {}, "")


def _bool(raw: Mapping[str, Any], key: str, default: bool, source: str | None) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true or false (a JSON boolean, not a string)", source)
    return value


def _int(raw: Mapping[str, Any], key: str, default: int, lo: int, hi: int | None, source: str | None,
         prefix: str = "") -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f"an int >= {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise ConfigError(prefix + key, value, allowed, source)
    return value


def _ops(value: Any, source: str | None) -> tuple[str, ...]:
    allowed = f"a non-empty list of {', '.join(OPS)}"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError("ops", value, allowed, source)
    ops: list[str] = []
    for op in value:
        if op in _PSEUDO_OPS:
            continue
        if op not in OPS:
            raise ConfigError("ops", op, allowed, source)
        if op not in ops:
            ops.append(op)
    if not ops:
        raise ConfigError("ops", value, allowed, source)
    return tuple(ops)


def _formats(value: Any, source: str | None) -> tuple[str, ...]:
    allowed = f"one of {', '.join(FORMATS)}, or a non-empty list of them"
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError("format", value, allowed, source)
    out: list[str] = []
    for item in items:
        if item not in FORMATS:
            raise ConfigError("format", item, allowed, source)
        if item not in out:
            out.append(item)
    return tuple(out)


def _targets(value: Any, source: str | None) -> dict[str, IOSpec]:
    allowed = ('an object {module_name: {} or {"input": "tuple[2]:0", "output": "tensor", ...}}, '
               'or a list of module names; empty means every module')
    if value is None:
        return {}
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, str) for v in value):
            raise ConfigError("targets", value, allowed, source)
        return {name: ALL_IO for name in value}
    if not isinstance(value, Mapping):
        raise ConfigError("targets", value, allowed, source)
    targets: dict[str, IOSpec] = {}
    for name, spec in value.items():
        if not isinstance(name, str):
            raise ConfigError("targets", name, allowed, source)
        if spec is None or spec == {}:
            targets[name] = ALL_IO
            continue
        if not isinstance(spec, Mapping):
            raise ConfigError(f"targets.{name}", spec, allowed, source)
        for key in spec:
            if key not in IO_KEYS:
                raise ConfigError(f"targets.{name}.{key}", key, f"one of {', '.join(IO_KEYS)}", source)
        indices = {k: (parse_io_spec(f"targets.{name}.{k}", spec[k], source) if k in spec else None) for k in IO_KEYS}
        targets[name] = IOSpec(**indices)
    return targets


def _ranks(value: Any, source: str | None) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in value):
        raise ConfigError("module_ranks", value, "a list of ints >= 0 (empty means every rank)", source)
    return tuple(value)


def _number(name: str, value: Any, lo: float, source: str | None, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lo:
        raise ConfigError(name, value, allowed, source)
    return float(value)


def _alert(value: Any, source: str | None) -> AlertConfig:
    if value is None:
        return AlertConfig()
    if not isinstance(value, Mapping):
        raise ConfigError("alert", value, 'an object {"rules": [...], "dump": false, "inform": {...}}', source)
    for key in value:
        if key not in _ALERT_KEYS:
            raise UnknownKeyError(f"alert.{key}", [f"alert.{k}" for k in _ALERT_KEYS], source)
    dump = value.get("dump", False)
    if not isinstance(dump, bool):
        raise ConfigError("alert.dump", dump, "true or false", source)
    rules = value.get("rules", [])
    if rules is None:
        rules = []
    if not isinstance(rules, (list, tuple)):
        raise ConfigError("alert.rules", rules, 'a list of {"rule_name": ..., "args": {...}}', source)
    turbulence: TurbulenceRuleConfig | None = None
    nan = NanRuleConfig()
    moe_rules: dict[str, MoERuleConfig] = {}
    for i, rule in enumerate(rules):
        where = f"alert.rules[{i}]"
        if not isinstance(rule, Mapping):
            raise ConfigError(where, rule, 'an object {"rule_name": ..., "args": {...}}', source)
        for key in rule:
            if key not in ("rule_name", "args"):
                raise UnknownKeyError(f"{where}.{key}", [f"{where}.rule_name", f"{where}.args"], source)
        name = rule.get("rule_name")
        if name not in RULE_NAMES:
            raise ConfigError(f"{where}.rule_name", name, ", ".join(RULE_NAMES), source)
        args = rule.get("args", {}) or {}
        if not isinstance(args, Mapping):
            raise ConfigError(f"{where}.args", args, "an object", source)
        if name == "AnomalyTurbulence":
            turbulence = _turbulence(args, where, source)
        elif name in MOE_RULE_NAMES:
            moe_rules[name] = parse_moe_rule(name, args, where, source)
        else:
            nan = _nan_rule(args, where, source)
    return AlertConfig(enabled=True, turbulence=turbulence, nan=nan, dump=dump,
                       inform=_inform(value.get("inform"), source), moe_rules=tuple(moe_rules.values()))


def _object(value: Any, field: str, keys: tuple[str, ...], allowed: str, source: str | None) -> Mapping | None:
    """A section of the config: None/absent stays None; anything but an object, or a key not in ``keys``, is
    an error naming ``field``."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(field, value, allowed, source)
    for key in value:
        if key not in keys:
            raise UnknownKeyError(f"{field}.{key}", [f"{field}.{k}" for k in keys], source)
    return value


def _on_anomaly(value: Any, source: str | None) -> CaptureConfig | None:
    """``on_anomaly``: None/absent, or {"dump": {"task": "statistics", "level": "L1", "steps": 1, "max_captures": 3}}."""
    allowed = '{"dump": {"task": "statistics", "level": "L1", "steps": 1, "max_captures": 3}}'
    section = _object(value, "on_anomaly", ("dump",), allowed, source)
    dump = _object(section.get("dump"), "on_anomaly.dump", CAPTURE_KEYS, allowed, source) if section else None
    if dump is None:
        return None
    default = CaptureConfig()
    task, level = check_task_and_level(dump.get("task", default.task), dump.get("level", default.level),
                                       "on_anomaly.dump.", source)
    return CaptureConfig(task=task, level=level,
                         steps=_int(dump, "steps", default.steps, 1, MAX_CAPTURE_STEPS, source, "on_anomaly.dump."),
                         max_captures=_int(dump, "max_captures", default.max_captures, 1, None, source,
                                           "on_anomaly.dump."))


def _inform(value: Any, source: str | None) -> InformConfig | None:
    """``alert.inform``: None/absent, or {"recipient": "database", "connection_str": "sqlite:///path.db"}."""
    allowed = '{"recipient": "database", "connection_str": "sqlite:///path/to/anomalies.db"}'
    value = _object(value, "alert.inform", _INFORM_KEYS, allowed, source)
    if value is None:
        return None
    recipient = value.get("recipient")
    if recipient not in INFORM_RECIPIENTS:
        raise ConfigError("alert.inform.recipient", recipient,
                          f"{', '.join(INFORM_RECIPIENTS)} (msprobe's email recipient is not supported)", source)
    conn = value.get("connection_str")
    if not isinstance(conn, str) or not conn.startswith(SQLITE_PREFIX) or len(conn) == len(SQLITE_PREFIX):
        raise ConfigError("alert.inform.connection_str", conn,
                          "an SQLite URL 'sqlite:///relative/path.db' or 'sqlite:////absolute/path.db' "
                          "(other databases, e.g. mysql+pymysql://, need drivers this tool does not ship)", source)
    path = conn[len(SQLITE_PREFIX):]
    if path == ":memory:" or path.endswith(("/", os.sep)):
        raise ConfigError("alert.inform.connection_str", conn,
                          "a database file, not ':memory:' or a folder (every rank and reader opens the same file)",
                          source)
    return InformConfig(recipient=recipient, connection_str=conn, path=path)


def _turbulence(args: Mapping[str, Any], where: str, source: str | None) -> TurbulenceRuleConfig:
    known = ("threshold", "warmup", "metrics", "kinds", "window")
    for key in args:
        if key not in known:
            raise UnknownKeyError(f"{where}.args.{key}", [f"{where}.args.{k}" for k in known], source)
    if "threshold" not in args:
        raise ConfigError(f"{where}.args.threshold", None, "a number >= 0 (required by AnomalyTurbulence)", source)
    threshold = _number(f"{where}.args.threshold", args["threshold"], 0.0, source, "a number >= 0, e.g. 0.5")
    warmup = args.get("warmup", DEFAULT_WARMUP)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ConfigError(f"{where}.args.warmup", warmup, "an int >= 1 (steps observed before the rule arms)", source)
    window = args.get("window", DEFAULT_WINDOW)
    if isinstance(window, bool) or not isinstance(window, int) or window < 3:
        raise ConfigError(f"{where}.args.window", window,
                          "an int >= 3 (observations per series the median and MAD are taken over)", source)
    metrics = args.get("metrics", list(TURBULENCE_METRICS))
    if isinstance(metrics, str):
        metrics = [metrics]
    if not isinstance(metrics, (list, tuple)) or not metrics or any(m not in TURBULENCE_METRICS for m in metrics):
        raise ConfigError(f"{where}.args.metrics", metrics, "a non-empty list of norm, mean", source)
    kinds = args.get("kinds", list(TURBULENCE_KINDS))
    if isinstance(kinds, str):
        kinds = [kinds]
    if not isinstance(kinds, (list, tuple)) or not kinds or not all(isinstance(k, str) and k for k in kinds):
        raise ConfigError(f"{where}.args.kinds", kinds,
                          "a non-empty list of kinds (actv, actv_grad, grad, param, exp_avg, exp_avg_sq)", source)
    return TurbulenceRuleConfig(threshold=threshold, warmup=warmup, metrics=tuple(dict.fromkeys(metrics)),
                                kinds=tuple(dict.fromkeys(kinds)), window=max(window, warmup))


def _nan_rule(args: Mapping[str, Any], where: str, source: str | None) -> NanRuleConfig:
    for key in args:
        if key != "threshold":
            raise UnknownKeyError(f"{where}.args.{key}", [f"{where}.args.threshold"], source)
    if args.get("threshold") is None:
        return NanRuleConfig()
    return NanRuleConfig(_number(f"{where}.args.threshold", args["threshold"], 0.0, source,
                                 "a number > 0 (|value| above it is an anomaly), or omit it"))
