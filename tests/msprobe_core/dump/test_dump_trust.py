"""Trust: the numbers never change, everything is restored, a SIGKILL loses nothing, ranks stay apart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from dist_run import run_two_ranks
from dump_models import ResidualAttention, TinyNet, make_data, train_steps
from killed_run import run_killed_mid_step
from msprobe_core.pytorch import PrecisionDebugger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def reference_run(steps=3):
    torch.manual_seed(0)
    model = ResidualAttention()
    return train_steps(model, make_data(), steps)


@pytest.mark.parametrize("level,task,mode", [
    ("L0", "statistics", "statistics"), ("L1", "statistics", "statistics"), ("mix", "statistics", "statistics"),
    ("mix", "tensor", "statistics"), ("mix", "statistics", "md5"), ("L1", "overflow_check", "statistics"),
    ("mix", "structure", "statistics"),
])
def test_losses_and_gradients_bit_identical(tmp_path, level, task, mode):
    ref_losses, ref_grads = reference_run()
    torch.manual_seed(0)
    model = ResidualAttention()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": level, "task": task, task: {"summary_mode": mode}
                             if task in ("statistics", "tensor") else {}})
    losses, grads = train_steps(model, make_data(), 3, before=lambda i: dbg.start(model),
                                after=lambda i: (dbg.stop(), dbg.step()))
    assert losses == ref_losses
    for g, r in zip(grads, ref_grads):
        assert all(torch.equal(a, b) for a, b in zip(g, r))


def _namespace_snapshot():
    import torch.nn.functional as F
    owners = [torch, F, torch.Tensor, torch._VF, torch.distributed, torch.autograd]
    return [dict(vars(o)) for o in owners]


def test_stop_restores_torch_and_removes_every_hook(tmp_path):
    dynamo_before = "torch._dynamo" in sys.modules
    before = _namespace_snapshot()
    model = TinyNet()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "mix"})
    dbg.start(model)
    assert torch.nn.functional.relu is not before[1]["relu"]  # patched while collecting
    model(torch.randn(2, 8)).sum().backward()
    dbg.stop()
    after = _namespace_snapshot()
    for b, a in zip(before, after):
        assert b.keys() <= a.keys()
        assert all(a[k] is b[k] for k in b)
        # a submodule imported on the way (torch.distributed.tensor...) is an attribute of its package, not a patch
        assert all(isinstance(a[k], types.ModuleType) for k in a.keys() - b.keys())
    assert "torch._dynamo" not in sys.modules or dynamo_before  # start() never imports Dynamo (a second)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    dbg.step()
    for p in model.parameters():
        assert not p._backward_hooks
    # token_range hooks also go away
    dbg.start(model, token_range=[0, 1])
    model(torch.randn(2, 8))
    dbg.stop()
    dbg.step()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_an_unchanged_model_gets_its_hooks_back_at_each_start_and_loses_them_at_stop(tmp_path):
    """From the second start() on, an unchanged model's hooks are put back as the first start() made them
    (after the user's own, as registering puts them), stop() and step() take them all away, and a changed
    model is hooked afresh: every step's records are those of a model hooked at that start()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L0"})
    mine = []
    for step in range(3):
        if step == 2:
            model.append(torch.nn.Linear(4, 4))
        handle = model[0].register_forward_hook(lambda *a: None)
        dbg.start(model)
        hooks = list(model[0]._forward_hooks.values())
        assert hooks[0] is handle.hooks_dict_ref()[handle.id] and len(hooks) == 2  # the user's, then the dump's
        mine.append(hooks[1])
        model(torch.randn(2, 4)).sum().backward()
        dbg.stop()
        dbg.step()
        handle.remove()
        for m in model.modules():
            assert not m._forward_hooks and not m._forward_pre_hooks and not m._forward_hooks_with_kwargs
        assert all(not p._backward_hooks for p in model.parameters())
    assert mine[0] is mine[1]  # put back, not made again
    names = [sorted(json.loads((next((tmp_path / "d" / f"step{i}").iterdir()) / "dump.json").read_text())["data"])
             for i in range(3)]
    assert names[0] == names[1] and "Module.0.Linear.parameters_grad.0" in names[0]
    assert set(names[2]) - set(names[1]) == {"Module.2.Linear.forward.0", "Module.2.Linear.backward.0",
                                             "Module.2.Linear.parameters_grad.0"}


def test_idle_import_patches_nothing():
    code = "import torch, torch.nn.functional as F; r = F.relu; import msprobe_core.pytorch; assert F.relu is r; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.stdout.strip() == "ok", out.stderr


def test_sigkill_mid_step_loses_nothing_and_recover_rebuilds(tmp_path):
    proc, out = run_killed_mid_step(tmp_path, "SIGKILL")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    step0 = next((out / "step0").iterdir())
    step1 = next((out / "step1").iterdir())
    assert (step0 / "dump.json").exists() and not (step0 / ".dump.journal").exists()   # finished step: complete
    assert not (step1 / "dump.json").exists() and (step1 / ".dump.journal").exists()
    res = subprocess.run([sys.executable, "-m", "msprobe_core", "recover", str(out)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert res.returncode == 0 and "recovered" in res.stdout
    data = json.loads((step1 / "dump.json").read_text())["data"]
    complete = json.loads((step0 / "dump.json").read_text())["data"]
    assert list(data) == list(complete)  # every record made before the kill, in execution order
    assert data["Module.linear.Linear.parameters_grad.0"]["weight"][0]["Max"] is not None
    assert json.loads((step1 / "construct.json").read_text())["Functional.linear.0.forward"] == "Module.linear.Linear.forward.0"
    assert (step1 / "stack.json").exists()
    # tensor files are written off the training thread: the recovered dump references only files that
    # exist (any still queued at the kill are reported as lost), and no file is half-written
    names = []
    for rec in data.values():
        for part in rec.values():
            for item in (part if isinstance(part, list) else part.values() if isinstance(part, dict) else []):
                if isinstance(item, dict) and "data_name" in item:
                    names.append(item["data_name"])
    assert names and all((step1 / "dump_tensor_data" / n).exists() for n in names)
    assert not list((step1 / "dump_tensor_data").glob("*.tmp"))
    for n in names[:5]:
        torch.load(step1 / "dump_tensor_data" / n)


DIST_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from msprobe_core.session import finish_distributed
    from dump_models import TinyNet
    from msprobe_core.pytorch import PrecisionDebugger
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyNet()
    dbg = PrecisionDebugger({{"dump_path": {out!r}, "level": "L1", "rank": {ranks}}})
    for _ in range(2):
        dbg.start(model)
        y = model(torch.randn(2, 8) + dist.get_rank())
        t = y.sum().detach().clone()
        dist.all_reduce(t)
        y.sum().backward()
        dbg.stop()
        dbg.step()
    finish_distributed()
""")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ranks,expected", [([], ["rank0", "rank1"]), ([1], ["rank1"])])
def test_two_ranks_write_their_own_folders(tmp_path, ranks, expected):
    out = tmp_path / "dump"
    run_two_ranks(DIST_SCRIPT.format(out=str(out), ranks=ranks), tmp_path)
    for step in ("step0", "step1"):
        assert sorted(p.name for p in (out / step).iterdir()) == expected
    data = json.loads((out / "step0" / expected[-1] / "dump.json").read_text())["data"]
    assert "Distributed.all_reduce.0.forward" in data
    assert "Functional.linear.0.forward" in data


def test_tensor_type_slots_untouched_after_an_l1_dump(tmp_path):
    """Assigning and deleting torch.Tensor.__getitem__ & co. would rewire CPython's type slots for good
    (torch.tensor(list of 0-d tensors) then fails under any TorchFunctionMode, e.g. Megatron's)."""
    from torch.overrides import TorchFunctionMode

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model = TinyNet()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1"})
    dbg.start(model)
    x = torch.randn(2, 8)
    y = model(x)
    z = (y + 1)[0] * 2           # operators are still recorded (through a TorchFunctionMode)
    z.sum().backward()
    dbg.stop()
    dbg.step()
    names = json.loads(next((tmp_path / "d" / "step0").iterdir()).joinpath("dump.json").read_text())["data"]
    assert "Tensor.__add__.0.forward" in names and "Tensor.__getitem__.0.forward" in names
    assert "Tensor.__mul__.0.forward" in names
    with PassThrough():
        assert torch.tensor([torch.tensor(0.5), torch.tensor(1.5)]).tolist() == [0.5, 1.5]
