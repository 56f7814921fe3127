"""The L0 dump's module and gradient hooks in C (``stats/_fast_l0.c``: ``ModuleHooks``, ``OwnGrads``, ``CallGrads``,
``ParamGrad``, ``SingleEdge``): the same dump.json, stack.json and construct.json as the Python route, byte for byte,
for the usual calls and for every call they hand to the Python route (keyword inputs, tuple outputs, an output that
is its input or a parameter, an input taken twice, frozen and shared parameters, a user's gradient hook, a TorchFunctionMode);
decided once per configuration and module; and no record lost by a process killed mid-step."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.hooks import RemovableHandle

from msprobe_core.pytorch import PrecisionDebugger, backward_capture, dump_service
from msprobe_core.stats.kernel import KERNEL
from route_runs import assert_same_files, recovered_step, run_each, run_script, step_dir  # tests/support is on sys.path

needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")

SCRIPT = textwrap.dedent("""
    import os, signal, torch
    from torch import nn
    from torch.overrides import TorchFunctionMode
    if not {fast}:  # the Python route for every module call and gradient
        from msprobe_core.pytorch import backward_capture, dump_service
        dump_service._ModuleHooks = dump_service._ParamGrad = dump_service._CallGrads = None
        backward_capture._OwnGradsC = None
        backward_capture._single_edge_type = backward_capture._SingleEdge
    from msprobe_core.pytorch import PrecisionDebugger

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {{}}))

    class Mul(nn.Module):
        def forward(self, a, b):
            return a * b

    class Halves(nn.Module):
        def forward(self, x):
            return x.chunk(2, dim=1)

    class Scale(nn.Module):
        def forward(self, x, factor):
            return x * factor

    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return self.table  # a Parameter output

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(8, 8)
            self.act = nn.GELU()
            self.same = nn.Identity()          # its output is its input
            self.square = Mul()                # one input taken twice
            self.halves = Halves()             # a tuple output
            self.scale = Scale()               # a float input
            self.frozen = nn.Linear(4, 8)
            self.frozen.weight.requires_grad_(False)
            self.tied = nn.Linear(8, 8)
            self.head = nn.Linear(8, 4)
            self.bias = Table()

        def forward(self, x):
            h = self.act(self.first(x))
            h = self.square(self.same(h), h)
            a, b = self.halves(h)
            h = self.frozen(input=self.scale(a + b, 0.5))  # keyword input
            h = self.tied(self.act(self.tied(h)))          # a module called twice
            h.register_hook(lambda g: g * 2)               # a user's hook after the call returned
            return self.head(h + self.bias(h))

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dbg = PrecisionDebugger({{"dump_path": {out!r}, "level": {level!r}, "task": "statistics"}})
    for step in range(3):
        dbg.start(model)
        x = torch.randn(2, 8)
        if step == 2:
            with Passing():  # every call and gradient of this forward by the Python route
                loss = model(x).sum()
        else:
            loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 and {kill}:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step, after its backward
        dbg.stop()
        dbg.step()
