"""Records kept as JSON text from the start: a tensor's summary text made once per tensor version, a record
journaled whole in one frame (``StepRecorder.put_text``), stacks interned by the kernel's frame walk. What
they write must be exactly what the dict route writes, and a killed process must lose none of them."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from killed_run import run_killed_mid_step
from msprobe_core.files import call_stack, json_text
from msprobe_core.files.call_stack import CallStack, StackCapture
from msprobe_core.files.step_recorder import NO_PARENT, StepRecorder, read_frames, replay_journal
from msprobe_core.pytorch.summarize import CACHE_SIZE, Summarizer
from msprobe_core.stats.kernel import KERNEL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("v", [0.0, -0.0, 1e-8, 1.5, 3.0, 1e300, 2.0 ** -1074, math.nan, math.inf, -math.inf, 0.1 + 0.2])
def test_a_number_is_written_as_the_json_module_writes_it(v):
    assert json_text.number(v) == json.dumps(v) == json_text.encode(v)


def _objects():
    return [
        torch.randn(3, 4), torch.randn(3, 4).t(), torch.zeros(0), torch.tensor(3.5), torch.tensor([1, 2, 3]),
        torch.tensor([True, False]), torch.tensor([True, True]), torch.randn(5).half(), torch.randn(5).bfloat16(),
        torch.randn(5, dtype=torch.float64), torch.tensor([math.nan, 1.0]), torch.tensor([math.inf, 1.0]),
        torch.tensor([-math.inf, math.inf]), torch.nn.Parameter(torch.randn(2)), torch.randn(2, requires_grad=True),
        torch.tensor([1, 2], dtype=torch.uint8), torch.randint(0, 5, (4,), dtype=torch.int16),
        torch.randn(2, dtype=torch.complex64), torch.randn(300_000),
        [torch.randn(2), 1, 2.5, -7, True, None, "x", (torch.randn(1), [torch.randn(3)])],
        {"a": torch.randn(2), "b": torch.float32, 3: slice(1, 2), "é": "ü"}, torch.Size([2, 3]), [], {}, (), math.nan,
    ]


@pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
@pytest.mark.parametrize("statistics", [True, False])
def test_summary_text_is_the_encoded_summary(statistics):
    s = Summarizer(statistics=statistics, md5=False)
    with torch.no_grad():
        for obj in _objects():
            text = s.text(obj)
            encoded = json_text.encode(s.summarize(obj, None, False))
            if text is None:  # only what the kernel cannot read takes the dict route
                assert isinstance(obj, torch.Tensor) and obj.dtype.is_complex
            else:
                assert text == encoded
                assert s.text(obj) == text  # the second time from the cache


@pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
@pytest.mark.parametrize("statistics", [True, False])
def test_the_kernels_record_text_is_the_python_routes(statistics):
    """``RecordText`` (C) writes what ``text`` writes, byte for byte, and shares its cache with the Python route."""
    fast, slow = Summarizer(statistics=statistics, md5=False), Summarizer(statistics=statistics, md5=False)
    slow.record_text = None  # the Python route throughout
    odd = [torch.randn(2, 3)[:, 1], torch.randn(3).neg(), {"x": [torch.randn(2), {"y": 2.5}]}, -0.0, 10 ** 30,
           'a"b', {"k\n": 1, 2: None}, torch.float32, torch.randn(2, dtype=torch.complex64), (1, [None, False])]
    with torch.no_grad():
        for obj in _objects() + odd:
            for _ in range(2):  # the second time from the cache
                assert fast.record_text.text(obj) == slow.text(obj)
        args, kwargs = (torch.randn(3), 2.0, [torch.randn(1)]), {"alpha": 2, "out": None}
        head = fast.record_text.inputs(args, kwargs)
        assert head == f'{{"input_args": {slow.text(args)}, "input_kwargs": {slow.text(kwargs)}'
        assert fast.record_text.inputs((), {}) == '{"input_args": [], "input_kwargs": {}'
        for out in (torch.randn(2), [torch.randn(2), (1, torch.randn(1))], torch.return_types.max((torch.ones(1),
                                                                                                  torch.zeros(1)))):
            listed = list(out) if isinstance(out, (list, tuple)) else [out]
            assert fast.record_text.record(head, out) == f'{head}, "output": {slow.text(listed)}}}'
        assert fast.record_text.record(head, [torch.randn(2, dtype=torch.complex64)]) is None
        t = torch.randn(4)
        fast.record_text.text(t)
        assert fast.tensor_text(t) == fast.record_text.text(t)
        fast.record_text = None
        assert fast.tensor_text(t) == slow.text(t)  # the Python route reads the kernel's entry
        assert fast._cache[id(t)].text is not None


@pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
def test_tensor_text_is_the_kernels_where_it_makes_one_and_pythons_elsewhere():
    """``tensor_text`` (a gradient's text at L1) asks the kernel first; what the kernel does not read (float16, a
    strided view, another type) takes the Python route, and both routes give the same text."""
    fast, slow = Summarizer(statistics=True, md5=False), Summarizer(statistics=True, md5=False)
    slow.record_text = None
    with torch.no_grad():
        for t in [torch.randn(3, 4), torch.randn(5).half(), torch.randn(3, 4).t(), torch.randn(2).bfloat16(),
                  torch.tensor([True]), torch.nn.Parameter(torch.randn(3)), torch.randn(2, dtype=torch.complex64)]:
            assert fast.record_text.tensor(t) in (None, fast.tensor_text(t))
            assert fast.tensor_text(t) == slow.tensor_text(t)
        assert fast.record_text.tensor(torch.randn(5).half()) is None  # the kernel's part only
        assert fast.record_text.tensor([torch.randn(2)]) is None


@pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
def test_summary_text_follows_in_place_changes_and_requires_grad():
    s = Summarizer(statistics=True, md5=False)
    t = torch.randn(4, 4)
    with torch.no_grad():
        first = s.text(t)
        t.mul_(2)  # a new version: new statistics
        second = s.text(t)
        t.requires_grad_(True)
        third = s.text(t)
    assert first != second and json.loads(second)["Max"] == json.loads(first)["Max"] * 2
    assert json.loads(third)["requires_grad"] is True and third[:-6] == second[:-7]


def _in_place_changes(dtype):
    """In-place changes of one tensor (same object, mostly the same memory, a new version each): values, then
    shape and layout (the C text keeps the facts of a known tensor and must read them again)."""
    other = torch.randn(4, 8).to(dtype)
    yield "mul_", lambda t: t.mul_(2)
    yield "transpose_", lambda t: t.transpose_(0, 1)
    yield "t_", lambda t: t.t_()
    yield "unsqueeze_", lambda t: t.unsqueeze_(0)
    yield "squeeze_", lambda t: t.squeeze_(0)
    yield "resize_ smaller", lambda t: t.resize_(2, 8)
    yield "resize_ back", lambda t: t.resize_(4, 8)
    yield "as_strided_", lambda t: t.as_strided_((8, 4), (1, 8))
    yield "as_strided_ back", lambda t: t.as_strided_((4, 8), (8, 1))
    yield "add_", lambda t: t.add_(1)
    yield "set_ same memory, other shape", lambda t: t.set_(t.untyped_storage(), 0, (2, 4), (4, 1))
    yield "set_ same memory, first shape", lambda t: t.set_(t.untyped_storage(), 0, (4, 8), (8, 1))
    yield "set_ a negated view", lambda t: t.set_(t._neg_view())
    yield "set_ other memory", lambda t: t.set_(other)
    yield "resize_ larger", lambda t: t.resize_(64, 64).fill_(0.5)
    yield "zero_", lambda t: t.zero_()
    yield "resize_ empty", lambda t: t.resize_(0)
    yield "resize_ from empty", lambda t: t.resize_(3).fill_(2)
    yield "requires_grad_", lambda t: t.requires_grad_(True)


@pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.bool])
@pytest.mark.parametrize("statistics", [True, False])
def test_a_tensor_changed_in_place_is_described_as_it_is_now(dtype, statistics):
    """The C text of a known tensor's new version (its cached entry moved to the version) is the Python route's
    text of the tensor as it is after each in-place change: a resized, transposed or ``set_`` tensor is never
    described with its former shape, and a non-contiguous one is read as torch reads it."""
    fast, slow = Summarizer(statistics=statistics, md5=False), Summarizer(statistics=statistics, md5=False)
    t = (torch.randn(4, 8) * 4).to(dtype)
    with torch.no_grad():
        assert fast.record_text.text(t) == slow.text(t)
        entry = fast._cache[id(t)]
        for what, change in _in_place_changes(dtype):
            if dtype is torch.bool and what in ("mul_", "add_"):
                continue
            if what == "requires_grad_" and not dtype.is_floating_point:
                continue
            change(t)
            expected = json_text.encode(slow.summarize(t, None, False))
            assert fast.record_text.text(t) == expected, what
            assert fast.record_text.text(t) == expected, what  # the second time from the cache
            assert fast.tensor_text(t) in (None, expected), what  # the Python route reads the kernel's entry
        assert fast._cache[id(t)] is not entry or fast._cache[id(t)].version == t._version


@pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
def test_an_entry_moves_to_the_next_version_in_place_unless_tied_to_the_old_one():
    """An in-place update moves the tensor's cached entry to the new version (no new entry nor weak reference);
    an entry tied to its version (a saved file, a checksum) or made by the Python route is left as it is."""
    s = Summarizer(statistics=True, md5=False)
    t = torch.randn(8, 8)
    with torch.no_grad():
        s.record_text.text(t)
        entry = s._cache[id(t)]
        t.mul_(3)
        text = s.record_text.text(t)
        assert s._cache[id(t)] is entry and entry.version == t._version and entry.text + "false}" == text
        assert json.loads(text)["Max"] == float(t.max())
        entry.file = "/somewhere/t.pt"
        t.add_(1)
        s.record_text.text(t)
        assert s._cache[id(t)] is not entry and entry.file == "/somewhere/t.pt" and entry.version == t._version - 1
        u = torch.randn(8, 8)
        s.summarize(u, None, False)  # the dict route's entry: no facts kept
        python_made = s._cache[id(u)]
        u.mul_(2)
        assert s.record_text.text(u) == json_text.encode(s.summarize(u, None, False))
        assert s._cache[id(u)] is not python_made


@pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
def test_the_cache_keeps_the_newest_entries_whichever_route_drops_the_oldest():
    """The C text drops the cache's oldest entry as ``Summarizer._evict`` does (its search for it starting where
    the last one was dropped while the dict's table is the same): the newest ``CACHE_SIZE`` tensors stay, in
    order, through the Python route's drops, a reset and the table growing anew."""
    s = Summarizer(statistics=True, md5=False)
    tensors = [torch.randn(2) for _ in range(700)]
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if i == 300:
                s.reset()
            if i % 7 == 3:
                s.summarize(t, None, False)  # the Python route's entry (and its own drop)
            else:
                s.record_text.text(t)
            assert list(s._cache) == [id(u) for u in tensors[max(300 if i >= 300 else 0, i + 1 - CACHE_SIZE):i + 1]]


@pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
def test_an_entrys_statistics_read_from_python_are_the_kernels():
    """The C text keeps a version's statistics as a raw row in its entry; Python reading ``entry.stats`` gets the
    kernel's six values (one tuple, the same on every read), a value set from Python is the one used, and an
    in-place update leaves no statistics of the old version behind."""
    s = Summarizer(statistics=True, md5=False)
    t = torch.randn(16, 16)
    with torch.no_grad():
        s.record_text.text(t)
        entry = s._cache[id(t)]
        assert entry.stats == KERNEL.stats(t.data_ptr(), t.numel(), 0, -1.0, 1)
        assert entry.stats is entry.stats
        view = t.view(256)
        s.share(t, view)  # the Python route reads the row's tuple
        assert s._cache[id(view)].stats == entry.stats
        assert s.record_text.text(view) == json_text.encode(s.summarize(view, None, False))
        t.mul_(2)
        text = s.record_text.text(t)
        assert s._cache[id(t)] is entry and entry.stats == KERNEL.stats(t.data_ptr(), t.numel(), 0, -1.0, 1)
        assert json.loads(text)["Max"] == float(t.max())
        t.add_(1)
        entry.stats = None
        assert entry.stats is None
        del entry.stats
        assert entry.stats is None and s.record_text.text(t) == json_text.encode(s.summarize(t, None, False))


