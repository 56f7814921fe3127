"""A monitor step begins with a new ``StepState``: nothing of the step before (its reads, its gradients, its
learning rates, its forward count) carries over."""

from __future__ import annotations

import torch
from torch import nn

from msprobe_core.monitor.step_state import StepState
from msprobe_core.monitor.trainer_mon import TrainerMon


def test_each_step_starts_from_a_fresh_state(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "param_distribution": True, "format": ["api"]}
    mon = TrainerMon(cfg, output_dir=tmp_path / "out").set_monitor(model, 1, opt)
    try:
        states = []
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            mon.pre_optimizer_step()
            during = mon._step
            assert during.collecting and during.pre_done and during.grads_done and during.lrs == [0.1]
            assert during.forwards == 1
            opt.step()
            opt.zero_grad()
            states.append(during)
            fresh = mon._step
            assert fresh is not during and fresh.token == during.token + 1
            assert (fresh.pre_done, fresh.grads_done, fresh.forwards, fresh.lrs) == (False, False, 0, [])
        assert states[0] is not states[1]
        assert mon.get_metrics()["metrics"]["grad"]
    finally:
        mon.close()
    assert not mon.collecting


def test_a_state_has_the_defaults_of_a_step_not_begun():
    state = StepState(token=3, collecting=True)
    assert state.reading and not (state.agreed or state.contributing or state.pre_done or state.skip_checked)