""")


def _run(out: Path, level: str, fast: bool, kill: bool = False) -> subprocess.CompletedProcess:
    return run_script(SCRIPT.format(out=str(out), level=level, fast=fast, kill=kill), out)


@needs_kernel
@pytest.mark.parametrize("level", ["L0", "mix"])
def test_the_c_hooks_write_what_the_python_route_writes(tmp_path, level):
    outs = run_each(tmp_path, (True, False), lambda out, fast: _run(out, level, fast))
    for step in range(3):
        assert_same_files(step_dir(outs[True], step), step_dir(outs[False], step), step)
    data = json.loads((step_dir(outs[True], 1) / "dump.json").read_text())["data"]
    for name in ("Module.first.Linear.backward.0", "Module.tied.Linear.forward.1", "Module.square.Mul.backward.0",
                 "Module.tied.Linear.parameters_grad.0", "Module.frozen.Linear.parameters_grad.0"):
        assert name in data, name
    assert list(data["Module.frozen.Linear.parameters_grad.0"]) == ["bias"]
    assert data["Module.bias.Table.backward.0"]["input"][0]["Max"] is not None


@needs_kernel
def test_a_killed_process_keeps_the_c_hooks_records(tmp_path):
    """Each record is journaled when it is made: the recovered step equals the step of a run not killed."""
    killed_out, full_out = tmp_path / "killed" / "dump", tmp_path / "full" / "dump"
    for out in (killed_out, full_out):
        out.parent.mkdir()
    recovered, got, want = recovered_step(_run(killed_out, "L0", True, kill=True), killed_out,
                                          _run(full_out, "L0", True), full_out, 1)
    assert "Module.head.Linear.parameters_grad.0" in recovered["data"]
    assert json.loads((got / "stack.json").read_text()) == json.loads((want / "stack.json").read_text())


def _hooks_of(dbg: PrecisionDebugger, module: torch.nn.Module) -> tuple:
    """The forward pre and post hooks and the weight's gradient hook that start() gives ``module`` (in a model)."""
    dbg.start(torch.nn.Sequential(module))
    try:
        pre = next(iter(module._forward_pre_hooks.values()))
        post = next(iter(module._forward_hooks.values()))
        grad = next(iter(module.weight._backward_hooks.values())) if module.weight._backward_hooks else None
        return pre, post, grad
    finally:
        dbg.stop()


@needs_kernel
def test_the_c_hooks_go_in_for_the_usual_configuration_only(tmp_path):
    lin = torch.nn.Linear(2, 2)
    pre, post, grad = _hooks_of(PrecisionDebugger({"dump_path": str(tmp_path / "a"), "level": "L0",
                                                   "task": "statistics"}), lin)
    assert type(pre.__self__).__name__ == "ModuleHooks" and post.__self__ is pre.__self__
    assert type(grad).__name__ == "ParamGrad"


@pytest.mark.parametrize("config", [
    {"task": "statistics", "summary_mode": "md5"},
    {"task": "tensor"},
    {"task": "overflow_check"},
    {"task": "statistics", "scope": ["Module.0.Linear.forward.0", "Module.0.Linear.forward.1"]},
    {"task": "statistics", "list": ["Linear"]},
])
def test_configurations_the_c_hooks_cannot_serve_keep_the_python_hooks(tmp_path, config):
    task = config["task"]
    section = {k: v for k, v in config.items() if k != "task"}
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0", "task": task, task: section})
    pre, post, _ = _hooks_of(dbg, torch.nn.Linear(2, 2))
    assert pre.func.__name__ == "_module_pre" and post.func.__name__ == "_module_post"


def test_without_the_kernel_the_python_hooks_go_in(tmp_path, monkeypatch):
    monkeypatch.setattr(dump_service, "_ModuleHooks", None)
    monkeypatch.setattr(dump_service, "_ParamGrad", None)
    monkeypatch.setattr(backward_capture, "_OwnGradsC", None)
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0", "task": "statistics"})
    pre, post, grad = _hooks_of(dbg, torch.nn.Linear(2, 2))
    assert pre.func.__name__ == "_module_pre" and grad.func.__name__ == "_on_param_grad"


