"""An eager model that calls a ``torch.compile(dynamic=True)`` function (as vLLM's
``get_masked_input_and_mask``): the L1 and mix dumps leave its outputs bit-identical (the patched APIs that
Dynamo traces hand their records to an eager graph break, never to the tracer) and write no error log."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from msprobe_core.pytorch import PrecisionDebugger

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