def test_summary_text_is_not_made_for_checksums_or_without_the_kernel(monkeypatch):
    assert Summarizer(statistics=True, md5=True).text(torch.randn(3)) is None
    from msprobe_core.pytorch import tensor_stats
    monkeypatch.setattr(tensor_stats, "_fast_stats", None)  # MSPROBE_FAST_STATS=0
    assert Summarizer(statistics=True, md5=False).text([torch.randn(3)]) is None


def test_a_text_record_is_journaled_whole_and_replays_to_the_written_files(tmp_path):
    rec = StepRecorder(tmp_path / "rank0", {"task": "statistics", "level": "mix"})
    stack = CallStack(7, (("/a.py", 3, "f"), ("/b.py", 9, "g")))
    seq = rec.reserve("Module.m.forward.0", stack)
    seq2 = rec.reserve("Functional.relu.0.forward", stack)
    rec.put_text("Functional.relu.0.forward", '{"input_args": [], "input_kwargs": {}, "output": [NaN]}', seq2, stack,
                 "Module.m.forward.0")
    rec.put("Tensor.add.0.forward", {"output": [1.5]}, rec.reserve("Tensor.add.0.forward"))  # queued
    rec.put_text("Module.m.forward.0", '{"output": []}', seq, stack, None)  # behind the queued record
    rec.put_text("Torch.x.0.forward", '{"output": []}', rec.reserve("Torch.x.0.forward"), None, NO_PARENT)
    rec.sync_journal()
    header, name, data, stacks, construct = replay_journal(read_frames(rec.journal_path.read_bytes()))
    kinds = [e[0] for e in read_frames(rec.journal_path.read_bytes())]
    assert kinds == ["h", "S", "J", "j", "J", "J"]  # a stack once, then by its id; order kept behind the queue
    rec.write_files()
    written = json.loads((rec.rank_dir / "dump.json").read_text())
    assert header == {"task": "statistics", "level": "mix"} and name == "dump.json"
    assert json.dumps(data) == json.dumps(written["data"])  # NaN included
    assert list(data) == ["Module.m.forward.0", "Functional.relu.0.forward", "Tensor.add.0.forward", "Torch.x.0.forward"]
    assert construct == json.loads((rec.rank_dir / "construct.json").read_text()) == {
        "Functional.relu.0.forward": "Module.m.forward.0", "Module.m.forward.0": None}
    stack_json = json.loads((rec.rank_dir / "stack.json").read_text())
    assert list(stack_json) == ["Module.m.forward.0", "Functional.relu.0.forward"]  # places kept by reserve()
    assert {k: [list(f) for f in v] for k, v in stacks.items()} == {k: [list(f) for f in stack.frames] for k in stack_json}