def _errors_and_records(tmp_path: Path, monkeypatch, fast: bool) -> tuple[list[str], list[str]]:
    """One step whose recorder refuses one forward and one backward record: the errors logged, the names kept."""
    from msprobe_core.files.step_recorder import StepRecorder
    if not fast:
        monkeypatch.setattr(dump_service, "_ModuleHooks", None)
        monkeypatch.setattr(dump_service, "_ParamGrad", None)
        monkeypatch.setattr(dump_service, "_CallGrads", None)
        monkeypatch.setattr(backward_capture, "_OwnGradsC", None)
        monkeypatch.setattr(backward_capture, "_single_edge_type", backward_capture._SingleEdge)
    reserve, init = StepRecorder.reserve, StepRecorder.__init__

    def refuse(name: str) -> None:
        if name in ("Module.1.GELU.forward.0", "Module.2.Linear.backward.0"):
            raise RuntimeError(f"no place for {name}")

    def refusing(self, name, *args):
        refuse(name)
        return reserve(self, name, *args)

    def made(self, *args, **kwargs):  # a whole backward record takes its place in its one put_text (seq None)
        init(self, *args, **kwargs)
        put_text = self.put_text

        def refusing_text(name, text, seq, *rest):
            if seq is None:
                refuse(name)
            return put_text(name, text, seq, *rest)
        self.put_text = refusing_text

    monkeypatch.setattr(StepRecorder, "reserve", refusing)
    monkeypatch.setattr(StepRecorder, "__init__", made)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 2))
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / f"fast{fast}"), "level": "L0", "task": "statistics"})
    dbg.start(model)
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()  # the user's step goes on
    dbg.stop()
    dbg.step()
    step = step_dir(tmp_path / f"fast{fast}", 0)
    errors = [line.partition(" Module.")[2] for line in (step / "dump_error_info.log").read_text().splitlines() if line.strip()]
    return errors, sorted(json.loads((step / "dump.json").read_text())["data"])


@needs_kernel
def test_an_error_in_a_c_hook_is_logged_as_the_python_route_logs_it(tmp_path, monkeypatch):
    fast = _errors_and_records(tmp_path, monkeypatch, True)
    monkeypatch.undo()
    assert fast == _errors_and_records(tmp_path, monkeypatch, False)
    assert fast[0] and "Module.1.GELU.forward.0" not in fast[1] and "Module.0.Linear.forward.0" in fast[1]


@needs_kernel
def test_the_c_hooks_make_a_stack_once_per_call_site_and_journal_later_parameters_in_c(tmp_path, monkeypatch):
    """A module's stack is looked up by its frame key (made by ``capture`` once per call site, not per call); a
    ``parameters_grad`` record's parameters, its first one included, go to the kernel's ``put_text_field`` (the
    Python method takes none); the records are those of the Python route."""
    from msprobe_core.files.step_recorder import StepRecorder
    captured, fields = [], []
    capture, put_text_field = dump_service._STACKS.capture, StepRecorder.put_text_field
    monkeypatch.setattr(dump_service._STACKS, "capture", lambda depth=2: captured.append(depth) or capture(depth + 1))
    monkeypatch.setattr(StepRecorder, "put_text_field", lambda self, name, *a: fields.append(name) or put_text_field(self, name, *a))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)])
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0", "task": "statistics"})
    made = []
    for _ in range(2):
        dbg.start(model)
        model(torch.randn(3, 4)).sum().backward()
        dbg.stop()
        dbg.step()
        made.append(len(captured))
    # the five modules are called from one line of Sequential.forward (a second key while the interpreter warms
    # its code up at most); none made in the second step
    assert made[0] <= 2 and made[1] == made[0]
    assert not [n for n in fields if ".parameters_grad." in n]
    for step in range(2):
        data = json.loads((step_dir(tmp_path, step) / "dump.json").read_text())["data"]
        assert all(list(data[f"Module.{i}.Linear.parameters_grad.0"]) == ["bias", "weight"] for i in range(5))


def _python_route(monkeypatch) -> None:
    """Every module call and gradient on the Python route (as ``SCRIPT`` with ``fast`` False)."""
    monkeypatch.setattr(dump_service, "_ModuleHooks", None)
    monkeypatch.setattr(dump_service, "_ParamGrad", None)
    monkeypatch.setattr(dump_service, "_CallGrads", None)
    monkeypatch.setattr(backward_capture, "_OwnGradsC", None)
    monkeypatch.setattr(backward_capture, "_single_edge_type", backward_capture._SingleEdge)


