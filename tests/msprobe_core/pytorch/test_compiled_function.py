"""An eager model that calls a ``torch.compile(dynamic=True)`` function (as vLLM's
``get_masked_input_and_mask``): the L1 and mix dumps leave its outputs bit-identical (the patched APIs that
Dynamo traces hand their records to an eager graph break, never to the tracer) and write no error log."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import msprobe_core
from msprobe_core.pytorch import PrecisionDebugger
from msprobe_core.pytorch.wrapper_names import FRAME_STRATEGIES

pytestmark = pytest.mark.slow  # compiles (seconds)


def masked_model() -> tuple[nn.Module, list[torch.Tensor]]:
    """The model (fresh compiled function, so it is compiled while the dump is on) and its eager outputs."""
    torch._dynamo.reset()

    @torch.compile(dynamic=True, backend="eager")
    def masked(x: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = (x >= lo) & (x < hi)
        return x * m, ~m

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, _ = masked(x, 0, 8)
            return self.emb(y)

    torch.manual_seed(0)
    return Masked(), [torch.arange(10), torch.arange(6)]


@pytest.mark.parametrize("level", ["L1", "mix"])
def test_compiled_function_outputs_bit_identical_under_dump(tmp_path: Path, level: str):
    model, inputs = masked_model()
    expected = [model(x) for x in inputs]
    torch._dynamo.reset()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "task": "statistics", "level": level})
    dbg.start(model)
    got = [model(x) for x in inputs]
    dbg.stop()
    dbg.step()
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert list(tmp_path.rglob("dump.json"))
    assert not list(tmp_path.rglob("dump_error_info.log"))


@pytest.mark.skipif(not FRAME_STRATEGIES, reason=f"torch {torch.__version__}: Dynamo has no frame strategies, so it "
                    "compiles the frames the dump's never-traced operator mode calls (its records stay eager and right)")
@pytest.mark.parametrize("level", ["L1", "mix"])
def test_function_compiled_before_the_dump_is_never_traced_with_the_tool(tmp_path: Path, level: str):
    """vLLM's tensor-parallel embedding: the function is compiled without the tool, then called on every step
    with the dump's operator mode on. Dynamo must not trace the mode (it crashed with "Guard failed on the same
    frame it was created" on the mode's lookup): the operators run eagerly through it, are recorded, and every
    step computes what it computes without the tool, without reaching the recompile limit."""
    from torch._dynamo.utils import counters

    model, inputs = masked_model()
    steps = [torch.arange(n) for n in (10, 6, 7, 9, 5, 11, 8, 12, 4, 13)]  # more shapes than the recompile limit
    expected = [model(x) for x in inputs + steps]  # compiled here, without the tool
    counters.clear()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "task": "statistics", "level": level})
    got = []
    for x in inputs + steps:
        dbg.start(model)
        got.append(model(x))
        dbg.stop()
        dbg.step()
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert not counters["recompiles"] or max(counters["recompiles"].values()) < torch._dynamo.config.recompile_limit
    assert not any("recompile_limit" in str(k) for k in counters["graph_break"])
    assert not list(tmp_path.rglob("dump_error_info.log"))
    from torch._dynamo.convert_frame import input_codes  # every code object Dynamo was asked to compile

    traced = {(c.co_filename, c.co_name) for c in (ref() for ref in input_codes.seen) if c is not None}
    tool = os.path.dirname(msprobe_core.__file__)
    assert not [t for t in traced if t[0].startswith(tool)], traced  # none of the tool's frames
    for step in range(len(got)):
        data = json.loads(next((tmp_path / f"step{step}").glob("*/dump.json")).read_text())["data"]
        assert {"Tensor.__ge__.0.forward", "Tensor.__and__.0.forward"} <= set(data), sorted(data)
