"""``SkippedUpdates`` has an explicit interface: what it reads of its monitor is the ``WatchedMonitor``
protocol (public names only), the rest is given to its constructor; ``TrainerMon`` provides the protocol."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from msprobe_core.monitor import skipped_updates
from msprobe_core.monitor.skipped_updates import SkippedUpdates, WatchedMonitor


def test_it_reads_no_private_name_of_another_object():
    tree = ast.parse(Path(skipped_updates.__file__).read_text(encoding="utf-8"))
    private = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and node.attr.startswith("_") and not node.attr.startswith("__")
                      and not (isinstance(node.value, ast.Name) and node.value.id == "self")})
    assert private == []


def test_every_protocol_member_is_a_public_member_of_trainer_mon(tmp_path):
    from msprobe_core.monitor.trainer_mon import TrainerMon

    members = set(WatchedMonitor.__annotations__) | {n for n, v in vars(WatchedMonitor).items()
                                                     if isinstance(v, property)}
    assert all(not m.startswith("_") for m in members)
    mon = TrainerMon({"wg_distribution": True, "ops": ["norm"]}, output_dir=tmp_path)
    try:
        assert [m for m in sorted(members) if not hasattr(mon, m)] == []
        assert mon._skips.monitor is mon and mon._skips.step is mon._step  # given the step in progress
    finally:
        mon.close()
    params = inspect.signature(SkippedUpdates.__init__).parameters
    assert params["monitor"].annotation == "WatchedMonitor"