def _many_calls(path: Path, calls: int) -> dict:
    """Two steps of a module called ``calls`` times a step, and its backward: the second step's dump.json data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dbg = PrecisionDebugger({"dump_path": str(path), "level": "L0", "task": "statistics"})
    for _ in range(2):
        dbg.start(model)
        h = torch.ones(1, 2)
        for _ in range(calls):
            h = model(h) * 0.5
        h.sum().backward()
        dbg.stop()
        dbg.step()
    return json.loads((step_dir(path, 1) / "dump.json").read_text())["data"]


@needs_kernel
def test_names_past_those_kept_are_made_per_call_as_the_python_route_makes_them(tmp_path, monkeypatch):
    """The C hooks make a module's record names once per call number and keep them (``L0_NAMES_KEPT``, 4096) for
    the next steps; a module called more often than that in a step still gets every name, as the Python route's."""
    fast = _many_calls(tmp_path / "fast", 4100)
    _python_route(monkeypatch)
    assert list(fast) == list(_many_calls(tmp_path / "python", 4100))
    assert "Module.0.Linear.forward.4099" in fast and "Module.0.Linear.backward.4099" in fast


@needs_kernel
def test_a_call_class_the_c_hooks_cannot_fill_is_called(tmp_path, monkeypatch):
    """``ModuleHooks`` fills ``Call``'s slots itself (no Python ``__init__``) only for ``Call``'s own layout; a class
    whose ``__init__`` does more (``__post_init__``) is called as the Python route calls it, with the same records."""
    from dataclasses import dataclass

    from msprobe_core.dump.call import Call

    made = []

    @dataclass(slots=True, eq=False)
    class Counted(Call):
        def __post_init__(self):
            made.append(self.name)

    plain = _many_calls(tmp_path / "plain", 3)
    monkeypatch.setattr(dump_service, "Call", Counted)
    assert _many_calls(tmp_path / "counted", 3) == plain
    assert "Module.0.Linear.forward.2" in made


@needs_kernel
def test_an_edges_class_the_c_hooks_cannot_fill_is_called(tmp_path, monkeypatch):
    """``ModuleHooks`` makes ``InputEdges`` itself (``FieldsNew``: no Python ``__init__``) and reads its fields in
    their slots only for its own layout; a class whose ``__init__`` does more (``__post_init__``) is called, its
    fields read as attributes, with the same records."""
    from dataclasses import dataclass

    made = []

    @dataclass(slots=True, eq=False)
    class Counted(backward_capture.InputEdges):
        def __post_init__(self):
            made.append(self.begin)

    plain = _many_calls(tmp_path / "plain", 3)
    monkeypatch.setattr(dump_service, "InputEdges", Counted)
    assert _many_calls(tmp_path / "counted", 3) == plain
    assert len(made) == 4  # two steps of two calls whose input requires grad


@needs_kernel
def test_the_c_hooks_keep_the_tool_depth_of_each_thread(tmp_path):
    """The C hooks read and set ``TOOL.depth`` in the calling thread's own dict of it: work the tool marks as its
    own (``tool_work``) is not recorded, another thread's depth is its own, and every step ends at depth 0."""
    import threading

    from msprobe_core.common.tool_guard import TOOL, tool_work

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0", "task": "statistics"})
    depths = []
    for _ in range(2):
        dbg.start(model)
        with tool_work():
            model(torch.ones(1, 2))
        other = threading.Thread(target=lambda: (setattr(TOOL, "depth", 5), model(torch.ones(1, 2)),
                                                 depths.append(TOOL.depth)))
        other.start()
        other.join()
        model(torch.ones(1, 2, requires_grad=True)).sum().backward()
        dbg.stop()
        dbg.step()
        assert TOOL.depth == 0
    assert depths == [5, 5]
    data = json.loads((step_dir(tmp_path, 1) / "dump.json").read_text())["data"]
    assert [k for k in data if ".forward." in k] == ["Module.0.Linear.forward.0"]


