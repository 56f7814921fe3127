"""Config validation: msprobe's config.json works unchanged; bad input names field, value, allowed; no disk writes."""

from __future__ import annotations

import json
import logging
import os

import pytest

from msprobe_core.dump.config import DEFAULT_DUMP_PATH, load_dump_config
from msprobe_core.errors import ConfigError, ConfigFileError, UnknownKeyError
from msprobe_core.pytorch import PrecisionDebugger

MSPROBE_EXAMPLE = {
    "task": "statistics", "dump_path": "/home/data_dump", "rank": [], "step": [], "level": "L1",
    "async_dump": False, "extra_info": True,
    "statistics": {"scope": [], "list": [], "tensor_list": [], "data_mode": ["all"], "summary_mode": "statistics"},
}


def write(tmp_path, obj, name="config.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_msprobe_example_config_loads(tmp_path):
    cfg = load_dump_config(write(tmp_path, MSPROBE_EXAMPLE))
    assert (cfg.task, cfg.level, cfg.dump_path, cfg.summary_mode) == ("statistics", "L1", "/home/data_dump", "statistics")
    assert cfg.step.is_all and cfg.rank.is_all and cfg.data_mode == frozenset({"all"})


def test_defaults_and_constructor_overrides(tmp_path):
    cfg = load_dump_config(None)
    assert (cfg.task, cfg.level, cfg.dump_path) == ("statistics", "L1", DEFAULT_DUMP_PATH)
    cfg = load_dump_config(write(tmp_path, MSPROBE_EXAMPLE), task="tensor", level="mix", dump_path=str(tmp_path / "o"), step=[1, "3-4"])
    assert (cfg.task, cfg.level, cfg.dump_path) == ("tensor", "mix", str(tmp_path / "o"))
    assert [s in cfg.step for s in range(6)] == [False, True, False, True, True, False]


def test_documented_but_unused_keys_warn(tmp_path, caplog):
    conf = dict(MSPROBE_EXAMPLE, seed=1234, is_deterministic=False, acl_config="x.json")
    conf["statistics"] = dict(conf["statistics"], precision="high")
    with caplog.at_level(logging.WARNING, logger="msprobe_core"):
        load_dump_config(write(tmp_path, conf))
    assert "seed" in caplog.text and "precision" in caplog.text


def test_unknown_key_did_you_mean(tmp_path):
    with pytest.raises(UnknownKeyError, match=r"unknown key 'dump_pth'.*did you mean 'dump_path'"):
        load_dump_config(write(tmp_path, dict(MSPROBE_EXAMPLE, dump_pth="x")))
    conf = dict(MSPROBE_EXAMPLE, statistics={"summary_mod": "md5"})
    with pytest.raises(UnknownKeyError, match=r"statistics.summary_mod.*did you mean 'statistics.summary_mode'"):
        load_dump_config(write(tmp_path, conf))


@pytest.mark.parametrize("patch,field,value", [
    ({"level": "L3"}, "level", "L3"),
    ({"task": "tensors"}, "task", "tensors"),
    ({"task": "acc_check"}, "task", "acc_check"),
    ({"step": ["3-1"]}, "step", "3-1"),
    ({"step": [-1]}, "step", "-1"),
    ({"rank": [-2]}, "rank", "-2"),
    ({"rank": "all"}, "rank", "all"),
    ({"async_dump": "false"}, "async_dump", "false"),
    ({"statistics": {"data_mode": ["all", "input"]}}, "statistics.data_mode", "all"),
    ({"statistics": {"data_mode": ["fwd"]}}, "statistics.data_mode", "fwd"),
    ({"statistics": {"summary_mode": "sha1"}}, "statistics.summary_mode", "sha1"),
    ({"statistics": {"scope": ["a"]}}, "statistics.scope", "a"),
    ({"dump_path": ""}, "dump_path", ""),
])
def test_bad_values_name_field_value_and_allowed(tmp_path, patch, field, value):
    conf = dict(MSPROBE_EXAMPLE, dump_path=str(tmp_path / "never"))
    conf.update(patch)
    with pytest.raises(ConfigError) as e:
        load_dump_config(write(tmp_path, conf))
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert f"'{field}'" in msg and value in msg and "allowed" in msg
    assert not (tmp_path / "never").exists()


def test_dump_path_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match="dump_path.*not a file"):
        PrecisionDebugger(dump_path=str(f))
    with pytest.raises(ConfigError, match="dump_path"):
        PrecisionDebugger(dump_path=str(f / "sub"))


