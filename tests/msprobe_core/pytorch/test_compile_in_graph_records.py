"""The L0 statistics dump on a model compiled as a whole (``torch.compile(model)``, Inductor): the module records
come from statistics computed inside the graph (``pytorch.compiled_records``), so the dump adds no graph break
and no graph (``torch._dynamo.utils.counters`` with the dump on and off), the losses are bit-identical to the
compiled model without it over several steps, and the records are those of the eager run of the same model:
the same names (forward, backward, parameters_grad), construct.json parents, and ``compare`` of the two dumps
finds no divergence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from compiled_models import Sliced, fresh_dynamo, graph_breaks, in_graph_hooks, train_steps  # noqa: F401

from msprobe_core.compare import compare_dumps
from msprobe_core.pytorch import PrecisionDebugger

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]  # compiles with Inductor (seconds)

STEPS = 3


class Net(nn.Module):
    """Two blocks (the second called with a keyword argument) around a ReLU."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.a = Sliced()
        self.act = nn.ReLU(inplace=inplace)
        self.b = Sliced()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)), scale=0.5)


def make_model(inplace: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return Net(inplace)


def run(model: nn.Module, dump: Path | None, acc: int = 1) -> list[float]:
    """``STEPS`` steps of ``acc`` micro-batches each; the losses of each step's last micro-batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dbg = PrecisionDebugger({"dump_path": str(dump), "task": "statistics", "level": "L0"}) if dump else None
    losses = train_steps(model, opt, STEPS, dbg, acc)
    PrecisionDebugger.reset()
    return losses


def _files(root: Path, step: int) -> tuple[Path, dict, dict]:
    folder = next((root / f"step{step}").iterdir())
    return (folder, json.loads((folder / "dump.json").read_text())["data"],
            json.loads((folder / "construct.json").read_text()))


@in_graph_hooks
@pytest.mark.parametrize("inplace, acc", [(False, 1), (True, 1), (False, 2)], ids=["plain", "inplace-relu", "2-micro"])
def test_no_graph_break_bit_identical_losses_and_the_eager_records(tmp_path, inplace, acc):
    plain = run(torch.compile(make_model(inplace)), None, acc)
    assert graph_breaks() == 0 and counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    counters.clear()
    losses = run(torch.compile(make_model(inplace)), tmp_path / "compiled", acc)
    print(f"L0 dump on the compiled model: {graph_breaks()} graph breaks, {counters['stats']['unique_graphs']} graph")
    assert graph_breaks() == 0 and counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])
    assert losses == plain  # bit-identical with the dump on and off (Inductor)
    eager = run(make_model(inplace), tmp_path / "eager", acc)
    assert eager == pytest.approx(losses, rel=1e-5)
    for step in range(STEPS):
        target, got, got_parents = _files(tmp_path / "compiled", step)
        golden, want, want_parents = _files(tmp_path / "eager", step)
        assert set(got) == set(want)
        assert {"Module.a.Sliced.forward.0", "Module.a.Sliced.backward.0", "Module.a.fc.Linear.parameters_grad.0",
                "Module.b.ln.LayerNorm.backward.0"} <= set(got)
        assert got_parents == want_parents
        assert got["Module.b.Sliced.forward.0"]["input_kwargs"] == {"scale": {"type": "float", "value": 0.5}}
        result = compare_dumps(target, golden)
        assert not result.has_errors, result.divergence
    # the own share of an input's gradient (ln's input is also used by F.layer_norm in Sliced.forward: its whole
    # gradient is about twice as large); Inductor's gradient of these near-cancelling sums differs from eager
    # mode's in the 4th digit
    _, got, _ = _files(tmp_path / "compiled", 0)
    _, want, _ = _files(tmp_path / "eager", 0)
    for field in ("input", "output"):
        for g, w in zip(got["Module.a.ln.LayerNorm.backward.0"][field], want["Module.a.ln.LayerNorm.backward.0"][field]):
            assert g["Norm"] == pytest.approx(w["Norm"], rel=1e-2)


@pytest.mark.parametrize("config", [{"level": "mix"}, {"statistics": {"summary_mode": "md5"}}],
                         ids=["mix", "md5"])
def test_other_dumps_keep_the_eager_hooks(tmp_path, config):
    """Level mix (every API wrapped) and checksums read the tensors themselves: the eager route."""
    model = torch.compile(make_model())
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "task": "statistics", "level": "L0", **config})
    dbg.start(model)
    model(torch.randn(4, 5, 8)).sum().backward()
    dbg.stop()
    assert dbg.service._in_graph is None
    PrecisionDebugger.reset()