@needs_kernel
def test_node_hooks_kept_in_c_are_removed_when_the_step_ends(tmp_path):
    """``OwnGrads`` puts a node hook's handle into the step's ``StepHooks`` itself (``step_hooks=``): each is
    removed from its node's hook dict when the step ends, as ``StepHooks.keep``'s."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4), torch.nn.GELU())
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0", "task": "statistics"})
    service = PrecisionDebugger._get().service
    dbg.start(model)
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    kept = _kept(service._step_hooks._flat)
    assert len(_node_hooks(kept)) == 4  # one per module call
    dbg.stop()
    dbg.step()
    assert not service._step_hooks and all(key not in d for key, d in kept)


def _kept(flat: list) -> list[tuple[int, dict]]:
    """The (key, hook dict) pairs of a ``StepHooks._flat``."""
    kept, i = [], 0
    while i < len(flat):
        key, n = flat[i], flat[i + 1]
        kept += [(key, d) for d in flat[i + 2:i + 2 + n]]
        i += 2 + n
    return kept


def _node_hooks(kept: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """The tool's node hooks (``SingleEdge``) among ``kept``."""
    return [(key, d) for key, d in kept if type(d[key]).__name__ == "SingleEdge"]


class _Custom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class _CustomCall(torch.nn.Module):
    def forward(self, x):
        return _Custom.apply(x)  # its node is a Python Function's (BackwardCFunction), not a C++ one


@needs_kernel
def test_a_users_node_hooks_share_the_dict_fire_and_stay_when_the_tools_are_removed(tmp_path, monkeypatch):
    """The tool's node hook goes into the node's own hook dict, under a key ``RemovableHandle.next_id`` gives, without
    a handle (``_torch_facts``' ``node_hook`` where built, else ``register_hook``): a user's ``grad_fn.register_hook``
    before it (in a forward hook that runs before the tool's) and after it (on the output) share that dict and get
    their own keys, every hook fires, the tool's record is made, and removing the tool's hooks at the step's end
    leaves the user's, which still fire and which the user can still remove. A Python Function's node takes
    ``register_hook``; with the extension, no other node hook of the tool makes a handle."""
    made = []
    init = RemovableHandle.__init__
    monkeypatch.setattr(RemovableHandle, "__init__", lambda h, *a, **k: made.append(h) or init(h, *a, **k))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4), _CustomCall())
    fired, handles = [], []

    def user(name: str):
        return lambda grad_inputs, grad_outputs: fired.append(name)

    model[2].register_forward_hook(lambda m, a, out: handles.append(out.grad_fn.register_hook(user("before"))))
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0", "task": "statistics"})
    service = PrecisionDebugger._get().service
    dbg.start(model)
    made.clear()
    out = model[:3](torch.randn(3, 4, requires_grad=True))
    handles.append(out.grad_fn.register_hook(user("after")))
    loss = model[3](out).sum()
    node_hooks = _node_hooks(_kept(service._step_hooks._flat))
    assert len(node_hooks) == 4  # one per module call, the custom Function's included
    facts = getattr(sys.modules.get("msprobe_core.stats._torch_facts"), "FACTS", None)
    assert len(made) == (3 if facts is not None else 6)  # the user's two, the custom Function's (and the others')
    dicts = {id(h.hooks_dict_ref()) for h in handles}
    ours = [(key, d) for key, d in node_hooks if id(d) in dicts]
    assert len(dicts) == 1 and len(ours) == 1  # one dict on the node: the user's hooks and the tool's
    key, d = ours[0]
    assert list(d) == [handles[0].id, key, handles[1].id] == sorted(d)  # keys as torch's handles take them
    loss.backward(retain_graph=True)
    assert fired == ["before", "after"]
    dbg.stop()
    dbg.step()
    data = json.loads((step_dir(tmp_path, 0) / "dump.json").read_text())["data"]
    assert {"Module.2.Linear.backward.0", "Module.3._CustomCall.backward.0"} <= set(data)
    assert list(d) == [handles[0].id, handles[1].id] and all(key not in h for key, h in node_hooks)
    out.sum().backward(retain_graph=True)  # the graph again: the user's hooks only
    assert fired == ["before", "after"] * 2
    handles[0].remove()
    out.sum().backward()
    assert fired == ["before", "after"] * 2 + ["after"] and list(d) == [handles[1].id]


