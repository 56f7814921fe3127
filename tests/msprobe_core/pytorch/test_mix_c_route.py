"""At the mix level the L0 hooks in C (``stats/_fast_l0.c``) serve the usual module call although the dump's own
operator mode (``ApiPatcher``'s TorchFunctionMode) is on: it is not a mode in their way (``foreign_mode_on``), and
their tensor reads run with torch functions off, as the Python route's. Another mode still sends every call to the
Python route (``test_l0_fast_hooks`` checks that both routes write the same files)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from msprobe_core.dump.call_records import CallRecords
from msprobe_core.pytorch import PrecisionDebugger
from msprobe_core.stats.kernel import KERNEL

pytestmark = pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")


class _Passing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _python_route_calls(tmp_path, monkeypatch, mode=None) -> tuple[int, bool]:
    """How many module calls of one mix step took the Python route, and whether the dump's operator mode was on."""
    calls = []
    original = CallRecords._module_pre
    monkeypatch.setattr(CallRecords, "_module_pre", lambda self, *a: calls.append(a) or original(self, *a))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "mix", "task": "statistics"})
    dbg.start(model)
    own_mode = dbg.service.patcher.foreign_mode_on() is False and torch._C._is_torch_function_mode_enabled()
    if mode is None:
        loss = model(torch.randn(2, 8)).sum()
    else:
        with mode:
            loss = model(torch.randn(2, 8)).sum()
    loss.backward()
    dbg.stop()
    dbg.step()
    return len(calls), own_mode


def test_mix_module_calls_take_the_c_route_under_the_dumps_own_mode(tmp_path, monkeypatch):
    assert _python_route_calls(tmp_path, monkeypatch) == (0, True)


def test_another_mode_sends_mix_module_calls_to_the_python_route(tmp_path, monkeypatch):
    assert _python_route_calls(tmp_path, monkeypatch, _Passing()) == (3, True)  # each of the three layers
