"""The monitor and the dump on a ``torch.compile``d model: the same names and numbers as the eager model
(``compare`` of the two L0 dumps finds no divergence; the monitor's weight, gradient and Adam-moment
statistics are the single-device ones), no record lost at any level, and no recompilation once warm
(``torch._dynamo.utils.counters`` counts graph breaks and graphs, stated in the docs).

The monitor and the L0 statistics dump compute their statistics inside the graph (``monitor.compiled_hooks``,
``pytorch.compiled_records``): no graph break, one graph, losses bit-identical with the tool on and off under
Inductor too (``test_inductor_losses_with_the_tool``). Level mix (and L1) wraps every API: a graph break at
each call (losses bit-identical with the ``aot_eager`` backend, Dynamo and AOTAutograd without kernel fusion;
under Inductor a graph break changes the kernels Inductor generates on both sides of it, in the last bits)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from compiled_models import fresh_dynamo, graph_breaks, in_graph_hooks, sliced_model, train_steps  # noqa: F401
from native_sharding import STEPS, make_model, reference, train

from msprobe_core.compare import compare_dumps
from msprobe_core.monitor.module_hooks import ActivationHooks
from msprobe_core.monitor.trainer_mon import TrainerMon
from msprobe_core.pytorch import PrecisionDebugger, compiled_taps
from msprobe_core.pytorch.compiled_taps import IN_GRAPH_GRAD_HOOKS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]  # each test compiles (seconds)


def run(model: nn.Module, steps: int, dump: Path | None = None, level: str = "L0", monitor: dict | None = None,
        out: Path | None = None) -> tuple[list[float], list]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dbg = PrecisionDebugger({"dump_path": str(dump), "task": "statistics", "level": level}) if dump else None
    mon = TrainerMon(monitor, output_dir=out).set_monitor(model, 1, opt) if monitor else None
    graphs: list = []
    losses = train_steps(model, opt, steps, dbg, after_step=lambda: graphs.append(counters["stats"]["unique_graphs"]))
    if mon:
        mon.close()
    return losses, graphs


MONITOR = {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
           "format": ["api"]}


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]  # each test compiles (seconds)


def test_tool_off_compiles_one_graph():
    run(torch.compile(sliced_model(), backend="aot_eager"), 3)
    assert graph_breaks() == 0 and counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("tool", ["monitor", "L0", "mix"])
def test_compiled_run_loses_nothing_and_stops_recompiling(tmp_path, tool):
    plain, _ = run(torch.compile(sliced_model(), backend="aot_eager"), 6)
    torch._dynamo.reset()
    counters.clear()
    kwargs = {"monitor": MONITOR, "out": tmp_path / "mon"} if tool == "monitor" else {"dump": tmp_path / "d", "level": tool}
    losses, graphs = run(torch.compile(sliced_model(), backend="aot_eager"), 6, **kwargs)
    assert losses == plain  # bit-identical with the tool on and off
    assert graphs[1] == graphs[-1], graphs  # compiled in the first steps, never again
    print(f"{tool}: {graph_breaks()} graph breaks, {graphs[-1]} graphs")  # the README's counts
    if tool != "mix":  # L1 breaks the graph at every API call (stated in the README)
        assert graph_breaks() <= 12, dict(counters["graph_break"])
    if tool != "monitor":
        assert not list((tmp_path / "d").rglob("dump_error_info.log"))
        for step in range(6):
            data = json.loads(next((tmp_path / "d" / f"step{step}").glob("*/dump.json")).read_text())["data"]
            assert "Module.0.Sliced.forward.0" in data and not any("_orig_mod" in k for k in data)


def test_eager_and_compiled_dumps_pair(tmp_path):
    eager, _ = run(sliced_model(), 2, dump=tmp_path / "eager")
    compiled, _ = run(torch.compile(sliced_model()), 2, dump=tmp_path / "compiled")
    assert eager == pytest.approx(compiled, rel=1e-5)
    for step in range(2):
        target = next((tmp_path / "compiled" / f"step{step}").iterdir())
        golden = next((tmp_path / "eager" / f"step{step}").iterdir())
        t_data = json.loads((target / "dump.json").read_text())["data"]
        g_data = json.loads((golden / "dump.json").read_text())["data"]
        assert set(t_data) == set(g_data)
        result = compare_dumps(target, golden)
        assert not result.has_errors, result.divergence


def test_monitor_on_compiled_model_gives_single_device_statistics(tmp_path):
    model = torch.compile(make_model())
    mon = TrainerMon(MONITOR, output_dir=tmp_path)
    got = []
    train(model, "compile", attach=lambda opt: mon.set_monitor(model, 1, opt),
          after_step=lambda step: got.append(mon.get_metrics()["metrics"]))
    mon.close()
    for step, want in zip(got, reference(STEPS)):
        for kind in ("param", "grad", "exp_avg", "exp_avg_sq"):
            assert set(step[kind]) == set(want[kind])  # no "_orig_mod." in the names
            for name, ops in want[kind].items():
                for op, value in ops.items():
                    assert step[kind][name][op] == pytest.approx(value, rel=1e-5, abs=1e-7), (kind, name, op)
        assert "0.output" in step["actv"] or any(k.startswith("0.") for k in step["actv"])


@in_graph_hooks
def test_inductor_losses_with_the_tool(tmp_path):
    """Default backend (Inductor). The monitor and the L0 statistics dump compute their statistics inside the
    graph (no graph break): losses bit-identical to those of the compiled model without the tool, one graph
    (``test_monitor_compiled.py``, ``test_compile_in_graph_records.py`` for their rows and records)."""
    plain, _ = run(torch.compile(sliced_model()), 3)
    for kwargs in ({"monitor": MONITOR, "out": tmp_path / "mon"}, {"dump": tmp_path / "d", "level": "L0"}):
        torch._dynamo.reset()
        counters.clear()
        losses, graphs = run(torch.compile(sliced_model()), 3, **kwargs)
        assert losses == plain and graph_breaks() == 0 and graphs[-1] == 1, kwargs


@pytest.mark.skipif(IN_GRAPH_GRAD_HOOKS, reason=f"torch {torch.__version__}: Dynamo traces the tool's gradient hooks")
def test_an_older_dynamo_keeps_the_eager_hooks_saying_so_once(tmp_path, monkeypatch, caplog):
    """torch 2.6: the tool's hooks stay eager on a model compiled as a whole (graph breaks), with one warning."""
    monkeypatch.setattr(compiled_taps, "_warned", False)
    model = torch.compile(sliced_model())
    with caplog.at_level(logging.WARNING, logger="msprobe_core.pytorch"):
        assert not compiled_taps.compiled_as_a_whole([model]) and not compiled_taps.compiled_as_a_whole([model])
        mon = TrainerMon(MONITOR, output_dir=tmp_path).set_monitor(model, 1, None)
        assert isinstance(mon._hooks, ActivationHooks)
        mon.close()
    assert [r.getMessage() for r in caplog.records if "keeps the eager hooks" in r.getMessage()] == [
        f"torch {torch.__version__}: Dynamo cannot trace the tool's gradient hooks (torch >= 2.11 can): the compiled "
        "model keeps the eager hooks, with a graph break at each hooked module"]