def _three_frames(capture, depth):
    def inner():
        return capture.capture(depth)

    def middle():
        return inner()

    return [middle() for _ in range(2)]  # one call site


@pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
def test_stacks_are_the_same_with_and_without_the_kernels_frame_walk(monkeypatch):
    found = []
    for walk in (call_stack._frame_key, None):  # the kernel's walk, then the Python one
        monkeypatch.setattr(call_stack, "_frame_key", walk)
        found.append(_three_frames(StackCapture(("/nowhere",), ()), 1))
    (a1, a2), (b1, b2) = found
    assert a1 is a2 and b1 is b2  # interned: one stack per call site
    assert a1.frames == b1.frames and a1.frames[-1][2] == "inner"


@pytest.mark.parametrize("level", ["L0", "L1", "mix"])
def test_a_killed_statistics_dump_loses_no_record(tmp_path, level):
    """Text records are journaled as they are made (a backward record's gradients one by one): the recovered
    step equals the step of a run not killed."""
    for d in ("killed", "full"):
        (tmp_path / d).mkdir()
    killed, out = run_killed_mid_step(tmp_path / "killed", "SIGKILL", level, "statistics")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    full, ref = run_killed_mid_step(tmp_path / "full", "SIGCONT", level, "statistics")  # SIGCONT: goes on
    assert full.returncode == 0, full.stderr
    res = subprocess.run([sys.executable, "-m", "msprobe_core", "recover", str(out)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert res.returncode == 0, res.stderr
    got, want = (next((d / "step1").iterdir()) for d in (out, ref))
    recovered = json.loads((got / "dump.json").read_text())
    assert recovered.pop("recovered") is True
    assert recovered == json.loads((want / "dump.json").read_text())
    for name in ("stack.json", "construct.json"):
        assert json.loads((got / name).read_text()) == json.loads((want / name).read_text())


def _close(a, b) -> bool:
    """Same JSON structure; floats equal to 1e-5 relative (the kernel and torch's reductions round differently)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-5, abs=1e-6, nan_ok=True)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.skipif(KERNEL is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
def test_without_the_kernel_the_dump_has_the_same_records_and_stacks(tmp_path, monkeypatch):
    """MSPROBE_FAST_STATS=0: summaries from torch's reductions (the dict route), stacks by the Python frame walk."""
    runs = []
    for name, switch in (("kernel", "1"), ("torch", "0")):
        (tmp_path / name).mkdir()
        monkeypatch.setenv("MSPROBE_FAST_STATS", switch)
        proc, out = run_killed_mid_step(tmp_path / name, "SIGCONT", "mix", "statistics")
        assert proc.returncode == 0, proc.stderr
        runs.append(out)
    for step in ("step0", "step1", "step2"):
        a, b = (next((out / step).iterdir()) for out in runs)
        for name in ("stack.json", "construct.json"):
            assert (a / name).read_text() == (b / name).read_text()
        assert _close(json.loads((a / "dump.json").read_text()), json.loads((b / "dump.json").read_text()))
