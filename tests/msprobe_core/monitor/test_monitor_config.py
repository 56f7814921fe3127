"""Monitor config validation: msprobe's keys accepted, every invalid value a ConfigError naming key, value, allowed."""

from __future__ import annotations

import json

import pytest

from msprobe_core.errors import ConfigError, ConfigFileError, UnknownKeyError
from msprobe_core.monitor.config import ALL_IO, IOSpec, load_monitor_config

# msprobe's documented full example (monitor_instruct), verbatim keys and values.
MSPROBE_EXAMPLE = {
    "targets": {"language_model.encoder.layers.0": {"input": "tuple[2]:0", "output": "tensor",
                                                     "input_grad": "tuple[2]:0", "output_grad": "tuple[1]:0"}},
    "dynamic_on": False, "start_step": 0, "collect_times": 100000000, "step_interval": 1, "print_struct": False,
    "module_ranks": [0, 1, 2, 3], "ur_distribution": True, "xy_distribution": True, "all_xy": True,
    "forward_only": False, "backward_only": False, "mv_distribution": True, "param_distribution": True,
    "wg_distribution": True, "monitor_mbs_grad": True, "cc_distribution": {"enable": True, "cc_codeline": []},
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
    "format": "csv", "ops": ["min", "max", "norm", "zeros", "nans", "mean"], "eps": 1e-8, "ndigits": 12,
    "step_count_per_record": 1, "append_output": [], "squash_name": False,
}


def test_msprobe_example_config_is_accepted(caplog):
    with caplog.at_level("WARNING", logger="msprobe_core.monitor"):
        cfg = load_monitor_config(MSPROBE_EXAMPLE)
    assert cfg.ops == ("min", "max", "norm", "zeros", "nans", "mean")
    assert cfg.targets["language_model.encoder.layers.0"] == IOSpec(input=0, output=0, input_grad=0, output_grad=0)
    assert cfg.xy_forward and cfg.xy_backward and cfg.monitors_all_modules
    assert cfg.alert.enabled and cfg.alert.turbulence.threshold == 0.5 and not cfg.alert.dump
    assert cfg.formats == ("csv",) and cfg.ndigits == 12 and cfg.module_ranks == (0, 1, 2, 3)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "ur_distribution" in warned and "cc_distribution" in warned and "squash_name" not in warned


def test_defaults_and_format_list(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"wg_distribution": True, "format": ["tensorboard", "csv", "api"], "targets": ["fc"]}))
    cfg = load_monitor_config(str(path))
    assert cfg.formats == ("tensorboard", "csv", "api") and cfg.source == str(path)
    assert cfg.targets == {"fc": ALL_IO} and not cfg.alert.enabled
    assert (cfg.start_step, cfg.step_interval, cfg.step_count_per_record, cfg.ndigits) == (0, 1, 1, 6)


@pytest.mark.parametrize("key, value, allowed", [
    ("ops", ["norm", "median"], "min, max, norm, mean, zeros, nans"),
    ("ops", [], "non-empty list"),
    ("format", "parquet", "csv, tensorboard, api"),
    ("format", ["csv", 3], "csv, tensorboard, api"),
    ("xy_distribution", "true", "true or false"),
    ("step_interval", 0, "an int >= 1"),
    ("start_step", -1, "an int >= 0"),
    ("collect_times", 1.5, "an int >= 1"),
    ("step_count_per_record", 0, "an int >= 1"),
    ("ndigits", 0, "an int >= 1"),
    ("eps", "tiny", "a number >= 0"),
    ("module_ranks", [0, "1"], "a list of ints"),
    ("targets", "layers.0", "module_name"),
])
def test_invalid_values_name_key_value_and_allowed(key, value, allowed):
    with pytest.raises(ConfigError) as e:
        load_monitor_config({key: value})
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert key in msg and allowed in msg
    assert e.value.field == key


@pytest.mark.parametrize("alert, field, allowed", [
    ({"rules": [{"rule_name": "AnomalySpike", "args": {"threshold": 1}}]}, "alert.rules[0].rule_name", "AnomalyTurbulence"),
    ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": -1}}]}, "alert.rules[0].args.threshold", ">= 0"),
    ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {}}]}, "alert.rules[0].args.threshold", "required"),
    ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 1, "warmup": 0}}]},
     "alert.rules[0].args.warmup", "an int >= 1"),
    ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 1, "metrics": ["max"]}}]},
     "alert.rules[0].args.metrics", "norm, mean"),
    ({"rules": {}}, "alert.rules", "a list"),
    ({"dump": "yes"}, "alert.dump", "true or false"),
])
def test_invalid_alert_section(alert, field, allowed):
    with pytest.raises(ConfigError) as e:
        load_monitor_config({"alert": alert})
    assert e.value.field == field and allowed in str(e.value)


def test_conflicts_unknown_keys_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="backward_only"):
        load_monitor_config({"forward_only": True, "backward_only": True})
    with pytest.raises(ConfigError, match=r"targets.fc.input.*tuple\[n\]:i"):
        load_monitor_config({"targets": {"fc": {"input": "tuple[2]:5"}}})
    with pytest.raises(UnknownKeyError, match="did you mean 'wg_distribution'"):
        load_monitor_config({"wg_distributon": True})
    with pytest.raises(UnknownKeyError, match="alert.rule"):
        load_monitor_config({"alert": {"rule": []}})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigFileError, match="invalid JSON"):
        load_monitor_config(str(bad))
    with pytest.raises(ConfigFileError, match="no such file"):
        load_monitor_config(str(tmp_path / "missing.json"))


def test_alert_rules_and_nan_rule():
    cfg = load_monitor_config({"alert": {"rules": [
        {"rule_name": "AnomalyTurbulence", "args": {"threshold": 1, "warmup": 3, "metrics": "norm", "kinds": ["grad"]}},
        {"rule_name": "AnomalyNan", "args": {"threshold": 1e4}}], "dump": True}})
    t = cfg.alert.turbulence
    assert (t.threshold, t.warmup, t.metrics, t.kinds) == (1.0, 3, ("norm",), ("grad",))
    assert cfg.alert.nan.threshold == 1e4 and cfg.alert.dump
    assert load_monitor_config({"alert": {}}).alert.enabled  # an alert section turns NaN checks on
