"""The kernel's parts of the journal (``stats/_fast_journal.c``): ``JournalLock`` (``StepRecorder``'s lock, taken by
the C ``put_text`` without a Python call) behaves as ``threading.Lock``; ``JournalBase`` holds ``Journal``'s map and
position; records journaled from several threads at once reach the journal whole and in the order each thread made
them, on either route."""

from __future__ import annotations

import mmap
import threading
import time

import pytest

from msprobe_core.files import step_recorder
from msprobe_core.files.journal import Journal, release_spares
from msprobe_core.files.step_recorder import StepRecorder, read_frames, read_journal
from msprobe_core.stats.kernel import KERNEL

pytestmark = pytest.mark.skipif(getattr(KERNEL, "JournalLock", None) is None,
                                reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")


def test_the_journal_lock_is_a_lock():
    lock = KERNEL.JournalLock()
    with pytest.raises(RuntimeError):
        lock.release()
    assert lock.acquire() is True
    got = []
    waiter = threading.Thread(target=lambda: got.append(lock.acquire()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # waits (the GIL released meanwhile: this thread runs)
    lock.release()
    waiter.join(5)
    assert got == [True]
    lock.release()
    with pytest.raises(ZeroDivisionError):
        with lock:
            1 / 0
    assert lock.acquire() is True  # released by ``with``, even on an error
    lock.release()
    with pytest.raises(TypeError):
        KERNEL.JournalLock(1)


def test_the_journal_lock_excludes_sections_that_let_the_gil_go():
    lock = KERNEL.JournalLock()
    state = {"n": 0, "inside": 0, "overlap": 0}

    def work():
        for _ in range(300):
            with lock:
                state["inside"] += 1
                state["overlap"] += state["inside"] > 1
                n = state["n"]
                time.sleep(0)  # the GIL goes to another thread, which must wait for the lock
                state["n"] = n + 1
                state["inside"] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert state == {"n": 1200, "inside": 0, "overlap": 0}


def test_put_text_waits_for_a_section_that_holds_the_lock(tmp_path):
    rec = StepRecorder(tmp_path, {"task": "statistics", "level": "L1"})
    rec.ensure_dir()
    before = rec._journal._pos
    with rec._journal_lock:  # (sync_journal's section, cut short)
        threads = [threading.Thread(target=rec.put_text, args=(f"Tensor.a.{i}.forward", "{}", None)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        assert all(t.is_alive() for t in threads) and rec._journal._pos == before  # all three wait
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert sorted(e[1] for e in read_frames(rec.journal_path.read_bytes())[1:]) == \
        [f"Tensor.a.{i}.forward" for i in range(3)]
    rec.finish()


def test_the_journal_base_holds_the_maps_buffer(tmp_path):
    journal = Journal(tmp_path / "j")
    assert isinstance(journal, KERNEL.JournalBase) and journal._map is None and journal._pos == 0
    journal.append(b"\5\0\0\0" + b"\xe9\0\0\0\0")  # (a frame of marshal's 0)
    m = journal._map
    assert journal._pos == 9 and journal._size == len(m) == Journal.first_size
    with pytest.raises(BufferError):  # its buffer is held while it is the journal's map
        m.close()
    journal._unmap()
    assert journal._map is None and m.closed
    journal._map = None
    with pytest.raises(TypeError):
        journal._map = 5
    journal._pos = 0
    journal.close()


@pytest.mark.parametrize("fast", [False, True], ids=["python", "c"])
def test_records_from_several_threads_reach_the_journal_whole_and_in_order(tmp_path, monkeypatch, fast):
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(step_recorder, "KERNEL", None)
        rec = StepRecorder(tmp_path, {"task": "statistics", "level": "L1"})
    assert (rec._text_journal is not None) == fast
    rec.ensure_dir()
    n = 3000

    def put(prefix):
        for i in range(n):
            rec.put_text(f"Tensor.{prefix}.{i}.forward", '{"output": [%d]}' % i, None)

    threads = [threading.Thread(target=put, args=(p,)) for p in "ab"]
    for t in threads:
        t.start()
    for i in range(300):  # fragments queued and synced meanwhile by this thread
        name = f"Tensor.c.{i}.forward"
        rec.put(name, {"output": [i]}, rec.reserve(name))
        rec.sync_journal()
    for t in threads:
        t.join()
    raw = rec.journal_path.read_bytes()
    frames = read_frames(raw)[1:]  # (after the header)
    assert not raw[read_journal(raw)[1]:].strip(b"\0")
    for prefix, count in (("a", n), ("b", n), ("c", 300)):
        assert [e[1] for e in frames if e[1].startswith(f"Tensor.{prefix}.")] == \
            [f"Tensor.{prefix}.{i}.forward" for i in range(count)]
    assert len(frames) == 2 * n + 300
    rec.finish()


def test_a_map_replaced_while_put_text_writes_is_written_through_append(tmp_path, monkeypatch):
    """The map grows (a new one) as ``put_text`` needs it: the frames go on at the same position."""
    release_spares()
    monkeypatch.setattr(Journal, "first_size", Journal.CHUNK)
    rec = StepRecorder(tmp_path, {"task": "statistics", "level": "L1"})
    rec.ensure_dir()
    first = rec._journal._map
    for i in range(20000):
        rec.put_text(f"Tensor.a.{i}.forward", '{"output": []}', None)
    assert rec._journal._map is not first and isinstance(rec._journal._map, mmap.mmap)
    frames = read_frames(rec.journal_path.read_bytes())
    assert [e[1] for e in frames[1:]] == [f"Tensor.a.{i}.forward" for i in range(20000)]
    rec.finish()
