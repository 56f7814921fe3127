"""One journal file step after step (``files/journal.py``): a finished step's journal is this process's spare and
the next step's journal, written from its start again. A process killed mid-step leaves a journal whose frames are
that step's only (the previous steps' frames after them are never read, on either route); a process killed between
steps leaves a spare that ``recover`` removes and never reads; a normal run leaves no spare or journal anywhere."""

from __future__ import annotations

import errno
import json
import marshal
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from msprobe_core.dump.recover import recover
from msprobe_core.files import journal as journal_mod
from msprobe_core.files.journal import SPARE_SUFFIX, Journal, release_spares
from msprobe_core.files.step_recorder import StepRecorder, read_frames, read_journal
from msprobe_core.stats.kernel import KERNEL

ROOT = str(Path(__file__).resolve().parents[3])
HEADER = {"task": "statistics", "level": "L1"}

# Steps of records whose frames have one size on every step: the killed step's last frame ends exactly where a
# previous step's frame begins, which a journal without its end would read as the killed step's.
_STEPS = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from msprobe_core.files import step_recorder
    out, kill = Path(sys.argv[1]), sys.argv[4]
    steps = [(p, int(n)) for p, n in (s.split(":") for s in sys.argv[3].split(","))]
    for step, (prefix, n) in enumerate(steps):
        rec = step_recorder.StepRecorder(out / f"step{step}" / "rank0", {"task": "statistics", "level": "L1"})
        for i in range(n):
            name = f"Tensor.{prefix}.{i:04d}.forward"
            if i % 7 == 3:  # a fragment queued, then synced in a batch of frames
                rec.put(name, {"output": [i]}, rec.reserve(name))
                rec.sync_journal()
            else:
                rec.put_text(name, '{"output": [%d]}' % (1000 + i), None)
        last = step == len(steps) - 1
        if last and kill == "mid":
            os.kill(os.getpid(), signal.SIGKILL)
        rec.finish()
        if last and kill == "after":
            os.kill(os.getpid(), signal.SIGKILL)
