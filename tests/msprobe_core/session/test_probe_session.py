"""The integration API: the lifecycle events an integration drives, the folder a step wrote, the optimizer
patch option, engine followers, and a session that leaves nothing behind."""

from __future__ import annotations

import logging
import os

import torch

from msprobe_core.pytorch import PrecisionDebugger
from msprobe_core.session import ProbeSession, register_engine_follower

MONITOR = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, "xy_distribution": True,
           "ops": ["min", "max", "norm"], "format": ["api"]}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def _train_step(model, optimizer):
    optimizer.zero_grad()
    loss = model(torch.ones(2, 4)).pow(2).mean()
    loss.backward()
    return loss


def test_the_lifecycle_writes_the_dump_and_the_monitor_and_close_leaves_nothing(tmp_path):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    session = ProbeSession({"task": "statistics", "level": "mix", "dump_path": str(tmp_path / "dump")}, MONITOR,
                           monitor_output_dir=str(tmp_path / "mon"))
    session.attach(model, optimizer, start_iteration=1)
    assert session.model is model and session.optimizer is optimizer
    folders = []
    for step in (1, 2):
        session.begin_step(step)
        _train_step(model, optimizer)
        session.gradients_ready()
        session.before_optimizer_step()
        optimizer.step()
        metrics = session.after_optimizer_step(step)
        assert metrics["step"] == step and {"grad", "param", "exp_avg", "actv"} <= set(metrics["metrics"])
        folders.append(session.end_step())
    name = f"proc{os.getpid()}"  # no torch.distributed: the process's folder
    assert folders == [tmp_path / "dump" / f"step{s}" / name for s in (1, 2)]
    assert all((f / "dump.json").is_file() for f in folders)
    assert session.output_folders() == [tmp_path / "dump", tmp_path / "mon"]
    session.close()
    session.close()  # idempotent
    assert PrecisionDebugger.current() is None  # the session's debugger is released
    assert session.end_step() is None


def test_patch_optimizer_drives_the_optimizer_step_events_with_the_framework_label(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    labels = iter([7, 8])
    session = ProbeSession(None, MONITOR, monitor_output_dir=str(tmp_path))
    session.attach(model, optimizer, patch_optimizer=True, step_label=lambda: next(labels))
    seen = []
    for _ in range(2):
        _train_step(model, optimizer)
        optimizer.step()
        seen.append(session.monitor.get_metrics()["step"])
    assert seen == [7, 8]
    session.close()
    assert "step" not in vars(optimizer)


def test_the_session_follows_an_engine_through_a_registered_follower(tmp_path, caplog):
    removed = []

    class Handle:
        def remove(self):
            removed.append(True)

    def follower(session, current_step):
        assert current_step() == 3
        return Handle()

    register_engine_follower("test-engine", follower)
    session = ProbeSession(None, MONITOR, monitor_output_dir=str(tmp_path))
    session.attach(_model())
    assert isinstance(session.follow_engine("test-engine", lambda: 3), Handle)
    with caplog.at_level(logging.WARNING, logger="msprobe_core"):
        assert session.follow_engine("no-such-engine", lambda: 0) is None
    assert "no integration follows no-such-engine engines" in caplog.text
    session.close()
    assert removed == [True]


def test_a_session_without_configs_does_nothing():
    session = ProbeSession()
    session.attach(_model())
    session.begin_step(1)
    session.gradients_ready()
    session.before_optimizer_step()
    assert session.after_optimizer_step(1) is None and session.end_step() is None
    assert session.output_folders() == [] and session.dump_path is None and session.dump_step is None
    session.close()
