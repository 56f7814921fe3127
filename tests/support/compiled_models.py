"""What the torch.compile tests share: a small block whose forward slices a tensor and uses an intermediate
twice, Dynamo's graph-break count, a fixture that gives each test a fresh Dynamo, and the training loop."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from msprobe_core.pytorch.compiled_taps import IN_GRAPH_GRAD_HOOKS


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


in_graph_hooks = pytest.mark.skipif(
    not IN_GRAPH_GRAD_HOOKS, reason=f"torch {torch.__version__}: Dynamo cannot trace gradient hooks of intermediate "
    "tensors (torch >= 2.11 can): the tool keeps its eager hooks on a compiled model (graph breaks)")
"""Tests of the tool's hooks inside a compiled model's graph (``compiled_taps.IN_GRAPH_GRAD_HOOKS``)."""


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters emptied before and after the test."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, dbg=None, acc: int = 1,
          after_step: Callable[[], None] | None = None) -> list[float]:
    """``steps`` optimizer steps of ``acc`` micro-batches each (batches of ``randn(4, 5, 8)``, seed 1), the dump
    ``dbg`` (a ``PrecisionDebugger`` or None) around each step, ``after_step()`` after each; returns the loss of
    each step's last micro-batch."""
    torch.manual_seed(1)
    data = [torch.randn(4, 5, 8) for _ in range(steps * acc)]
    losses = []
    for s in range(steps):
        if dbg:
            dbg.start(model)
        opt.zero_grad()
        for x in data[s * acc:(s + 1) * acc]:
            loss = model(x).pow(2).mean()
            loss.backward()
        opt.step()
        if dbg:
            dbg.stop()
            dbg.step()
        losses.append(loss.item())
        if after_step:
            after_step()
    return losses
