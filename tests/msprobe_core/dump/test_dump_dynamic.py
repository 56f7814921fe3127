"""The dump's configuration while the job runs: ``dump_enable`` edits of the config file, and a second
``PrecisionDebugger(config_path=OTHER)`` in the same process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dump_models import TinyNet
from msprobe_log import msprobe_messages
from msprobe_core.errors import ConfigError, DumpStateError
from msprobe_core.pytorch import PrecisionDebugger

PROC = f"proc{os.getpid()}"


def write_config(path, **doc) -> str:
    """Write a config the way an editor does (a new file renamed over the old one)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
    return str(path)


def train_step(dbg, model, backward=True):
    dbg.start(model)
    y = model(torch.randn(2, 8))
    if backward:
        y.sum().backward()
    dbg.stop()
    dbg.step()


def steps_in(dump_path):
    return sorted((p.name for p in dump_path.iterdir()), key=lambda n: int(n[4:])) if dump_path.exists() else []


def records(dump_path, step):
    return json.loads((dump_path / f"step{step}" / PROC / "dump.json").read_text())


# ------------------------------------------------------------------------------------------------ dump_enable
def test_dump_enable_switches_the_dump_off_and_on_while_training(tmp_path):
    out = tmp_path / "dump"
    cfg = write_config(tmp_path / "config.json", dump_path=str(out), level="L1", dump_enable=True)
    model = TinyNet()
    dbg = PrecisionDebugger(config_path=cfg)
    with msprobe_messages() as messages:
        for i in range(6):
            train_step(dbg, model)
            if i == 1:
                write_config(cfg, dump_path=str(out), level="L1", dump_enable=False)
            if i == 3:
                write_config(cfg, dump_path=str(out), level="L1", dump_enable=True)
    assert steps_in(out) == ["step0", "step1", "step4", "step5"]   # steps keep the training's numbers
    assert dbg.current_step == 6
    assert "Functional.linear.0.forward" in records(out, 4)["data"]
    text = "\n".join(messages)
    assert "dump_enable is now False" in text and "pauses from step 2" in text and "resumes from step 4" in text


def test_dump_enable_false_from_the_start_dumps_nothing_until_switched_on(tmp_path):
    out = tmp_path / "dump"
    cfg = write_config(tmp_path / "config.json", dump_path=str(out), dump_enable=False)
    model = TinyNet()
    dbg = PrecisionDebugger(cfg)
    for _ in range(2):
        train_step(dbg, model)
    assert not out.exists() and not dbg.enabled
    write_config(cfg, dump_path=str(out), dump_enable=True)
    train_step(dbg, model)
    assert steps_in(out) == ["step2"] and dbg.enabled


def test_other_keys_edited_with_dump_enable_apply_from_the_next_step(tmp_path):
    out = tmp_path / "dump"
    cfg = write_config(tmp_path / "config.json", dump_path=str(out), level="L1", dump_enable=True)
    model = TinyNet()
    dbg = PrecisionDebugger(cfg)
    train_step(dbg, model)
    write_config(cfg, dump_path=str(out), level="L0", dump_enable=True, step=[1, 3])
    for _ in range(4):
        train_step(dbg, model)
    assert steps_in(out) == ["step0", "step1", "step3"]   # the same run: its own step folders are not "taken"
    assert records(out, 0)["level"] == "L1" and records(out, 3)["level"] == "L0"
    assert "Module.linear.Linear.forward.0" in records(out, 3)["data"]


def test_an_invalid_edit_is_logged_and_the_previous_config_kept(tmp_path):
    out = tmp_path / "dump"
    cfg = write_config(tmp_path / "config.json", dump_path=str(out), dump_enable=True)
    model = TinyNet()
    dbg = PrecisionDebugger(cfg)
    train_step(dbg, model)
    write_config(cfg, dump_path=str(out), dump_enable="no")
    with msprobe_messages() as messages:
        train_step(dbg, model)
    assert steps_in(out) == ["step0", "step1"]
    text = "\n".join(messages)
    assert "changed but is invalid, keeping the previous one" in text and "'dump_enable' = 'no'" in text


def test_without_dump_enable_the_file_is_read_once(tmp_path):
    out = tmp_path / "dump"
    cfg = write_config(tmp_path / "config.json", dump_path=str(out))
    model = TinyNet()
    dbg = PrecisionDebugger(cfg)
    train_step(dbg, model)
    write_config(cfg, dump_path=str(out), dump_enable=False)
    train_step(dbg, model)
    assert steps_in(out) == ["step0", "step1"]


