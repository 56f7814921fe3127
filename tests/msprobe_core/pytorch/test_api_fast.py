"""The L1 dump's fast route for API calls with autograd off (``pytorch/api_fast.py``): the same dump.json,
stack.json and construct.json as the usual route, byte for byte (optimizer updates, odd tensors that fall back,
a call that raises), decided once per configuration, and no record lost by a process killed mid-step."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch

from msprobe_core.pytorch import PrecisionDebugger, api_fast
from msprobe_core.stats.kernel import KERNEL
from route_runs import assert_same_files, recovered_step, run_each, run_script, step_dir  # tests/support is on sys.path

needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")

SCRIPT = textwrap.dedent("""
    import os, signal, torch
    from torch import nn
    if {route!r} == "usual":  # the usual route for every API
        from msprobe_core.pytorch import dump_service
        dump_service.fast_wrapper_maker = lambda service: None
    elif {route!r} == "python":  # the fast route's steps and the mode's pass-through in Python (the extension
        from msprobe_core.pytorch import api_fast, api_patch  # without ApiCall and ModePass)
        api_fast._ApiCall = None
        api_patch._ModePass = None
    from msprobe_core.pytorch import PrecisionDebugger
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    dbg = PrecisionDebugger({{"dump_path": {out!r}, "level": {level!r}, "task": "statistics"}})
    class Seq(list):                                    # a list subclass: the Python ``tensors_in`` takes the call
        pass
    for step in range(3):
        dbg.start(model)
        loss = model(torch.randn(2, 8)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            x = torch.randn(4, 3)
            (x.t() + 1).half().mul(2)                       # a strided view, float16
            torch.view_as_complex(torch.randn(3, 2)).mul(2)  # complex inputs: the usual route
            torch.polar(torch.ones(2), torch.zeros(2))       # a complex output: the usual end
            x.reshape(12)                                    # same values: the usual route
            try:
                torch.ones(2).add_(torch.ones(3))            # raises: no record, its place and stack kept
            except RuntimeError:
                pass
            torch.nn.functional.relu(x, inplace=False).sum()
        if step == 1 and {kill}:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step, after the optimizer's records
        dbg.stop()
        dbg.step()
""")


def _run(out: Path, level: str, route: str, kill: bool = False) -> subprocess.CompletedProcess:
    """The script's run with the fast route in C (``c``), in Python (``python``) or without it (``usual``)."""
    return run_script(SCRIPT.format(out=str(out), level=level, route=route, kill=kill), out)


@needs_kernel
@pytest.mark.parametrize("level", ["L1", "mix"])
def test_the_fast_route_writes_what_the_usual_route_writes(tmp_path, level):
    outs = run_each(tmp_path, ("c", "python", "usual"), lambda out, route: _run(out, level, route))
    for step in range(3):
        for route in ("c", "python"):
            assert_same_files(step_dir(outs[route], step), step_dir(outs["usual"], step), (route, step))
    data = json.loads((step_dir(outs["c"], 1) / "dump.json").read_text())["data"]
    assert "Tensor.lerp_.0.forward" in data and "Tensor.addcdiv_.0.forward" in data  # the optimizer's updates
    assert "Torch.polar.0.forward" in data and "Torch.view_as_complex.0.forward" in data


@needs_kernel
@pytest.mark.parametrize("route", ["c", "python"])
def test_a_killed_process_keeps_the_fast_routes_records(tmp_path, route):
    """Each record is journaled when its call ends: the recovered step equals the step of a run not killed."""
    killed_out, full_out = tmp_path / "killed" / "dump", tmp_path / "full" / "dump"
    for out in (killed_out, full_out):
        out.parent.mkdir()
    recovered, got, want = recovered_step(_run(killed_out, "L1", route, kill=True), killed_out,
                                          _run(full_out, "L1", route), full_out, 1)
    assert "Tensor.addcdiv_.0.forward" in recovered["data"]
    # the stacks of the records (the call that raised keeps its place in stack.json, never journaled: as before)
    stacks = {k: v for k, v in json.loads((want / "stack.json").read_text()).items() if k in recovered["data"]}
    assert json.loads((got / "stack.json").read_text()) == stacks


@pytest.mark.parametrize("config", [
    {"task": "statistics", "summary_mode": "md5"},
    {"task": "tensor"},
    {"task": "overflow_check"},
    {"task": "statistics", "scope": ["Tensor.add.0.forward", "Tensor.add.1.forward"]},
    {"task": "statistics", "list": ["relu"]},
])
def test_configurations_the_fast_route_cannot_serve_keep_the_usual_wrappers(tmp_path, config):
    task = config["task"]
    section = {k: v for k, v in config.items() if k != "task"}
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": task, task: section})
    assert api_fast.fast_wrapper_maker(dbg.service) is None


@needs_kernel
def test_the_route_is_decided_per_api_and_torch_is_restored(tmp_path):
    def seen():  # what each owner holds itself, and what an attribute lookup finds
        return [(name in owner.__dict__, getattr(owner, name)) for owner, name in
                ((torch.Tensor, "mul_"), (torch, "add"), (torch.Tensor, "reshape"))]

    original = seen()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": "statistics"})
    fast = api_fast.FastApi(dbg.service)
    assert fast.usable and fast.wants("Tensor", "mul_") and not fast.wants("Tensor", "reshape")
    assert not fast.wants("Distributed", "all_reduce")
    dbg.start()
    try:
        assert torch.Tensor.mul_.__code__.co_name == "api_call" and torch.Tensor.mul_.__wrapped__ is original[0][1]
        assert torch.Tensor.reshape.__code__.co_name == "wrapper"
        with torch.no_grad():
            t = torch.ones(3)
            t.mul_(2.0)
        assert torch.equal(t, torch.full((3,), 2.0))
    finally:
        dbg.stop()
    assert seen() == original


def test_without_the_kernel_there_is_no_fast_route(tmp_path, monkeypatch):
    from msprobe_core.pytorch import tensor_stats
    monkeypatch.setattr(tensor_stats, "_fast_stats", None)  # MSPROBE_FAST_STATS=0
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": "statistics"})
    assert api_fast.fast_wrapper_maker(dbg.service) is None


@pytest.fixture(params=["c", "python"])
def route(request, monkeypatch):
    """The fast route's call in C (``ApiCall``) and in Python (``_python_call``)."""
    if request.param == "python":
        monkeypatch.setattr(api_fast, "_ApiCall", None)
    elif api_fast._ApiCall is None:
        pytest.skip("the extension has no ApiCall")
    return request.param


@needs_kernel
def test_the_tools_errors_never_reach_the_users_call(tmp_path, route, monkeypatch):
    """A failing journal goes to dump_error_info.log; the user's result comes back, the user's own error
    goes up unchanged; the tool's depth is restored either way."""
    from msprobe_core.common.tool_guard import TOOL
    from msprobe_core.files.step_recorder import StepRecorder
    def broken(*args, **kwargs):
        raise OSError("journal full")

    made = StepRecorder.__init__

    def recorder_with_a_full_journal(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.put_text = broken  # the instance's (the C ``TextJournal.put_text`` where the kernel has it)

    monkeypatch.setattr(StepRecorder, "__init__", recorder_with_a_full_journal)
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": "statistics"})
    dbg.start()
    try:
        with torch.no_grad():
            t = torch.ones(3)
            assert torch.equal(t.mul_(2.0), torch.full((3,), 2.0))
            with pytest.raises(RuntimeError):
                torch.ones(2).add_(torch.ones(3))
        assert TOOL.depth == 0
    finally:
        dbg.stop()
    log = next(tmp_path.rglob("dump_error_info.log")).read_text()
    assert "Tensor.mul_.0.forward" in log and "journal full" in log


@needs_kernel
def test_the_c_call_checks_what_it_is_given(tmp_path):
    if api_fast._ApiCall is None:
        pytest.skip("the extension has no ApiCall")
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": "statistics"})
    dbg.start()
    try:
        call = api_fast.FastApi(dbg.service).call(torch.Tensor.add, "Tensor", "add")
        with pytest.raises(TypeError):
            call([torch.ones(1)], {})  # a list: the Python function standing for the API always passes a tuple
        with pytest.raises(TypeError):
            api_fast._ApiCall(torch.add, ("Torch.add", "Torch", "add"), ())
        assert torch.equal(call((torch.ones(1), torch.ones(1)), {}), torch.full((1,), 2.0))
        assert call.__wrapped__ is torch.Tensor.add
    finally:
        dbg.stop()


@needs_kernel
def test_the_c_call_leaks_nothing(tmp_path):
    """100,000 recorded calls (records dropped at each step's end): the process's memory stays flat."""
    if api_fast._ApiCall is None:
        pytest.skip("the extension has no ApiCall")
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": "structure"})
    t = torch.ones(2)

    def steps(n: int) -> None:
        for _ in range(n):
            dbg.start()
            with torch.no_grad():
                for _ in range(1000):
                    t.mul_(1.0)
            dbg.stop()
            dbg.step()

    assert _growth(steps, 100) < 2_000_000


def test_the_operator_modes_pass_through_calls_what_it_does_not_record(tmp_path):
    """The mode's compiled ``__torch_function__`` (``ModePass``) passes any call outside the plan straight on
    (keyword arguments too) and gives planned functions to the mode's own method; torch sees it as the mode's."""
    from msprobe_core.pytorch import api_patch
    if api_patch._ModePass is None:
        pytest.skip("the extension has no ModePass")
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": "statistics"})
    dbg.start()
    try:
        mode = dbg.service.patcher._mode
        assert type(mode.__torch_function__) is api_patch._ModePass and mode.__torch_function__.__self__ is mode
        t = torch.arange(6.0).reshape(2, 3)
        with torch.no_grad():
            assert torch.equal(torch.sum(t, dim=1), torch.tensor([3.0, 12.0]))  # a keyword, outside the plan
            assert t.is_complex() is False and t.grad is None
            assert torch.equal(t / 2, torch.arange(6.0).reshape(2, 3) / 2)  # an operator the mode records
            entered = _python_calls(lambda: t / 3)
        # an operator whose function has the fast route's wrapper goes to that wrapper, not to the mode's method
        assert "api_call" in entered and "__torch_function__" not in entered
        with pytest.raises(TypeError):
            mode.__torch_function__([], (), (), None)  # an unhashable func: the Python method's own error
    finally:
        dbg.stop()
        dbg.step()
    data = json.loads(next(tmp_path.rglob("dump.json")).read_text())["data"]
    assert any(k.startswith("Tensor.__truediv__.0.forward") or k.startswith("Tensor.div.0.forward") for k in data)


def _python_calls(fn: Callable[[], object]) -> list[str]:
    """The Python functions entered while ``fn`` runs."""
    entered: list[str] = []
    sys.setprofile(lambda frame, event, arg: entered.append(frame.f_code.co_name) if event == "call" else None)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entered


GRAD_SCRIPT = textwrap.dedent("""
    import os, signal, torch
    import torch.nn.functional as F
    from torch import nn
    from msprobe_core.pytorch import api_fast
    if {route!r} == "usual":  # calls with autograd on through ``on_api_call`` (the no-grad ones stay in C)
        api_fast._ApiGrad = None
    from msprobe_core.pytorch import PrecisionDebugger
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 6))
    w = torch.randn(6, 6, requires_grad=True)
    opt = torch.optim.AdamW(list(model.parameters()) + [w], lr=1e-3, foreach=False)
    dbg = PrecisionDebugger({{"dump_path": {out!r}, "level": {level!r}, "task": "statistics"}})
    class Seq(list):                                    # a list subclass: the Python ``tensors_in`` takes the call
        pass
    for step in range(3):
        dbg.start(model)
        x = torch.randn(4, 8, requires_grad=True)
        h = model(x)
        h = F.linear(h, w, bias=None)                   # a keyword argument
        h = F.gelu(h, approximate="tanh")
        a, b = torch.chunk(h, 2, dim=1)                 # a tuple output (one node, two outputs)
        top = torch.max(h, dim=1)                       # values and indices (one requires grad)
        y = h * 2
        y.add_(1)                                       # in place, with autograd on
        twice = h + h                                   # one input taken twice
        cat = torch.cat([a, (b,)[0]], dim=1) + torch.cat(Seq([b, a]), dim=1)  # inputs in a list, a list subclass
        kw = F.linear(input=h, weight=w, bias=torch.zeros(6, requires_grad=True))  # tensors as keyword arguments
        nest = torch.stack(((a, b)[0], b)).sum(0)       # a tuple of inputs
        n = h.sum().item()                              # a number as output
        lo = torch.ones(4, 3, dtype=torch.float16, requires_grad=True)
        z = lo.float().mul(2)                           # a half input (the kernel's text or the usual record)
        c = torch.view_as_complex(torch.randn(4, 3, 2, requires_grad=True)).abs()  # complex: the usual route
        try:
            torch.matmul(h, torch.ones(3, 3))           # raises with autograd on
        except RuntimeError:
            pass
        with torch.no_grad():
            h.mul(2)                                    # no_grad inside the step
        loss = a.sum() + b.mean() + top.values.sum() + y.sum() + twice.sum() + z.sum() + c.sum() + cat.sum() \
            + kw.sum() + nest.sum()
        opt.zero_grad()
        loss.backward(retain_graph=True)
        loss.backward()                                 # a second backward on the same records
        opt.step()
        if step == 1 and {kill}:
            os.kill(os.getpid(), signal.SIGKILL)        # mid-step, after the backward records
        dbg.stop()
        dbg.step()
""")


def _grad_run(out: Path, level: str, route: str, kill: bool = False) -> subprocess.CompletedProcess:
    """GRAD_SCRIPT with calls made with autograd on in C (``c``) or through ``on_api_call`` (``usual``)."""
    return run_script(GRAD_SCRIPT.format(out=str(out), level=level, route=route, kill=kill), out)


needs_grad_route = pytest.mark.skipif(api_fast._ApiGrad is None, reason="the extension has no ApiGrad")


@needs_grad_route
@pytest.mark.parametrize("level", ["L1", "mix"])
def test_calls_with_autograd_on_write_what_the_usual_route_writes(tmp_path, level):
    outs = run_each(tmp_path, ("c", "usual"), lambda out, route: _grad_run(out, level, route))
    for step in range(3):
        assert_same_files(step_dir(outs["c"], step), step_dir(outs["usual"], step), step)
    data = json.loads((step_dir(outs["c"], 1) / "dump.json").read_text())["data"]
    for name in ("Functional.linear.2.backward", "Functional.gelu.1.backward", "Torch.chunk.0.backward",
                 "Tensor.add_.0.backward", "Torch.max.0.backward", "Tensor.__add__.0.backward"):
        assert name in data, name
    assert len(data["Functional.gelu.1.backward"]["input"]) == 1 and len(data["Torch.chunk.0.backward"]["input"]) == 2


@needs_grad_route
def test_a_killed_process_keeps_the_records_of_calls_with_autograd_on(tmp_path):
    killed_out, full_out = tmp_path / "killed" / "dump", tmp_path / "full" / "dump"
    for out in (killed_out, full_out):
        out.parent.mkdir()
    recovered, got, want = recovered_step(_grad_run(killed_out, "mix", "c", kill=True), killed_out,
                                          _grad_run(full_out, "mix", "c"), full_out, 1)
    assert "Functional.gelu.1.backward" in recovered["data"]


@needs_grad_route
def test_a_failing_gradient_record_never_breaks_the_backward(tmp_path, monkeypatch):
    """An error in the C gradient record goes to dump_error_info.log; the gradients are the same."""
    from msprobe_core.common.tool_guard import TOOL
    from msprobe_core.files.step_recorder import StepRecorder

    def broken(*args, **kwargs):
        raise OSError("journal full")

    made = StepRecorder.__init__

    def recorder_with_a_full_journal(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.put_text_field = broken

    monkeypatch.setattr(StepRecorder, "__init__", recorder_with_a_full_journal)
    x = torch.randn(3, 4, requires_grad=True)
    want = torch.autograd.grad(torch.nn.functional.gelu(x).sum(), x)[0]
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": "statistics"})
    dbg.start()
    try:
        got = torch.autograd.grad(torch.nn.functional.gelu(x).sum(), x)[0]
        assert TOOL.depth == 0
    finally:
        dbg.stop()
    assert torch.equal(got, want)
    log = next(tmp_path.rglob("dump_error_info.log")).read_text()
    assert "Functional.gelu.0.backward" in log and "journal full" in log


@needs_grad_route
def test_calls_with_autograd_on_leak_nothing(tmp_path):
    """3,000 recorded calls with autograd on and their backward records: the process's memory stays flat (what
    grows is the hooks kept for reuse by call site, bounded)."""
    assert _growth(_grad_steps(tmp_path, "structure"), 30) < 500_000


def _growth(steps: Callable[[int], None], n: int) -> int:
    """Bytes the process's Python allocations grew by over ``n`` steps, after 5 steps to warm up."""
    import gc
    import tracemalloc
    steps(5)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    steps(n)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return grown


def test_calls_with_autograd_on_leave_no_reference_behind(tmp_path):
    """The C route's hooks go in with torch functions off, as the Python route's: torch leaks a reference to None
    at each tensor property set made through a TorchFunctionMode (``add_tensor_hook`` sets ``_backward_hooks``)."""
    import sys
    steps = _grad_steps(tmp_path, "statistics")
    steps(3)
    before = sys.getrefcount(None)
    steps(10)
    assert sys.getrefcount(None) - before < 50  # 1,000 recorded calls: one leaked reference each before


def _grad_steps(tmp_path: Path, task: str) -> Callable[[int], None]:
    """Steps of an L1 dump (``task``) each recording 100 calls with autograd on and their backward."""
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": task})
    w = torch.ones(2, 2, requires_grad=True)

    def steps(n: int) -> None:
        for _ in range(n):
            dbg.start()
            h = torch.ones(1, 2, requires_grad=True)
            for _ in range(50):
                h = torch.nn.functional.gelu(torch.nn.functional.linear(h, w))
            h.sum().backward()
            dbg.stop()
            dbg.step()

    return steps


@needs_grad_route
@pytest.mark.parametrize("route", ["c", "usual"])
def test_the_hooks_of_calls_with_autograd_on_go_when_the_step_ends(tmp_path, route, monkeypatch):
    """Every hook a call with autograd on put in (its output's tensor hook, its nodes' hooks) is held for the step's
    end and gone then; a backward run later through the same graph records nothing. The C route's hooks, used again
    by the same call sites in the next step, record that step's calls."""
    if route == "usual":
        monkeypatch.setattr(api_fast, "_ApiGrad", None)
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": "statistics"})
    w = torch.randn(3, 3, requires_grad=True)
    kept = []
    for _ in range(2):
        dbg.start()
        x = torch.randn(2, 3, requires_grad=True)
        y = torch.nn.functional.gelu(torch.nn.functional.linear(x, w))
        y.sum().backward(retain_graph=True)
        flat = list(dbg.service._step_hooks._flat)  # key, number of dicts, the dicts, key, ...
        dbg.stop()
        dbg.step()
        held, i = [], 0
        while i < len(flat):
            held += [(flat[i], d) for d in flat[i + 2:i + 2 + flat[i + 1]]]
            i += 2 + flat[i + 1]
        assert len(held) >= 5  # two outputs' tensor hooks, linear's two nodes and gelu's node
        assert all(d is None or key not in d for key, d in held)
        assert not y._backward_hooks
        kept.append(y)
    written = {p: p.read_bytes() for p in tmp_path.rglob("*.json")}
    for y in kept:
        y.sum().backward()  # after the step: no hook of the tool's runs
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.json")} == written
    assert len([p for p in written if p.name == "dump.json"]) == 2
    for path in written:
        if path.name == "dump.json":
            data = json.loads(path.read_text())["data"]
            assert len(data["Functional.linear.0.backward"]["output"]) == 2  # x's and w's gradients
            assert len(data["Functional.gelu.0.backward"]["input"]) == 1
    assert not list(tmp_path.rglob("dump_error_info.log"))


def test_the_c_call_reads_instance_dicts_only_where_getattr_would_read_them():
    """``ApiCall`` reads the service's and the records' attributes from their instance dicts (``_plain_vars``)
    unless the class makes one a data descriptor (a property, a slot) or there is no instance dict."""

    class Plain:
        def __init__(self):
            self.recorder = "instance"

    class WithProperty:
        @property
        def recorder(self):
            return "property"

    class Slotted:
        __slots__ = ("recorder",)

    plain = Plain()
    assert api_fast._plain_vars(plain, ("recorder",)) is vars(plain)
    assert api_fast._plain_vars(WithProperty(), ("other", "recorder")) is None
    assert api_fast._plain_vars(Slotted(), ("recorder",)) is None


@needs_kernel
def test_the_c_call_holds_no_steps_journal_once_the_step_ends(tmp_path):
    """``ApiCall`` calls the recorder's C ``put_text`` directly (found once per recorder): the step's
    ``TextJournal`` is let go with its recorder, and the next step's recorder is written through its own."""
    import sys
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": "statistics"})
    t = torch.ones(4)
    for step in range(2):
        dbg.start()
        with torch.no_grad():
            t.mul_(2.0)
        journal = getattr(dbg.service.recorder, "_text_journal", None)
        dbg.stop()
        dbg.step()
        if journal is not None:
            assert sys.getrefcount(journal) == 2  # this test's name and getrefcount's argument
        del journal
    for step in range(2):
        records = json.loads(step_dir(tmp_path, step).joinpath("dump.json").read_text())["data"]
        assert list(records) == ["Tensor.mul_.0.forward"]
