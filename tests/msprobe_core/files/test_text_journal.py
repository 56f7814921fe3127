"""``StepRecorder.put_text`` in C (the kernel's ``TextJournal``): the same stores, the same journal frames byte
for byte as the Python route (``marshal.dumps`` of the same tuples), the same order behind queued fragments,
the same fallbacks (no journal, a journal whose appends fail), and a killed process still loses no record."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import signal
import subprocess
import sys
import weakref

import pytest

from msprobe_core.files import step_recorder
from msprobe_core.files.call_stack import CallStack, format_frame
from msprobe_core.files.step_recorder import NO_PARENT, StepRecorder, read_frames, read_journal, recover_journal
from msprobe_core.stats.kernel import KERNEL

pytestmark = pytest.mark.skipif(getattr(KERNEL, "TextJournal", None) is None,
                                reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _recorder(path, fast, monkeypatch, journal=True):
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(step_recorder, "KERNEL", None)
        rec = StepRecorder(path, {"task": "statistics", "level": "L1"}, journal=journal)
    assert (rec._text_journal is not None) == (fast and journal)
    return rec


def _journaled(rec):
    """The journal's frames as bytes (up to its end: a reused file holds a previous step's frames after it)."""
    raw = rec.journal_path.read_bytes()
    return raw[:read_journal(raw)[1]]


def _records(rec):
    """The same calls on either route: stacks new and known, parents, NO_PARENT, seq given or taken now,
    non-ASCII and long texts, names seen before, large and small numbers, fragments queued in between."""
    s1 = CallStack(7, (("/a.py", 3, "f"), ("/a.py", 9, "g"), ("/b.py", 1, "<module>")))
    s2 = CallStack(2 ** 40, (("/é.py", 5, "h"),))
    s3 = CallStack(5, ())
    long_text = '{"input_args": [' + ", ".join(["1.5"] * 200) + "]}"
    rec.put_text("Torch.a.0.forward", '{"output": []}', None, s1, None)
    rec.put_text("Torch.b.0.forward", long_text, rec.reserve("Torch.b.0.forward"), s1, "Torch.a.0.forward")
    rec.put_text("Torch.é.0.forward", '{"output": ["ü"]}', None, s2, NO_PARENT)
    rec.put_text("Torch.c.0.forward", '{"output": [NaN]}', 2 ** 35, None, "Module.x")
    rec.put("Tensor.add.0.forward", {"output": [1.5]}, rec.reserve("Tensor.add.0.forward"))  # queued: next go behind
    rec.put_text("Torch.d.0.forward", '{"output": []}', None, s3, None)
    rec.put_text("Torch.e.0.forward", "{}", None, s1)
    rec.sync_journal()
    rec.put_text("J", "{}", 5, None, "J")  # the same object twice in one frame: a back-reference
    rec.put_text(name="Torch.f.0.forward", text="{}", seq=None, stack=s2, parent=None)
    for i in range(300):
        rec.put_text(f"Tensor.mul_.{i}.forward", '{"input_args": [], "input_kwargs": {}, "output": []}', None, s1, None)


@contextlib.contextmanager
def _full_disk(monkeypatch):
    """Every journal append fails with ENOSPC until the yielded switch's "on" is set False."""
    real = step_recorder.Journal.append
    full = {"on": True}

    def append(journal, data):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(journal, data)

    with monkeypatch.context() as m:
        m.setattr(step_recorder.Journal, "append", append)
        yield full


def test_put_text_writes_the_python_routes_frames_and_files(tmp_path, monkeypatch):
    recs = {fast: _recorder(tmp_path / str(fast), fast, monkeypatch) for fast in (False, True)}
    for rec in recs.values():
        _records(rec)
    journals = {fast: _journaled(rec) for fast, rec in recs.items()}
    assert journals[True] == journals[False]
    assert [e[0] for e in read_frames(journals[True])].count("S") == 3
    for rec in recs.values():
        assert rec._change_count() == 309
        rec.finish()
    for name in ("dump.json", "stack.json", "construct.json"):
        assert (tmp_path / "True" / name).read_bytes() == (tmp_path / "False" / name).read_bytes()


