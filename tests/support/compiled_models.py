"""What the torch.compile tests share: a small block whose forward slices a tensor and uses an intermediate
twice, Dynamo's graph-break count, and a fixture that gives each test a fresh Dynamo."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters


class Sliced(nn.Module):
    """A block whose forward indexes a tensor (torch.compile's code then holds slice constants) and uses an
    intermediate twice (its gradient is the sum of both uses; a call's own share is half of it); ``scale`` is a
    keyword argument."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.fc(x)[:, 1:]
        return F.layer_norm(h, (8,)) * scale + self.ln(h)


def sliced_model(inplace: bool = False) -> nn.Module:
    """``Sequential(Sliced, ReLU, Sliced)`` with fixed weights; ``inplace``: the ReLU modifies its input."""
    torch.manual_seed(0)
    return nn.Sequential(Sliced(), nn.ReLU(inplace=inplace), Sliced())


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters emptied before and after the test."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