@needs_kernel
def test_node_hooks_registered_while_the_tools_registration_is_under_way_are_torchs(tmp_path):
    """Python code run within the tool's node-hook registration (here the garbage collector's callbacks, run at each
    allocation of a tracked object with threshold 1: the tool's hook dict is one) that registers node hooks and
    prehooks of its own gets torch's handles, and its hooks fire with the tool's records made."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    other = x * 2  # the node the callbacks hook
    fired, handles = [], []

    def collected(phase: str, info: dict) -> None:
        if phase == "start":
            handles.append(other.grad_fn.register_hook(lambda grad_inputs, grad_outputs: fired.append("post")))
            handles.append(other.grad_fn.register_prehook(lambda grad_outputs: fired.append("pre")))

    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0", "task": "statistics"})
    dbg.start(model)
    threshold = gc.get_threshold()
    gc.callbacks.append(collected)
    gc.set_threshold(1)
    try:
        loss = model(x).sum()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(collected)
    assert handles and all(type(h) is RemovableHandle for h in handles)
    (loss + other.sum()).backward()
    dbg.stop()
    dbg.step()
    assert fired.count("post") == fired.count("pre") == len(handles) // 2
    data = json.loads((step_dir(tmp_path, 0) / "dump.json").read_text())["data"]
    assert {"Module.0.Linear.backward.0", "Module.1.GELU.backward.0", "Module.2.Linear.backward.0"} <= set(data)


@needs_kernel
def test_the_c_hooks_leave_no_reference_behind(tmp_path):
    """Steps of the C hooks leave no reference to None (or any other object counted per call) behind."""
    import sys
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(20) for m in (torch.nn.Linear(4, 4), torch.nn.GELU())])
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L0", "task": "statistics"})

    def steps(n: int) -> None:
        for _ in range(n):
            dbg.start(model)
            model(torch.randn(3, 4, requires_grad=True)).sum().backward()
            dbg.stop()
            dbg.step()

    steps(3)
    before = sys.getrefcount(None)
    steps(10)
    assert sys.getrefcount(None) - before < 50  # 400 module calls and 400 gradients recorded


class _Twice(torch.nn.Module):
    def forward(self, x):
        return x.sin() * x  # two of the call's nodes send to its one input


class _Inner(torch.nn.Module):
    def forward(self, x):
        return x.exp().sin()  # the node sending to the input is not the output's


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).tanh() * 2  # nodes of the call between the output's node and the input's edge


def _records_of(path: Path, input_grad: bool) -> tuple[dict, str]:
    """One step of a model of one-input calls of several graph shapes: dump.json's data and construct.json."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Twice(), _Inner(), _Scaled(), torch.nn.GELU())
    dbg = PrecisionDebugger({"dump_path": str(path), "level": "L0", "task": "statistics"})
    dbg.start(model)
    model(torch.randn(3, 4, requires_grad=input_grad)).sum().backward()
    dbg.stop()
    dbg.step()
    step = step_dir(path, 0)
    return json.loads((step / "dump.json").read_text())["data"], (step / "construct.json").read_text()


@needs_kernel
@pytest.mark.parametrize("input_grad", [True, False])
def test_one_input_calls_of_every_graph_shape_get_the_python_routes_records(tmp_path, monkeypatch, input_grad):
    """``OwnGrads``' walk for a call with one input tensor (``og_one_input``) takes the usual call only (one edge
    from the output's own node to the input, a leaf input included): the records are the Python route's."""
    fast = _records_of(tmp_path / "fast", input_grad)
    _python_route(monkeypatch)
    assert fast == _records_of(tmp_path / "python", input_grad)
    assert "Module.1._Twice.backward.0" in fast[0] and "Module.3._Scaled.backward.0" in fast[0]