@pytest.mark.parametrize("content,reason", [("{not json", "invalid JSON"), ("[1, 2]", "top level is a list"), (None, "no such file")])
def test_bad_config_files(tmp_path, content, reason):
    path = tmp_path / "c.json" if content is None else write(tmp_path, content)
    with pytest.raises(ConfigFileError, match=reason) as e:
        PrecisionDebugger(config_path=str(path))
    assert str(path) in str(e.value)
    assert isinstance(e.value, ValueError)


def _without_file_read_override() -> None:
    """In a child about to exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so even
    root gets "permission denied" on a file whose mode forbids reading."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_unreadable_config_file(tmp_path):
    """A config file the user may not read. root reads anything, so as root (CI, containers) the check runs in
    a child process without the capability to override file permissions."""
    p = write(tmp_path, MSPROBE_EXAMPLE)
    os.chmod(p, 0)
    try:
        if os.geteuid() != 0:
            with pytest.raises(ConfigFileError, match="permission denied"):
                load_dump_config(p)
            return
        import subprocess
        import sys
        from pathlib import Path

        code = ("import sys\nfrom msprobe_core.errors import ConfigFileError\nfrom msprobe_core.pytorch import PrecisionDebugger\n"
                "try:\n    PrecisionDebugger(config_path=sys.argv[1])\nexcept ConfigFileError as e:\n    print('ERROR', e)\n")
        root = str(Path(__file__).resolve().parents[3])
        try:
            proc = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=120,
                                  cwd=tmp_path, env=dict(os.environ, PYTHONPATH=root),
                                  preexec_fn=_without_file_read_override)
        except subprocess.SubprocessError as e:
            pytest.skip(f"root here cannot drop CAP_DAC_OVERRIDE for a child process ({e}), so cannot be refused a file")
        assert "ERROR" in proc.stdout and "permission denied" in proc.stdout, proc.stdout + proc.stderr[-2000:]
        assert str(p) in proc.stdout
    finally:
        os.chmod(p, 0o644)


def test_nothing_created_on_disk_by_a_bad_config(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError):
        PrecisionDebugger({"dump_path": str(out), "level": "L9"})
    assert not out.exists()
    # a debugger that failed to build is not kept: a good one can be made next
    PrecisionDebugger({"dump_path": str(out), "level": "L1"})
    assert not out.exists()  # nothing is written before start()


@pytest.mark.parametrize("token_range", [[3, 1], [-1, 2], [1], "1-3", [1.0, 2], [True, 2]])
def test_bad_token_range(tmp_path, token_range):
    import torch
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "o"), "level": "L1"})
    with pytest.raises(ConfigError, match=r"'token_range'.*allowed: a list or tuple of two ints") as e:
        dbg.start(model=torch.nn.Linear(2, 2), token_range=token_range)
    assert isinstance(e.value, ValueError)
    assert not (tmp_path / "o").exists()


def test_bad_start_arguments(tmp_path):
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "o"), "level": "L0"})
    with pytest.raises(ConfigError, match="'model'"):
        dbg.start()
    with pytest.raises(ConfigError, match="'rank_id'"):
        dbg.start(model=__import__("torch").nn.Linear(2, 2), rank_id=-1)
    assert not (tmp_path / "o").exists()
