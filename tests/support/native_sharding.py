"""PyTorch's own sharding on two gloo ranks, for the tests of ``msprobe_core`` under FSDP2, FSDP1, DTensor
tensor parallel and torch.compile: the same small MLP, set up each way, and a single-device reference.

``shard(model, setup)`` applies a setup to a freshly seeded model; ``local_batch(x, setup)`` is what this
rank feeds (data-parallel setups split the global batch, tensor parallel feeds all of it). With the same
seed and global batch every setup computes the single-device gradients and Adam moments.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

SETUPS = ("fsdp2", "fsdp1_orig", "fsdp1_flat", "tp", "compile")
FSDP2 = pytest.param("fsdp2", marks=pytest.mark.skipif(
    not hasattr(torch.cpu.Stream, "record_event"),
    reason=f"torch {torch.__version__}: FSDP2 does not run on the CPU (its all-gather calls record_event on a CPU "
           "stream: torch.cpu.Stream has none)"))
"""The FSDP2 setup as a test parameter: skipped where torch's FSDP2 cannot run on the CPU."""
STEPS = 3
IN, HIDDEN, OUT = 16, 34, 5  # FSDP shards of 5 rows are uneven; tensor parallel needs an even HIDDEN


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def shard(model: nn.Module, setup: str) -> nn.Module:
    """``model`` set up as ``setup`` (see ``SETUPS``; "single": unchanged)."""
    if setup == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        return model
    if setup.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel(model, use_orig_params=setup == "fsdp1_orig", device_id=torch.device("cpu"))
    if setup == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return model
    if setup == "compile":
        return torch.compile(model)
    return model


def data_parallel(setup: str) -> bool:
    return setup.startswith("fsdp")


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, IN, generator=g), torch.randn(8, OUT, generator=g)


def local_batch(step: int, setup: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    if data_parallel(setup) and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return x.chunk(world)[rank], y.chunk(world)[rank]
    return x, y


def train(model: nn.Module, setup: str, steps: int = STEPS, attach=None, after_step=None,
          replicated_batch: bool = False) -> list[float]:
    """AdamW steps on ``model``; the losses (of this rank's batch). ``attach(optimizer)`` once before
    training, ``after_step(step)`` after each update; ``replicated_batch``: see ``dump_run``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if attach is not None:
        attach(opt)
    losses = []
    for step in range(steps):
        x, y = global_batch(step) if replicated_batch else local_batch(step, setup)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if after_step is not None:
            after_step(step)
    return losses


def stats(t: torch.Tensor) -> dict[str, float]:
    t = t.detach().double()
    return {"min": t.min().item(), "max": t.max().item(), "norm": t.norm().item(), "mean": t.mean().item()}


def reference(steps: int = STEPS) -> list[dict[str, dict[str, dict[str, float]]]]:
    """Single-device statistics per step: {kind: {parameter name: {op: value}}} (weights before the update)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        rec = {"param": {n: stats(p) for n, p in model.named_parameters()},
               "grad": {n: stats(p.grad) for n, p in model.named_parameters()}}
        opt.step()
        for kind in ("exp_avg", "exp_avg_sq"):
            rec[kind] = {n: stats(opt.state[p][kind]) for n, p in model.named_parameters()}
        out.append(rec)
    return out


def dump_run(dump_path: str, model: nn.Module, setup: str, level: str = "L0", steps: int = 2,
             replicated_batch: bool = True) -> list[float]:
    """``steps`` training steps of ``model`` under a fresh ``PrecisionDebugger`` (``level``) dumping into
    ``dump_path``; the losses. ``replicated_batch``: every rank feeds the whole global batch (so each rank's
    activations are the single-device run's and its averaged gradients too)."""
    from msprobe_core.pytorch import PrecisionDebugger

    dbg = PrecisionDebugger({"dump_path": dump_path, "task": "statistics", "level": level})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = global_batch(step) if replicated_batch else local_batch(step, setup)
        dbg.start(model)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        dbg.stop()
        dbg.step()
        losses.append(float(loss.detach()))
    return losses
