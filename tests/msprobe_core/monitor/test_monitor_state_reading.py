"""Reading a step's gradients and optimizer moments (``TorchStateReader``, ``StateRecorder``) by columns gives what
the per-parameter loop gives: the same names, tensors and order for every mix of optimizer states."""

from __future__ import annotations

import torch
from torch import nn

from msprobe_core.monitor.state_readers import STATE_KINDS, TorchStateReader
from msprobe_core.monitor.state_recorder import StateRecorder


def _by_loop(state: dict, params: dict) -> dict:
    """The per-parameter loop the reader's columns stand for."""
    out: dict = {}
    for name, p in params.items():
        s = state.get(p)
        if not s:
            continue
        for key, kind in STATE_KINDS.items():
            t = s.get(key)
            if isinstance(t, torch.Tensor):
                out.setdefault(kind, {})[name] = t
    return out


def _same(a: dict, b: dict) -> bool:
    return (list(a) == list(b) and all(list(a[k]) == list(b[k]) for k in a)
            and all(a[k][n] is b[k][n] for k in a for n in a[k]))


class _Opt:
    def __init__(self, state: dict):
        self.state = state


def test_optimizer_states_by_columns_are_the_loops():
    params = {f"p{i}": nn.Parameter(torch.randn(3)) for i in range(6)}
    ps = list(params.values())
    t = lambda: torch.randn(3)  # noqa: E731
    cases = [
        {p: {"step": torch.tensor(1.0), "exp_avg": t(), "exp_avg_sq": t()} for p in ps},  # Adam
        {p: {"momentum_buffer": t()} for p in ps[1:]},  # SGD with momentum, one parameter without state
        {p: {"momentum_buffer": None} for p in ps},  # SGD before its first step
        {ps[0]: {"exp_avg_sq": t()}, ps[1]: {"exp_avg": t(), "exp_avg_sq": t()}},  # kinds met out of order
        {ps[0]: {"exp_avg": t()}, ps[1]: {"momentum_buffer": t()}, ps[2]: {"exp_avg": t(), "momentum_buffer": t()}},
        {ps[3]: {}, ps[4]: {"exp_avg": "not a tensor", "exp_avg_sq": t()}},
        {p: {"exp_avg": nn.Parameter(t()) if i % 2 else t(), "exp_avg_sq": None if i == 2 else t()}  # subclasses, a gap
         for i, p in enumerate(ps)},
    ]
    reader = TorchStateReader()
    for state in cases:
        assert _same(reader.optimizer_states(_Opt(state), params), _by_loop(state, params))
    assert reader.optimizer_states(_Opt({}), params) == {}


def test_gradients_in_backward_order_with_and_without_every_parameter():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    recorder = StateRecorder(TorchStateReader())
    recorder.select([model], lambda name: True)
    model(torch.randn(1, 2)).sum().backward()
    names = list(recorder.params)
    assert list(recorder.grads()) == names[::-1]
    model[0].bias.grad = None
    assert list(recorder.grads()) == [n for n in names[::-1] if n != "0.bias"]
    extra = {**{n: p.grad for n, p in recorder.params.items() if p.grad is not None}, "own": torch.ones(1)}
    assert list(recorder.grads(extra)) == [n for n in names[::-1] if n != "0.bias"] + ["own"]
