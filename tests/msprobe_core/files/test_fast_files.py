"""The step's JSON files (dump.json, stack.json, construct.json) written by the kernel's ``write_lines`` (one C call
per file, ``writev`` from the records' strs) and by the Python route: the same bytes, the bytes the files always
had (a copy of the earlier writer below pins them), written atomically, and errors that leave no torn file."""

from __future__ import annotations

import errno
import io
import json
import os

import pytest

from msprobe_core.files import step_recorder
from msprobe_core.files.atomic_write import write_fd_atomic
from msprobe_core.files.call_stack import CallStack
from msprobe_core.files.json_text import encode
from msprobe_core.files.step_recorder import (StepRecorder, TextFields, dumps_by_line, recover_journal,
                                              write_json_atomic, write_lines_atomic)
from msprobe_core.stats.kernel import KERNEL

needs_kernel = pytest.mark.skipif(getattr(KERNEL, "write_lines", None) is None,
                                  reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
ROUTES = [pytest.param(True, id="kernel", marks=needs_kernel), pytest.param(False, id="python")]

ODD = ['plain', 'quote"d', 'back\\slash', 'tab\there', 'new\nline', 'cr\r', 'bell\x07', 'nul\x00', 'esc\x1b',
       'unit\x1f', 'del\x7f', 'bs\b ff\f', 'é', '中文', 'emoji 🙂', 'lone \ud800', 'pair \udbff\udfff', '']


# ------------------------------------------------------------------ the earlier writer, as it was (the reference)
def _old_key(k):
    return json.encoder.encode_basestring(k) if type(k) is str else encode(k)


def _old_record_text(v):
    if type(v) is str:
        return v
    return v.text() if type(v) is TextFields else encode(v)


def _old_lines(entries, text, indent=" "):
    if not entries:
        return "{\n\n}\n"
    parts = ["{\n"]
    for k, v in entries.items():
        parts.extend((indent, _old_key(k), ": ", text(v), ",\n"))
    parts[-1] = "\n}\n"
    return "".join(parts)


def _old_dumps_by_line(obj):
    if not isinstance(obj, dict):
        return encode(obj)
    parts = []
    for key, value in obj.items():
        if key == "data" and isinstance(value, dict) and value:
            parts.append(f" {encode(key)}: {{\n{_old_lines(value, _old_record_text, '  ')[2:-3]}\n }}")
        else:
            parts.append(f" {encode(key)}: {encode(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _old_bytes(text):
    out = io.BytesIO()
    with io.TextIOWrapper(out, encoding="utf-8", errors="backslashreplace", newline="") as f:
        f.write(text)
        f.flush()
        return out.getvalue()


# ------------------------------------------------------------------ cases
def _stacks():
    return [CallStack(i, ((f"/a{i}.py", i, "f"), ("/é.py", 2, "g\"q"))) for i in range(3)]


def _docs():
    """(name, dump.json document, stack.json entries, construct.json entries)."""
    long_text = '{"input_args": [' + ", ".join(["1.5"] * 40) + "]}"  # past the inlined size: its own piece
    stacks = _stacks()
    field = TextFields({"grad": [None, '{"Max": 1.0}']}, 2)
    many = {f"Tensor.mul_.{i}.forward": long_text if i % 3 else "{}" for i in range(3000)}  # > IOV_MAX pieces
    odd_data = {f"Torch.{name}.0.forward": '{"output": [' + encode(name) + "]}" for name in ODD}
    odd_data["Torch.none.0.forward"] = None  # a name reserved whose record never came: no line
    odd_data["Torch.dict.0.forward"] = {"output": [1.5, float("nan")]}  # a record still as a dict
    odd_data["Torch.fields.0.forward"] = field
    header = {"task": "statistics", "level": "L1", "framework": "pytorch", "dump_data_dir": None}
    yield ("odd", {**header, "data": odd_data}, {n: stacks[i % 3] for i, n in enumerate(odd_data)},
           {n: (None if i % 2 else "Module.é\"x") for i, n in enumerate(odd_data)})
    yield "many", {**header, "data": many}, {n: stacks[0] for n in many}, dict.fromkeys(many, "Module.m")
    yield "empty", {**header, "data": {}}, {}, {}
    yield "all-none", {**header, "data": {"a": None, "b": None}}, {}, {"a": None}
    yield "after-data", {"task": "t", "data": {"a": "{}"}, "recovered": True, "lost": 2}, {}, {}
    yield "no-data", {"task": "t\u2028", "x": [1, "é"]}, {}, {}
    yield "int-names", {"data": {1: "{}", "b": "[]"}}, {2: stacks[1]}, {3: None, "c": "d"}
    yield "odd-values", {"data": {"a": "{}"}}, {"s": stacks[2]}, {"a": 5, "b": ["x"]}


def _files(tmp_path, fast, monkeypatch, doc, stack, construct):
    if not fast:
        monkeypatch.setattr(step_recorder, "_write_lines", None)
    tmp_path.mkdir()
    write_json_atomic(tmp_path / "dump.json", doc)
    write_lines_atomic(tmp_path / "stack.json", stack, step_recorder._stack_text)
    write_lines_atomic(tmp_path / "construct.json", construct)
    monkeypatch.undo()
    return {name: (tmp_path / name).read_bytes() for name in ("dump.json", "stack.json", "construct.json")}


@pytest.mark.parametrize("fast", ROUTES)
def test_both_routes_write_the_earlier_writers_bytes(tmp_path, monkeypatch, fast):
    for name, doc, stack, construct in _docs():
        got = _files(tmp_path / name, fast, monkeypatch, doc, stack, construct)
        old_doc = {k: ({n: r for n, r in v.items() if r is not None} if k == "data" else v) for k, v in doc.items()}
        assert got["dump.json"] == _old_bytes(_old_dumps_by_line(old_doc)), name
        assert got["stack.json"] == _old_bytes(_old_lines(stack, lambda s: s.json_text(encode))), name
        assert got["construct.json"] == _old_bytes(_old_dumps_by_line(construct)), name
        assert dumps_by_line(doc) == _old_dumps_by_line(old_doc), name
        if name == "odd":  # a lone surrogate reads back as the same name (a pair of them as the one character)
            names = {n.replace("\udbff\udfff", "\U0010ffff") for n, r in doc["data"].items() if r is not None}
            assert set(json.loads(got["dump.json"])["data"]) == names


def test_a_non_dict_document_is_its_json_text(tmp_path):
    write_json_atomic(tmp_path / "x.json", ["a", 1])
    assert (tmp_path / "x.json").read_bytes() == b'["a", 1]'


@needs_kernel
def test_the_kernel_asks_text_once_per_object_and_leaves_the_python_route_what_it_cannot_write(tmp_path):
    asked = []

    def text(v):
        asked.append(v)
        return v.json_text(encode)

    stacks = _stacks()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert KERNEL.write_lines(fd, b"{\n", {f"n{i}": stacks[i % 2] for i in range(100)}, " ", text, b"\n}\n", b"")
        assert sorted(s.sid for s in asked) == [0, 1]  # interned stacks: their text asked once each
        before = os.lseek(fd, 0, os.SEEK_CUR)
        for entries, how in [({1: "{}"}, text), ({"a": "\udc80"}, text), ({"\ud800": "{}"}, text), ({"a": 5}, None),
                             ({"a": object()}, lambda v: 5), (OrderedDictLike(a="{}"), text)]:
            assert KERNEL.write_lines(fd, b"{", entries, " ", how, b"}", b"") is False
        assert os.lseek(fd, 0, os.SEEK_CUR) == before  # nothing written when the Python route must write it
        with pytest.raises(ZeroDivisionError):
            KERNEL.write_lines(fd, b"{", {"a": object()}, " ", lambda v: 1 / 0, b"}", b"")
        with pytest.raises(TypeError):
            KERNEL.write_lines(fd, "{", {}, " ", None, b"}", b"")
    finally:
        os.close(fd)


class OrderedDictLike(dict):
    """A dict subclass: the Python route writes it (it may order or hold its items in its own way)."""


@pytest.mark.parametrize("fast", ROUTES)
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, fast):
    if not fast:
        monkeypatch.setattr(step_recorder, "_write_lines", None)
    path = tmp_path / "dump.json"
    path.write_text("old")

    def broken(v):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        write_lines_atomic(path, {"a": object()}, broken)
    with pytest.raises(OSError):  # the disk fills while writing
        write_fd_atomic(path, lambda fd: (os.write(fd, b"{"), _raise_enospc()))
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["dump.json"]


def _raise_enospc():
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fast", ROUTES)
def test_a_full_device_is_an_oserror(monkeypatch, fast):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    if not fast:
        monkeypatch.setattr(step_recorder, "_write_lines", None)
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OSError) as e:
            step_recorder._Section.flat({"a": "x" * 500}, str).write(fd)
        assert e.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.mark.parametrize("fast", ROUTES)
def test_the_recorders_files_and_recover_write_the_same_stacks_and_hierarchy(tmp_path, monkeypatch, fast):
    if not fast:
        monkeypatch.setattr(step_recorder, "_write_lines", None)
    stacks = _stacks()
    rec = StepRecorder(tmp_path, {"task": "statistics", "level": "mix", "framework": "pytorch", "dump_data_dir": None})
    for i, name in enumerate(ODD):
        rec.put_text(f"Torch.{name}.{i}.forward", '{"output": []}', None, stacks[i % 3], None if i % 2 else "M.é")
    rec.reserve("Torch.never.0.forward")
    rec.write_files()
    written = {n: (tmp_path / n).read_bytes() for n in ("stack.json", "construct.json")}
    assert b"never" not in (tmp_path / "dump.json").read_bytes()
    assert recover_journal(rec.journal_path)
    assert {n: (tmp_path / n).read_bytes() for n in written} == written
    rec.finish()
    assert sorted(os.listdir(tmp_path)) == ["construct.json", "dump.json", "stack.json"]