def test_dump_enable_in_a_dict_config_and_bad_values(tmp_path):
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "dump_enable": False})
    train_step(dbg, TinyNet())
    assert not (tmp_path / "d").exists()
    PrecisionDebugger.reset()
    with pytest.raises(ConfigError, match="dump_enable"):
        PrecisionDebugger({"dump_path": str(tmp_path / "d"), "dump_enable": "false"})


# ------------------------------------------------------------------------------------ a second debugger
def test_second_debugger_with_another_config_applies_it_when_idle(tmp_path):
    a = write_config(tmp_path / "a.json", dump_path=str(tmp_path / "A"), level="L1")
    b = write_config(tmp_path / "b.json", dump_path=str(tmp_path / "B"), level="L0")
    model = TinyNet()
    first = PrecisionDebugger(config_path=a)
    for _ in range(2):
        train_step(first, model)
    second = PrecisionDebugger(config_path=b)
    assert second is first and second.config.level == "L0" and second.current_step == 0
    train_step(second, model)
    assert steps_in(tmp_path / "A") == ["step0", "step1"] and steps_in(tmp_path / "B") == ["step0"]
    assert records(tmp_path / "B", 0)["level"] == "L0"
    assert "Module.linear.Linear.forward.0" in records(tmp_path / "B", 0)["data"]
    assert PrecisionDebugger.current() is first


def test_same_config_or_no_arguments_change_nothing(tmp_path):
    a = write_config(tmp_path / "a.json", dump_path=str(tmp_path / "A"))
    model = TinyNet()
    dbg = PrecisionDebugger(config_path=a)
    train_step(dbg, model)
    service = dbg.service
    assert PrecisionDebugger() is dbg and PrecisionDebugger(config_path=a) is dbg
    assert dbg.service is service and dbg.current_step == 1   # e.g. a second file constructing it again
    train_step(dbg, model)
    assert steps_in(tmp_path / "A") == ["step0", "step1"]


@pytest.mark.parametrize("where", ["between start and stop", "after stop, before step"])
def test_second_debugger_in_the_middle_of_a_step_is_refused(tmp_path, where):
    a = write_config(tmp_path / "a.json", dump_path=str(tmp_path / "A"))
    b = write_config(tmp_path / "b.json", dump_path=str(tmp_path / "B"), level="L0")
    model = TinyNet()
    dbg = PrecisionDebugger(config_path=a)
    dbg.start(model)
    loss = model(torch.randn(2, 8)).sum()
    if where != "between start and stop":
        dbg.stop()
    with pytest.raises(DumpStateError) as err:
        PrecisionDebugger(config_path=b)
    assert a in str(err.value) and b in str(err.value) and "step 0" in str(err.value)
    loss.backward()   # the first config goes on undisturbed
    dbg.stop()
    dbg.step()
    assert dbg.config.source == a and steps_in(tmp_path / "A") == ["step0"] and not (tmp_path / "B").exists()
    assert "Functional.linear.0.backward" in records(tmp_path / "A", 0)["data"]


def test_invalid_second_config_raises_and_keeps_the_first(tmp_path):
    a = write_config(tmp_path / "a.json", dump_path=str(tmp_path / "A"))
    bad = write_config(tmp_path / "bad.json", dump_path=str(tmp_path / "B"), level="L7")
    dbg = PrecisionDebugger(config_path=a)
    with pytest.raises(ConfigError, match="L7"):
        PrecisionDebugger(config_path=bad)
    assert PrecisionDebugger.current() is dbg and dbg.config.source == a
    train_step(dbg, TinyNet())
    assert steps_in(tmp_path / "A") == ["step0"]


def test_second_debugger_on_the_same_dump_path_never_overwrites_the_first_runs_steps(tmp_path):
    from msprobe_core.errors import DumpPathError

    a = write_config(tmp_path / "a.json", dump_path=str(tmp_path / "A"), level="L1")
    b = write_config(tmp_path / "b.json", dump_path=str(tmp_path / "A"), level="L0")
    model = TinyNet()
    train_step(PrecisionDebugger(config_path=a), model)
    dbg = PrecisionDebugger(config_path=b)
    with pytest.raises(DumpPathError, match="already holds a dump"):
        dbg.start(model)


def test_arguments_without_a_config_path_change_the_current_config(tmp_path):
    a = write_config(tmp_path / "a.json", dump_path=str(tmp_path / "A"), level="L0")
    model = TinyNet()
    dbg = PrecisionDebugger(config_path=a)
    train_step(dbg, model)
    assert PrecisionDebugger(dump_path=str(tmp_path / "B")) is dbg
    assert (dbg.config.level, dbg.config.dump_path, dbg.current_step) == ("L0", str(tmp_path / "B"), 0)
    train_step(dbg, model)
    assert records(tmp_path / "B", 0)["level"] == "L0"