""")

ROUTES = ["python"] + (["c"] if getattr(KERNEL, "TextJournal", None) is not None else [])


def _run(out: Path, route: str, steps: str, kill: str) -> subprocess.CompletedProcess:
    """The steps (``prefix:records,...``) on ``route`` (``python``: no kernel at all), killed as ``kill`` says (``mid``
    the last step, ``after`` it, or ``none``)."""
    return subprocess.run([sys.executable, "-c", _STEPS, str(out), route, steps, kill],
                          env=dict(os.environ, PYTHONPATH=ROOT, MSPROBE_FAST_STATS="0" if route == "python" else "1"),
                          capture_output=True, text=True, timeout=120)


def _names(prefix: str, n: int) -> list[str]:
    return [f"Tensor.{prefix}.{i:04d}.forward" for i in range(n)]


def _left(out: Path, pattern: str) -> list[Path]:
    return sorted(out.rglob(pattern))


@pytest.mark.parametrize("route", ROUTES)
def test_a_step_killed_on_a_reused_journal_recovers_its_own_records_only(tmp_path, route):
    out = tmp_path / "dump"
    proc = _run(out, route, "a:300,b:40,c:25", "mid")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    journal = out / "step2" / "rank0" / ".dump.journal"
    raw = journal.read_bytes()
    assert b"Tensor.a.0299.forward" in raw and b"Tensor.b.0039.forward" in raw  # the earlier steps' frames are there
    assert _left(out, f"*{SPARE_SUFFIX}") == [] and _left(out, "*.journal") == [journal]
    assert recover(out) == [journal.parent]
    doc = json.loads((journal.parent / "dump.json").read_text())
    assert list(doc["data"]) == _names("c", 25) and "damaged_journal_entries" not in doc and doc["recovered"]
    assert doc["data"]["Tensor.c.0003.forward"] == {"output": [3]}
    assert doc["data"]["Tensor.c.0022.forward"] == {"output": [1022]}
    for step, (prefix, n) in enumerate([("a", 300), ("b", 40)]):  # the finished steps are as they were written
        assert list(json.loads((out / f"step{step}" / "rank0" / "dump.json").read_text())["data"]) == _names(prefix, n)
    assert not journal.exists()


def test_both_routes_write_the_same_journal_on_a_reused_file(tmp_path):
    if len(ROUTES) < 2:
        pytest.skip("the kernel is not built")
    kept = {}
    for route in ROUTES:
        out = tmp_path / route
        assert _run(out, route, "a:300,b:40,c:25", "mid").returncode == -signal.SIGKILL
        raw = (out / "step2" / "rank0" / ".dump.journal").read_bytes()
        kept[route] = raw[:read_journal(raw)[1]]
    assert kept["c"] == kept["python"]


def test_a_process_killed_between_steps_leaves_a_spare_that_recover_removes(tmp_path):
    out = tmp_path / "dump"
    assert _run(out, ROUTES[-1], "a:30,b:20", "after").returncode == -signal.SIGKILL
    rank = out / "step1" / "rank0"
    assert [p.name for p in _left(out, ".*")] == [".dump.journal" + SPARE_SUFFIX]  # beside the finished dump.json
    written = (rank / "dump.json").read_bytes()
    assert recover(out) == []
    assert _left(out, ".*") == [] and (rank / "dump.json").read_bytes() == written


def test_a_normal_run_leaves_no_journal_or_spare(tmp_path):
    out = tmp_path / "dump"
    proc = _run(out, ROUTES[-1], "a:30,b:20,c:10", "none")
    assert proc.returncode == 0, proc.stderr
    assert _left(out, ".*") == []
    assert [list(json.loads((out / f"step{s}" / "rank0" / "dump.json").read_text())["data"])[-1]
            for s in range(3)] == ["Tensor.a.0029.forward", "Tensor.b.0019.forward", "Tensor.c.0009.forward"]


def test_the_dump_session_ends_without_a_spare(tmp_path):
    from msprobe_core.pytorch import PrecisionDebugger

    release_spares()
    out = tmp_path / "dump"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    dbg = PrecisionDebugger({"task": "statistics", "dump_path": str(out), "level": "L0", "step": [0, 1]})
    try:
        for step in range(3):
            dbg.start(model)
            model(torch.randn(2, 4)).sum().backward()
            dbg.stop()
            dbg.step()
            if step == 0:  # between two dumped steps: the spare is the next step's journal
                assert [p.name for p in _left(out, ".*")] == [".dump.journal" + SPARE_SUFFIX]
        assert _left(out, ".*") == [] and not journal_mod._SPARES  # the last configured step ended the session
    finally:
        from msprobe_core.common.exit_close import close_all
        close_all()
    assert sorted(p.name for p in out.iterdir()) == ["step0", "step1"]


def _frame(i: int) -> bytes:
    body = marshal.dumps(("x", i, "x" * (i % 50)))
    return len(body).to_bytes(4, "little") + body


def test_an_append_ends_the_journal_over_stale_bytes(tmp_path):
    release_spares()
    old = Journal.start(tmp_path / "a.journal", _frame(1))
    for i in range(2, 400):
        old.append(_frame(i))
    old.retire()
    assert journal_mod._SPARES == [old] and (tmp_path / ("a.journal" + SPARE_SUFFIX)).exists()
    new = Journal.start(tmp_path / "b.journal", _frame(9))
    assert new is old and not (tmp_path / ("a.journal" + SPARE_SUFFIX)).exists()
    for i in range(10, 20):
        raw = (tmp_path / "b.journal").read_bytes()
        assert raw[new._pos:new._pos + 4] == bytes(4) and raw[new._pos + 4:].strip(b"\0")  # the end, then stale bytes
        new.append(_frame(i))
    raw = (tmp_path / "b.journal").read_bytes()
    assert [e[1] for e in read_frames(raw)] == [9, *range(10, 20)] and read_journal(raw)[1] == new._pos
    new.retire()
    release_spares()
    assert list(tmp_path.iterdir()) == []


def test_a_spare_never_replaces_a_file(tmp_path):
    release_spares()
    Journal.start(tmp_path / "a.journal", _frame(1)).retire()
    (tmp_path / "b.journal").write_bytes(b"another run's")
    assert not journal_mod._SPARES.pop()._take_name(tmp_path / "b.journal", _frame(2))  # (dropped)
    assert (tmp_path / "b.journal").read_bytes() == b"another run's" and not journal_mod._SPARES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.journal"]


def test_a_reused_journal_that_cannot_grow_ends_at_its_last_frame(tmp_path, monkeypatch):
    release_spares()
    rec = StepRecorder(tmp_path / "step0", dict(HEADER))
    for i in range(2000):
        rec.put_text(f"Tensor.a.{i:04d}.forward", '{"output": []}', None)
    rec.finish()
    rec = StepRecorder(tmp_path / "step1", dict(HEADER))
    rec.put_text("Tensor.b.0.forward", "{}", None)
    size = rec._journal._size

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    n = 1
    while rec._journal._map is not None:  # appends into the map until it has no room, then plain writes
        rec.put_text(f"Tensor.b.{n}.forward", '{"output": [%s]}' % ("1.5, " * 200 + "1"), None)
        n += 1
    raw = rec.journal_path.read_bytes()
    assert len(raw) == rec._journal._pos > size and b"Tensor.a." not in raw  # the reused file's tail is cut off
    assert [e[1] for e in read_frames(raw)[1:]] == [f"Tensor.b.{i}.forward" for i in range(n)]
    monkeypatch.undo()
    rec.finish()
    release_spares()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_leaves_the_parents_spare_alone(tmp_path):
    release_spares()
    spare = Journal.start(tmp_path / "a.journal", _frame(1))
    spare.retire()
    pid = os.fork()
    if pid == 0:  # the child: ends as a normal exit would (its atexit release_spares runs)
        code = 0 if not journal_mod._SPARES else 1
        release_spares()
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert journal_mod._SPARES == [spare] and (tmp_path / ("a.journal" + SPARE_SUFFIX)).exists()
    assert Journal.start(tmp_path / "b.journal", _frame(2)) is spare and not journal_mod._SPARES
    spare.retire()
    release_spares()