def test_without_a_journal_the_records_are_stored_alike(tmp_path, monkeypatch):
    recs = {fast: _recorder(tmp_path / str(fast), fast, monkeypatch, journal=False) for fast in (False, True)}
    for rec in recs.values():
        _records(rec)
        rec.finish()
    for name in ("dump.json", "stack.json", "construct.json"):
        assert (tmp_path / "True" / name).read_bytes() == (tmp_path / "False" / name).read_bytes()


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "os.write"])
def test_a_journal_that_cannot_take_a_frame_queues_it_in_order(tmp_path, monkeypatch, mapped):
    """A full disk (``Journal.append`` raising ENOSPC, as a test's fault injection makes it): the frame waits in the
    queue, the error reaches the caller, and the next sync journals everything in order, as the Python route does."""
    out = {}
    for fast in (False, True):
        rec = _recorder(tmp_path / str(fast), fast, monkeypatch)
        rec.ensure_dir()
        if not mapped:
            rec._journal._mapped = False
        stack = CallStack(3, (("/a.py", 1, "f"),))
        rec.put_text("Torch.a.0.forward", "{}", None, stack, None)
        with _full_disk(monkeypatch) as full:
            with pytest.raises(OSError):
                rec.put_text("Torch.b.0.forward", '{"x": 1}', None, CallStack(4, (("/b.py", 2, "g"),)), None)
            assert [e[0] for e in rec._queued] == ["S", "J"]
            rec.put_text("Torch.c.0.forward", "{}", None, None, None)  # behind the queued ones
            full["on"] = False
            rec.sync_journal()
        assert not rec._queued
        out[fast] = _journaled(rec)
        rec.finish()
    assert out[True] == out[False]
    assert [e[1] for e in read_frames(out[True]) if e[0] == "J"] == ["Torch.a.0.forward", "Torch.b.0.forward",
                                                                     "Torch.c.0.forward"]


def test_the_recorder_is_freed_without_the_garbage_collector(tmp_path, monkeypatch):
    rec = _recorder(tmp_path / "r", True, monkeypatch)
    rec.put_text("Torch.a.0.forward", "{}", None, None, None)
    rec.finish()
    gone = weakref.ref(rec)
    gc.disable()
    try:
        del rec
        assert gone() is None  # no reference cycle through its C put_text
    finally:
        gc.enable()


def test_put_text_refuses_bad_arguments(tmp_path, monkeypatch):
    rec = _recorder(tmp_path / "r", True, monkeypatch)
    with pytest.raises(TypeError):
        rec.put_text("a", "{}")
    with pytest.raises(TypeError):
        rec.put_text("a", "{}", None, None, None, None)
    with pytest.raises(TypeError):
        rec.put_text("a", "{}", None, colour=1)
    rec.finish()


