"""The monitor on a model compiled as a whole (``torch.compile(model)``, Inductor): activation statistics and
their gradients are computed inside the graph (``monitor.compiled_hooks``), so the monitor adds no graph break
and no graph (counted with ``torch._dynamo.utils.counters``, tool on and off), the losses are bit-identical to
the compiled model without it, and its rows are those of the eager run of the same model: the same names,
kinds, call order, micro-batches, aliases (but the root module's) and external flags, values within float32
rounding (rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from compiled_models import fresh_dynamo, graph_breaks, in_graph_hooks, sliced_model  # noqa: F401  (a fixture)

from msprobe_core.monitor import collector as collector_module
from msprobe_core.monitor.compiled_hooks import CompiledActivationHooks
from msprobe_core.monitor.trainer_mon import TrainerMon

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo"), in_graph_hooks]  # compiles with Inductor (seconds)

MONITOR = {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
           "format": ["api"]}
STEPS = 4


def make_model(inplace: bool = False) -> nn.Module:
    return sliced_model(inplace)  # an in-place ReLU modifies the output of the block before it


def train(model: nn.Module, monitor: dict | None, tmp_path, acc: int = 1) -> tuple[list[float], list[list]]:
    """``STEPS`` steps of ``acc`` micro-batches; the losses and each monitored step's rows."""
    torch.manual_seed(1)
    data = [torch.randn(4, 5, 8) for _ in range(STEPS * acc)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = TrainerMon(monitor, output_dir=tmp_path / "mon").set_monitor(model, acc, opt) if monitor else None
    losses, steps = [], []
    finalize = collector_module.StepCollector.finalize

    def keep(self):
        rows = finalize(self)
        steps.append(rows)
        return rows

    collector_module.StepCollector.finalize = keep
    try:
        for s in range(STEPS):
            opt.zero_grad()
            for k in range(acc):
                loss = model(data[s * acc + k]).pow(2).mean()
                loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        collector_module.StepCollector.finalize = finalize
        if mon is not None:
            mon.close()
    return losses, steps


def _activation_rows(rows: list) -> list:
    return [r for r in rows if r.kind in ("actv", "actv_grad")]


def _where(r) -> tuple:
    return r.kind, r.name, r.micro_step


def _same_rows(got: list, want: list) -> None:
    """The same rows in the same order; the root module's rows (its hooks run eagerly, around the graph, where
    the graph's tensors are not known) are never aliases and its gradients' rows come first (its output) and
    last (its input) of their backward pass."""
    def key(r):
        return r.kind, r.name, r.module, r.micro_step, r.numel, r.alias, r.external

    inner = [[key(r) for r in rows if r.module != "model"] for rows in (got, want)]
    assert inner[0] == inner[1]
    root = [{r.name: r for r in rows if r.module == "model" and r.kind.startswith("actv")} for rows in (got, want)]
    assert {(r.kind, n) for n, r in root[0].items()} == {(r.kind, n) for n, r in root[1].items()}
    assert [r.kind for r in got] == [r.kind for r in want]  # activation rows before the other kinds, as in eager
    for g, w in zip(sorted(got, key=_where), sorted(want, key=_where)):
        assert g.values == pytest.approx(w.values, rel=1e-5, abs=1e-6), (g.kind, g.name)


@pytest.mark.parametrize("inplace, acc", [(False, 1), (True, 1), (False, 2)], ids=["plain", "inplace-relu", "2-micro"])
def test_no_graph_break_bit_identical_losses_and_the_eager_rows(tmp_path, inplace, acc):
    plain, _ = train(torch.compile(make_model(inplace)), None, tmp_path, acc)
    assert graph_breaks() == 0 and counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(make_model(inplace))
    losses, steps = train(compiled, MONITOR, tmp_path, acc)
    print(f"monitor on the compiled model: {graph_breaks()} graph breaks, {counters['stats']['unique_graphs']} graph")
    assert graph_breaks() == 0 and counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])
    assert losses == plain  # bit-identical with the monitor on and off (Inductor)
    _, eager = train(make_model(inplace), MONITOR, tmp_path, acc)
    assert len(steps) == len(eager) == STEPS
    for got, want in zip(steps, eager):
        assert len(_activation_rows(got)) == len(_activation_rows(want)) > 0
    _same_rows(steps[0], eager[0])  # same weights at step 0: the same values (later steps drift with Inductor)


def test_unmonitored_steps_cost_no_graph(tmp_path):
    """Steps the schedule skips run the same graph (the hooks read no monitor state); their rows are dropped."""
    plain, _ = train(torch.compile(make_model()), None, tmp_path)
    torch._dynamo.reset()
    counters.clear()
    config = dict(MONITOR, step_interval=2)
    losses, steps = train(torch.compile(make_model()), config, tmp_path)
    assert losses == plain
    assert graph_breaks() == 0 and counters["stats"]["unique_graphs"] == 1
    assert len(steps) == STEPS // 2 and all(_activation_rows(rows) for rows in steps)


def test_the_compiled_route_is_taken_only_for_a_compiled_model(tmp_path):
    for model, compiled in ((torch.compile(make_model()), True), (make_model(), False)):
        mon = TrainerMon(MONITOR, output_dir=tmp_path / "mon").set_monitor(model, 1, None)
        assert isinstance(mon._hooks, CompiledActivationHooks) is compiled
        mon.close()
