"""An L1 dump with an ``aten`` section (msprobe's ``Aten`` records, a ``TorchDispatchMode`` between ``start()`` and
``stop()``) on a ``torch.compile``d model: Dynamo runs no compiled code while a dispatch mode is active, so
between ``start()`` and ``stop()`` the compiled model runs eagerly, and the dump is that of the eager model: no
record lost, the same records and statistics as the eager run (``compare`` finds no divergence). A model whose
first call ran under the mode is never compiled afterwards (Dynamo marks its code as skipped, until
``torch._dynamo.reset()``); one compiled before runs its compiled code again after ``stop()``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from compiled_models import fresh_dynamo, sliced_model as make_model  # noqa: F401  (a fixture)

from msprobe_core.compare import compare_dumps
from msprobe_core.pytorch import PrecisionDebugger
from msprobe_core.pytorch.wrapper_names import FRAME_STRATEGIES

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]  # compiles (seconds)

WRAP = "functional:\n  - layer_norm\ntensor:\n  - pow\naten:\n  - addmm\n  - native_layer_norm\n  - add.Tensor\n"


def train(model: nn.Module, dump: Path, wrap: Path, steps: int = 2, warmup: int = 0) -> list[float]:
    """``warmup`` steps without the dump, then ``steps`` dumped steps; the dumped steps' losses."""
    torch.manual_seed(1)
    data = [torch.randn(4, 5, 8) for _ in range(warmup + steps)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in data[:warmup]:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    dbg = PrecisionDebugger({"dump_path": str(dump), "task": "statistics", "level": "L1"}, wrap_list=str(wrap))
    losses = []
    for x in data[warmup:]:
        dbg.start(model)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        dbg.stop()
        dbg.step()
        losses.append(loss.item())
    PrecisionDebugger.reset()
    return losses


def _same_records(target_root: Path, golden_root: Path) -> None:
    for step in range(2):
        target = next((target_root / f"step{step}").iterdir())
        golden = next((golden_root / f"step{step}").iterdir())
        names = set(json.loads((target / "dump.json").read_text())["data"])
        assert names == set(json.loads((golden / "dump.json").read_text())["data"])
        assert {"Aten.addmm.default.0.forward", "Aten.add.Tensor.0.forward", "Functional.layer_norm.0.forward"} <= names
        result = compare_dumps(target, golden)
        assert not result.has_errors, result.divergence


def test_aten_records_of_a_compiled_model_are_the_eager_ones(tmp_path):
    wrap = tmp_path / "ops.yaml"
    wrap.write_text(WRAP)
    eager = train(make_model(), tmp_path / "eager", wrap)
    model = torch.compile(make_model())
    compiled = train(model, tmp_path / "compiled", wrap)
    assert counters["stats"]["unique_graphs"] == 0  # first called under the dispatch mode: never compiled
    assert compiled == eager  # the eager model's numbers, bit for bit
    _same_records(tmp_path / "compiled", tmp_path / "eager")
    model(torch.randn(4, 5, 8)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 0  # still eager after stop() (until torch._dynamo.reset())


@pytest.mark.skipif(not FRAME_STRATEGIES, reason=f"torch {torch.__version__}: torch._dynamo.reset() keeps the code that "
                    "Dynamo skipped under a dispatch mode (another test's model) skipped: this model would not compile")
def test_a_model_compiled_before_the_dump_runs_eagerly_inside_it_only(tmp_path):
    wrap = tmp_path / "ops.yaml"
    wrap.write_text(WRAP)
    eager = train(make_model(), tmp_path / "eager", wrap, warmup=1)
    model = torch.compile(make_model())
    compiled = train(model, tmp_path / "compiled", wrap, warmup=1)  # compiled by the warm-up step
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    assert compiled == pytest.approx(eager, rel=1e-5)  # the warm-up step ran compiled, the dumped ones eagerly
    _same_records(tmp_path / "compiled", tmp_path / "eager")
    model(torch.randn(4, 5, 8)).sum().backward()  # after stop(): its compiled code again, no new graph
    assert counters["stats"]["unique_graphs"] == graphs