_KILLED = r"""
import os, signal, sys
from msprobe_core.files.call_stack import CallStack, format_frame
from msprobe_core.files.step_recorder import StepRecorder
rec = StepRecorder(__import__("pathlib").Path(sys.argv[1]), {"task": "statistics", "level": "L1"})
assert rec._text_journal is not None
stack = CallStack(1, (("/a.py", 1, "f"),))
for i in range(5000):
    rec.put_text(f"Tensor.mul_.{i}.forward", '{"output": [%d]}' % i, None, stack, None)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_process_loses_no_record_put_in_c(tmp_path):
    rank = tmp_path / "rank0"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(rank)], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert recover_journal(rank / ".dump.journal")
    data = json.loads((rank / "dump.json").read_text())["data"]
    assert len(data) == 5000 and data["Tensor.mul_.4999.forward"] == {"output": [4999]}
    assert list(data)[:2] == ["Tensor.mul_.0.forward", "Tensor.mul_.1.forward"]
    assert json.loads((rank / "stack.json").read_text())["Tensor.mul_.0.forward"] == [format_frame(("/a.py", 1, "f"))]


def _fields(arg):
    return step_recorder.TextFields({"input": [None] * arg, "output": [None]}, arg + 1)


def _grad_records(rec):
    """Gradient slots on either route: first fields, the rest, complete records, a slot the record was not made
    with, a record made by ``put_field``, a slot set twice, fragments queued in between."""
    assert rec.put_text_field("Module.a.backward.0", "input", 0, '{"g": 1}', _fields, 2, None) is False
    assert rec.put_text_field("Module.a.backward.0", "input", 1, '{"g": 2}', _fields, 2, None) is False
    assert rec.put_text_field("Module.a.backward.0", "output", 0, '{"g": 3}', _fields, 2, None) is False
    assert type(rec.data["Module.a.backward.0"]) is str  # complete: held as its text
    rec.put_text_field("Module.b.backward.0", "output", 0, '{"g": "é"}', _fields, 1, NO_PARENT)
    rec.put_text_field("Module.b.backward.0", "output", 3, '{"g": 4}', _fields, 1, NO_PARENT)  # a new slot
    rec.put_text_field("Module.b.backward.0", "weight", 0, '{"g": 5}', _fields, 1, NO_PARENT)  # a new field
    rec.put_text_field("Module.b.backward.0", "output", 0, '{"g": 6}', _fields, 1, NO_PARENT)  # set again
    rec.put("Tensor.add.0.forward", {"output": [1.5]}, rec.reserve("Tensor.add.0.forward"))  # queued
    rec.put_text_field("Module.b.backward.0", "input", 0, '{"g": 7}', _fields, 1, NO_PARENT)
    rec.sync_journal()
    rec.put_field("Module.c.backward.0", ["input", 0], {"g": 8}, dict)
    assert rec.put_text_field("Module.c.backward.0", "input", 1, '{"g": 9}', _fields, 1, None) is True
    for i in range(100):
        rec.put_text_field(f"Module.d.{i}.backward", "input", 0, '{"g": 1.5}', _fields, 1, "Module.x")
        rec.put_text_field(f"Module.d.{i}.backward", "output", 0, '{"g": 2.5}', _fields, 1, "Module.x")


def test_put_text_field_writes_the_python_routes_frames_and_files(tmp_path, monkeypatch):
    recs = {fast: _recorder(tmp_path / str(fast), fast, monkeypatch) for fast in (False, True)}
    for rec in recs.values():
        _grad_records(rec)
        rec.sync_journal()
    journals = {fast: _journaled(rec) for fast, rec in recs.items()}
    assert journals[True] == journals[False]
    assert {k: str(v) for k, v in recs[True].data.items()} == {k: str(v) for k, v in recs[False].data.items()}
    assert recs[True]._change_count() == recs[False]._change_count()
    assert recs[True]._text_journal.count > 100  # the slots of records that are there: set in C
    for rec in recs.values():
        rec.finish()
    for name in ("dump.json", "stack.json", "construct.json"):
        assert (tmp_path / "True" / name).read_bytes() == (tmp_path / "False" / name).read_bytes()


def _param_fields(count):
    return step_recorder.TextFields({}, count)


def _first_fields(rec):
    """Records' first fields, each made in one C call on the kernel's route: a record of parameters (made empty, its
    field new), a reserved name, a first slot beyond the field's, a record complete at its first field, a skeleton
    with a non-ASCII field name (marshal's own writer), first fields behind queued fragments, and odd indexes."""
    rec.put_text_field("Module.p.parameters_grad", "weight", 0, '{"g": 1}', _param_fields, 2, NO_PARENT)
    rec.put_text_field("Module.p.parameters_grad", "bias", 0, '{"g": 2}', _param_fields, 2, NO_PARENT)
    rec.reserve("Module.r.backward.0")
    rec.put_text_field("Module.r.backward.0", "output", 0, '{"g": 3}', _fields, 1, "Module.r")
    rec.put_text_field("Module.s.backward.0", "output", 4, '{"g": 4}', _fields, 0, None)
    rec.put_text_field("Module.t.backward.0", "output", 0, '{"g": 5}', _fields, 0, None)
    assert type(rec.data["Module.t.backward.0"]) is str
    rec.put_text_field("Module.u.backward.0", "ü", 0, '{"g": 6}',
                       lambda n: step_recorder.TextFields({"ü": [None] * n}, n), 2, None)
    rec.put("Tensor.add.0.forward", {"output": [1.5]}, rec.reserve("Tensor.add.0.forward"))  # queued
    rec.put_text_field("Module.v.backward.0", "input", 1, '{"g": 7}', _fields, 3, None)
    rec.sync_journal()
    with pytest.raises(IndexError):  # a negative index: the Python route's answer
        rec.put_text_field("Module.w.backward.0", "input", -1, '{"g": 8}', _fields, 0, None)
    for i in range(2 ** 31 - 2, 2 ** 31 + 1):  # an index past marshal's 32-bit ints: its own writer
        rec.put_text_field(f"Module.x.{i}.parameters_grad", "w", 0, '{"g": 9}', _param_fields, 1, NO_PARENT)


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_a_records_first_field_is_written_as_the_python_route_writes_it(tmp_path, monkeypatch, journal):
    recs = {fast: _recorder(tmp_path / str(fast), fast, monkeypatch, journal) for fast in (False, True)}
    for rec in recs.values():
        _first_fields(rec)
        rec.sync_journal()
    if journal:
        journals = {fast: _journaled(rec) for fast, rec in recs.items()}
        assert journals[True] == journals[False]
        assert sum(e[0] == "t" and e[3] is not None for e in read_frames(journals[True])) == 9
        assert recs[True]._text_journal.count == 10  # every field set in C
    assert {k: str(v) for k, v in recs[True].data.items()} == {k: str(v) for k, v in recs[False].data.items()}
    assert {k: (v.filled, v.expected) for k, v in recs[True].data.items() if type(v) is step_recorder.TextFields} \
        == {k: (v.filled, v.expected) for k, v in recs[False].data.items() if type(v) is step_recorder.TextFields}
    assert recs[True].construct == recs[False].construct
    assert recs[True]._change_count() == recs[False]._change_count()
    for rec in recs.values():
        rec.finish()
    for name in ("dump.json", "stack.json", "construct.json"):
        assert (tmp_path / "True" / name).read_bytes() == (tmp_path / "False" / name).read_bytes()


def test_a_first_field_that_cannot_be_journaled_is_queued_in_order(tmp_path, monkeypatch):
    """A full disk at a record's first field: the fragment (with its skeleton) waits in the queue, as in Python."""
    out = {}
    for fast in (False, True):
        rec = _recorder(tmp_path / str(fast), fast, monkeypatch)
        rec.ensure_dir()
        with _full_disk(monkeypatch) as full:
            with pytest.raises(OSError):
                rec.put_text_field("Module.a.backward.0", "input", 0, '{"g": 1}', _fields, 1, None)
            assert [e[0] for e in rec._queued] == ["t"]
            rec.put_text_field("Module.b.backward.0", "input", 0, '{"g": 2}', _fields, 1, None)  # behind it
            full["on"] = False
            rec.sync_journal()
        out[fast] = _journaled(rec)
        rec.finish()
    assert out[True] == out[False]


def test_fields_that_make_no_text_fields_are_refused(tmp_path, monkeypatch):
    rec = _recorder(tmp_path / "r", True, monkeypatch)
    with pytest.raises(TypeError, match="not a TextFields"):
        rec.put_text_field("Module.a.backward.0", "input", 0, '{"g": 1}', lambda n: {"input": [None]}, 1, None)
    assert "Module.a.backward.0" not in rec.data
    rec.finish()


_KILLED_FIELDS = r"""
import os, signal, sys
from msprobe_core.files.step_recorder import StepRecorder, TextFields
rec = StepRecorder(__import__("pathlib").Path(sys.argv[1]), {"task": "statistics", "level": "L1"})
assert rec._text_journal is not None
fields = lambda n: TextFields({"input": [None] * n, "output": [None]}, n + 1)
for i in range(3000):
    rec.put_text_field(f"Tensor.mul.{i}.backward", "input", 1, '{"g": %d}' % i, fields, 2, None)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_process_loses_no_first_field_put_in_c(tmp_path):
    rank = tmp_path / "rank0"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _KILLED_FIELDS, str(rank)], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert recover_journal(rank / ".dump.journal")
    data = json.loads((rank / "dump.json").read_text())["data"]
    assert len(data) == 3000 and list(data)[:2] == ["Tensor.mul.0.backward", "Tensor.mul.1.backward"]
    assert data["Tensor.mul.2999.backward"] == {"input": [None, {"g": 2999}], "output": [None]}
    assert json.loads((rank / "construct.json").read_text())["Tensor.mul.0.backward"] is None


def test_a_complete_records_text_is_made_in_c_as_textfields_text_makes_it(tmp_path, monkeypatch):
    """Once its field names' texts are known (``_FIELD_KEYS``), a complete record's text is made in C, the same str
    as ``TextFields.text``'s; a text without UTF-8 (a lone surrogate) is left to the method."""
    texts = ['{"g": 1.5}', '{"g": "é"}', '{"g": "\ud800"}']
    made = {}
    for fast in (False, True):
        rec = _recorder(tmp_path / str(fast), fast, monkeypatch)
        calls = []
        text = step_recorder.TextFields.text
        with monkeypatch.context() as m:
            m.setattr(step_recorder.TextFields, "text", lambda self: calls.append(1) or text(self))
            for i, t in enumerate(texts):
                for field, index in (("output", 0), ("input", 1), ("input", 0)):
                    rec.put_text_field(f"Module.{i}.backward", field, index, t, _fields, 2, None)
        made[fast] = (dict(rec.data), len(calls))
        rec.finish()
    assert made[True][0] == made[False][0] and all(type(v) is str for v in made[True][0].values())
    assert made[False][1] == 3 and made[True][1] == 1  # the lone surrogate's


def test_reserve_in_c_keeps_the_python_routes_places(tmp_path, monkeypatch):
    out = {}
    stack = CallStack(3, (("/a.py", 1, "f"),))
    for fast in (False, True):
        rec = _recorder(tmp_path / str(fast), fast, monkeypatch)
        assert ("reserve" in vars(rec)) == fast  # the C one bound on the kernel's route
        seqs = [rec.reserve("Module.a.forward.0"), rec.reserve("Module.b.forward.0", stack),
                rec.reserve("Module.a.forward.0", None)]
        rec.put_text("Module.b.forward.0", "{}", seqs[1], stack, None)
        out[fast] = (seqs, dict(rec.data), dict(rec.stack), _journaled(rec))
        rec.finish()
    assert out[True] == out[False] and out[True][0] == [0, 1, 2]
    with monkeypatch.context() as m:  # a class whose reserve is not the recorder's: its own is kept
        m.setattr(StepRecorder, "reserve", lambda self, name, stack=None: -5)
        rec = _recorder(tmp_path / "patched", True, monkeypatch)
        assert rec.reserve("x") == -5
        rec.finish()
