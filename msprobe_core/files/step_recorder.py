"""One step of one rank: the records, their stacks and hierarchy, journaled as they arrive.

Every fragment (a finished forward record, one gradient of a backward record, a stack, a parent link) is
appended to ``.dump.journal`` in the rank folder the moment it is made, so a process killed mid-step
loses nothing already recorded: ``python -m msprobe_core recover DUMP_PATH`` rebuilds the JSON files from
the journal. ``finish()`` waits for pending tensor files, then writes dump.json, stack.json and
construct.json atomically (temporary file + rename) and retires the journal (``files/journal.py``: it becomes
this process's spare, the next step's journal).

The journal is a private file: length-prefixed ``marshal`` frames (10x cheaper to write than JSON on the
training thread); a frame torn by the crash is ignored. Recover with the same Python version.
"""

from __future__ import annotations

import itertools
import json
import marshal
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

from msprobe_core.files.atomic_write import write_all, write_fd_atomic
from msprobe_core.errors import DumpInputError
from msprobe_core.files.call_stack import CallStack, format_frame
from msprobe_core.files.json_text import encode as _encode
from msprobe_core.files.json_text import encode_string
from msprobe_core.files.journal import FRAME_LEN, Journal
from msprobe_core.files.safe_names import is_plain_file_name
from msprobe_core.stats.kernel import KERNEL

JOURNAL_SUFFIX = ".journal"
ERROR_LOG_NAME = "dump_error_info.log"
NO_PARENT = False
"""``put_text``'s parent when the dump keeps no construct.json (a parent is a record name or None)."""
TENSOR_DIR_NAME = "dump_tensor_data"

_LEN = FRAME_LEN
_pack_len = _LEN.pack
_marshal = marshal.dumps


def _key(k: Any) -> str:
    return encode_string(k) if type(k) is str else _encode(k)


def _record_text(v: Any) -> str:
    """A record of "data" as JSON text. Finished records are held as their JSON text itself, a plain ``str`` (a
    record is never a string: it is a dict or a list): the training process then holds one string per record
    instead of a tree of dicts and lists, and a string is no object Python's garbage collector tracks, so the
    records of a long step do not make its full collections (which scan the whole heap) more frequent."""
    if type(v) is str:
        return v
    return v.text() if type(v) is TextFields else _encode(v)


_FIELD_KEYS: dict[str, str] = {}  # a field name -> its JSON text and '": [' (a model's parameter names: 4,096 at most)


class TextFields(dict):
    """A record filling in over time whose values are JSON texts already made (``put_text_field``): field ->
    its slots (each a summary's text, or None until it arrives). ``expected``: the slots that make it complete
    (-1: never complete by count, it stays a ``TextFields`` until written)."""

    __slots__ = ("expected", "filled")

    def __init__(self, fields: dict[str, list], expected: int):
        super().__init__(fields)
        self.expected = expected
        self.filled = 0

    def text(self) -> str:
        """The record's JSON text, as ``encode`` writes the same record with its summaries as dicts."""
        parts = []
        for k, v in self.items():
            key = _FIELD_KEYS.get(k)
            if key is None:
                if len(_FIELD_KEYS) >= 4096:
                    _FIELD_KEYS.clear()
                key = _FIELD_KEYS[k] = encode_string(k) + ": ["
            parts.append(key + (", ".join(v) if None not in v else ", ".join(["null" if t is None else t for t in v]))
                         + "]")
        return "{" + ", ".join(parts) + "}"

    def skeleton(self) -> dict[str, list]:
        """The record before any field arrived, for the journal (recovery starts from it)."""
        return {k: [None] * len(v) for k, v in self.items()}

    def as_dict(self) -> dict[str, list]:
        """The record as dicts and lists (for the routes that edit records so: ``put_field``)."""
        return json.loads(self.text())


def _stack_text(stack: CallStack) -> str:
    return stack.json_text(_encode)


_write_lines = getattr(KERNEL, "write_lines", None)
"""The compiled ``_Section.write`` (``stats/_fast_files.c``): the same bytes, written from the records' strs
themselves; False (nothing written) where the Python route must write them."""

TextOf = Optional[Callable[[Any], str]]
"""A value's JSON text (values that are None have no line); None: values are strings or None, encoded."""


class _Section(NamedTuple):
    """A by-line JSON file: ``head``, the lines of ``entries`` (``indent + "name": value``, joined by ",\n"),
    ``tail``; ``empty`` instead of all three when there is no line."""

    head: str
    entries: dict
    text: TextOf
    indent: str
    tail: str
    empty: str

    @staticmethod
    def of(obj: Any) -> "_Section":
        """``obj`` as ``dumps_by_line`` lays it out: one line per top-level entry, and per record of "data"."""
        if not isinstance(obj, dict):
            return _Section("", {}, None, "", "", _encode(obj))
        before, after = [], None
        data: dict = {}
        for key, value in obj.items():
            if key == "data" and isinstance(value, dict):
                data, after = value, []
                continue
            (before if after is None else after).append(f" {_encode(key)}: {_encode(value)}")
        if after is None:
            return _Section("", {}, None, "", "", "{\n" + ",\n".join(before) + "\n}\n")
        return _Section("{\n" + "".join(f"{p},\n" for p in before) + ' "data": {\n', data, _record_text, "  ",
                        "\n }" + "".join(f",\n{p}" for p in after) + "\n}\n",
                        "{\n" + ",\n".join([*before, ' "data": {}', *after]) + "\n}\n")

    @staticmethod
    def flat(entries: dict, text: TextOf) -> "_Section":
        """A flat mapping of names to values, one line each (stack.json, construct.json)."""
        return _Section("{\n", entries, text, " ", "\n}\n", "{\n\n}\n")

    def lines(self) -> str:
        """The lines of ``entries``, joined (the Python route)."""
        parts = []
        add = parts.extend
        indent, text = self.indent, self.text
        if text is None:
            for k, v in self.entries.items():  # pieces joined once: no string per entry
                add((indent, _key(k), ": ", _encode(v), ",\n"))
        else:
            for k, v in self.entries.items():
                if v is not None:
                    add((indent, _key(k), ": ", text(v), ",\n"))
        if parts:
            parts.pop()
        return "".join(parts)

    def text_of(self) -> str:
        lines = self.lines()
        return self.head + lines + self.tail if lines else self.empty

    def write(self, fd: int) -> None:
        """The file as UTF-8 (a lone surrogate as its JSON escape: ``\\ud800`` reads back as the same string)."""
        if _write_lines is None or not _write_lines(fd, _utf8(self.head), self.entries, self.indent, self.text,
                                                    _utf8(self.tail), _utf8(self.empty)):
            write_all(fd, _utf8(self.text_of()))


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "backslashreplace")


def dumps_by_line(obj: Any) -> str:
    """JSON with one line per entry of the top level and of its "data" object: as readable as an
    indented file for a person scrolling records, and written by the C encoder (10x faster). A record that
    is None in "data" (a name reserved whose record never came) is left out."""
    return _Section.of(obj).text_of()


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON (one line per record: ``dumps_by_line``) to ``path`` atomically. A lone
    surrogate in a name (no UTF-8 for it) is written as its JSON escape (``\\ud800``), which reads back as the
    same string."""
    write_fd_atomic(path, _Section.of(obj).write)


def write_lines_atomic(path: Path, entries: dict, text: TextOf = None) -> None:
    """Write a flat mapping of names to values (``text``: see ``TextOf``) as ``write_json_atomic`` writes it
    (one line per name: stack.json, construct.json), atomically."""
    write_fd_atomic(path, _Section.flat(entries, text).write)


class StepRecorder:
    """Records of one (step, rank) folder, made by the training thread (and autograd's threads while it
    waits in backward). Journaling is thread-safe: fragments queued by any thread reach the journal whole
    and in the order they were queued; tensor files are the caller's (``TensorFiles``)."""

    def __init__(self, rank_dir: Path, header: dict[str, Any], json_name: str = "dump.json", journal: bool = True):
        self.rank_dir = rank_dir
        self.header = header
        self.json_name = json_name
        self.data: dict[str, Any] = {}
        self.stack: dict[str, CallStack] = {}
        self._journaled_stacks: set[int] = set()
        self.construct: dict[str, Optional[str]] = {}
        self._seq = itertools.count()  # next() is atomic: two threads never get one number
        maker = getattr(KERNEL, "TextJournal", None) if journal else None
        self._journal_lock = threading.Lock() if maker is None else KERNEL.JournalLock()  # (taken in C by put_text)
        self._journal_enabled = journal
        self._journal: Optional[Journal] = None
        self._queued: list[tuple] = []
        self._dir_ready = False
        self.errors = 0
        self._changes = 0     # fragments recorded so far by the Python routes
        self._written = -1    # ``_change_count()`` when the JSON files were last written
        self._text_journal = maker(self, Journal.append, TextFields, StepRecorder.put_text_field, _FIELD_KEYS) \
            if maker is not None else None
        if self._text_journal is not None:  # one C call each: the same stores, frames and lock
            self.put_text = self._text_journal.put_text
            self.put_text_field = self._text_journal.put_text_field
            if type(self).reserve is _PY_RESERVE:  # (not where a subclass or a test's patch has its own)
                self.reserve = self._text_journal.reserve

    def _change_count(self) -> int:
        """Fragments recorded so far (the C ``put_text``'s included)."""
        return self._changes + (self._text_journal.count if self._text_journal is not None else 0)

    # ---------------------------------------------------------------- folder
    def ensure_dir(self) -> None:
        if self._dir_ready:
            return
        with self._journal_lock:
            if self._dir_ready:  # another thread made it meanwhile
                return
            self.rank_dir.mkdir(parents=True, exist_ok=True)
            if self._journal_enabled:  # (a full disk: no empty journal is left; the next record tries again)
                body = marshal.dumps(("h", self.header, self.json_name))
                self._use_journal(Journal.start(self.journal_path, _LEN.pack(len(body)) + body))
            self._dir_ready = True

    @property
    def journal_path(self) -> Path:
        """``.dump.journal`` for dump.json, ``.debug.journal`` for debug.json."""
        return self.rank_dir / f".{Path(self.json_name).stem}{JOURNAL_SUFFIX}"

    @property
    def tensor_dir(self) -> Path:
        return self.rank_dir / TENSOR_DIR_NAME

    def _append(self, entry: tuple) -> None:
        # Entries hold live objects whose statistics may still be on the device; sync_journal() writes them.
        self._changes += 1
        if self._journal is not None:
            self._queued.append(entry)

    def sync_journal(self) -> None:
        """Append every queued fragment to the journal in one write (call after statistics are resolved)."""
        pending = self._queued
        if not pending or self._journal is None:
            return
        with self._journal_lock:  # one writer at a time, frames in queue order
            queued = pending[:]
            del pending[:len(queued)]  # what another thread queues meanwhile stays for the next sync
            frames = []
            add = frames.append
            data = self.data
            for i, e in enumerate(queued):
                if e[0] == "Z":  # a record filled in over time is complete: held as its JSON text from now on
                    record = data.get(e[1])
                    if record is not None and type(record) is not str:
                        data[e[1]] = _record_text(record)
                    continue
                if e[0] == "R":  # a finished record: from now on held (and journaled) as its JSON text
                    name, record = e[1], e[3]
                    text = _encode(record)
                    if data.get(name) is record:
                        data[name] = text
                    e = queued[i] = ("j", name, e[2], text)
                body = _marshal(e)
                add(_pack_len(len(body)))
                add(body)
            if frames and self._journal is not None:  # (none: other threads took the fragments, or all were "Z")
                try:
                    self._journal.append(b"".join(frames))
                except OSError:  # a full disk: the fragments wait for the next sync, in order
                    pending[0:0] = queued
                    raise

    # ---------------------------------------------------------------- records
    def reserve(self, name: str, stack: Optional[CallStack] = None) -> int:
        """Keep ``name``'s place in execution order (and its ``stack``'s in stack.json, journaled with the
        record by ``put_text``); returns its sequence number. With the kernel, the instance's ``reserve`` is
        ``TextJournal.reserve``: this in C."""
        if not self._dir_ready:
            self.ensure_dir()
        seq = next(self._seq)
        self.data.setdefault(name, None)
        if stack is not None:
            self.stack[name] = stack
        return seq

    def put(self, name: str, record: Any, seq: int) -> None:
        """Store a complete record (e.g. a finished forward call) and journal it."""
        self.data[name] = record
        self._append(("R", name, seq, record))

    def put_text(self, name: str, text: str, seq: Optional[int], stack: Optional[CallStack] = None,
                 parent: Any = NO_PARENT) -> None:
        """Store a complete record given as its JSON ``text`` (nothing in it waits for statistics), with its
        ``stack`` and construct.json ``parent`` (``NO_PARENT``: none kept), and journal all of it now in one
        frame (after any fragments still queued, in order). ``seq`` None: the record takes its place in
        execution order now (``reserve`` and ``put_text`` in one, for a call nothing was recorded during).
        With the kernel, the instance's ``put_text`` is ``TextJournal.put_text``: this in C, the same bytes."""
        if seq is None:
            if not self._dir_ready:
                self.ensure_dir()
            seq = next(self._seq)
        self.data[name] = text
        if parent is not NO_PARENT:
            self.construct[name] = parent
        self._changes += 1
        sid = -1
        new_stack = None
        if stack is not None:
            self.stack[name] = stack
            sid = stack.sid
            if sid not in self._journaled_stacks and self._journal is not None:
                self._journaled_stacks.add(sid)
                new_stack = ("S", sid, list(stack.frames))
        if self._journal is None:
            return
        record = ("J", name, seq, text, sid, parent)
        body = _marshal(record)
        frame = _pack_len(len(body)) + body
        if new_stack is None:
            self._journal_now((record,), frame)
        else:  # the stack's frame first (once per distinct stack)
            head = _marshal(new_stack)
            self._journal_now((new_stack, record), _pack_len(len(head)) + head + frame)

    def put_field(self, name: str, path: Sequence[Any], value: Any, skeleton: Callable[[], Any]) -> Any:
        """Set one field of a record that fills in over time (backward grads, parameter grads); returns the
        record (``seal`` it once complete)."""
        record = self.data.get(name)
        if type(record) is str:  # sealed, and a field comes again (a second backward over the same graph)
            record = self.data[name] = json.loads(record)
        elif type(record) is TextFields:  # a field whose summary is not known at once (device statistics)
            record = self.data[name] = record.as_dict()
        if record is None:
            record = skeleton()
            seq = self.reserve(name)
            self.data[name] = record
            self._append(("r", name, seq, record))
        if len(path) == 2 and type(record) is dict:  # a field of a record's top level: the usual case
            target = record.setdefault(path[0], [] if isinstance(path[1], int) else {})
        else:
            target = _descend(record, path)
        last = path[-1]
        if isinstance(target, list) and isinstance(last, int):
            while len(target) <= last:
                target.append(None)
        target[last] = value
        self._append(("f", name, list(path), value))
        return record

    def put_text_field(self, name: str, field: str, index: int, text: str, fields: Callable[[Any], TextFields],
                       arg: Any, parent: Any = NO_PARENT) -> bool:
        """Set slot ``index`` of ``field`` of a record that fills in over time (backward and parameter
        gradients) to a summary given as its JSON ``text``; ``fields(arg)`` makes the record at its first field,
        with its construct.json ``parent`` (``NO_PARENT``: none kept). Journaled now, in one frame per field
        (after any fragments still queued, in order): a crash loses no field already set. Complete (every
        expected slot set), the record is held as its JSON text. A record that is not a ``TextFields`` (made
        by ``put_field``, or complete and set again by a second backward) takes the field through ``put_field``:
        then True is returned, and the fragments wait for ``sync_journal``. With the kernel, the instance's
        ``put_text_field`` is ``TextJournal.put_text_field``: this in C, the same bytes (this method for a record
        that is not a ``TextFields``)."""
        record = self.data.get(name)
        skeleton = None
        if record is None:
            record = fields(arg)
            seq = self.reserve(name)
            self.data[name] = record
            skeleton = record.skeleton()
            if parent is not NO_PARENT:
                self.construct[name] = parent
        elif type(record) is not TextFields:
            self.put_field(name, [field, index], json.loads(text), dict)  # (the record is there: no skeleton)
            return True
        else:
            seq, parent = -1, NO_PARENT
        slots = record.get(field)
        if slots is None:  # a field the record was not made with (a parameter's): its slots are counted
            slots = record[field] = [None] * (index + 1)
        elif index >= len(slots):
            slots.extend([None] * (index + 1 - len(slots)))
            record.expected = -1  # a slot the record was not made with: no count says it is complete
        if slots[index] is None:
            record.filled += 1
        slots[index] = text
        if record.filled == record.expected:
            self.data[name] = record.text()
        self._changes += 1
        if self._journal is not None:
            entry = ("t", name, seq, skeleton, field, index, text, parent)
            body = _marshal(entry)
            self._journal_now((entry,), _pack_len(len(body)) + body)
        return False

    def _journal_now(self, entries: Sequence[tuple], frame: bytes) -> None:
        """Journal ``entries`` (their frames: ``frame``) now, behind any fragments still queued (they wait for
        statistics)."""
        with self._journal_lock:
            if self._journal is None:  # finished meanwhile
                return
            if self._queued:  # earlier fragments wait for their statistics: these go behind them
                self._queued.extend(entries)
                return
            try:
                self._journal.append(frame)
            except OSError:  # a full disk: the fragments wait for the next sync, in order
                self._queued.extend(entries)
                raise

    def seal(self, name: str) -> None:
        """``name``'s record (filled in by ``put_field``) is complete: from the next ``sync_journal`` on (its
        statistics are then resolved) it is held as its JSON text, like a record given to ``put``. Nothing
        is journaled for it."""
        if self._journal is not None:
            self._queued.append(("Z", name))

    def put_stack(self, name: str, stack: CallStack) -> None:
        """``name``'s call stack (journaled once per distinct stack, then by its id)."""
        self.stack[name] = stack
        if stack.sid not in self._journaled_stacks:
            self._journaled_stacks.add(stack.sid)
            self._append(("S", stack.sid, list(stack.frames)))
        self._append(("s", name, stack.sid))

    def put_parent(self, name: str, parent: Optional[str]) -> None:
        self.construct[name] = parent
        self._append(("c", name, parent))

    def log_error(self, message: str) -> None:
        """Append a line to dump_error_info.log (created only when something goes wrong)."""
        self.errors += 1
        try:
            self.rank_dir.mkdir(parents=True, exist_ok=True)
            with open(self.rank_dir / ERROR_LOG_NAME, "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
        except OSError:
            pass

    # ---------------------------------------------------------------- finishing
    @property
    def has_content(self) -> bool:
        return self._dir_ready

    def write_files(self) -> None:
        """Write the JSON files for what is recorded so far (atomic); the journal stays. Files already
        written with every record (at the dump's stop()) are not written again."""
        if not self._dir_ready or self._written == self._change_count():
            return
        self.sync_journal()
        doc = dict(self.header)
        doc["data"] = self.data  # (names reserved whose record never came, None, are left out)
        write_json_atomic(self.rank_dir / self.json_name, doc)
        if self.json_name == "dump.json":
            write_lines_atomic(self.rank_dir / "stack.json", self.stack, _stack_text)
            write_lines_atomic(self.rank_dir / "construct.json", self.construct)
        self._written = self._change_count()

    def finish(self) -> None:
        """Write the JSON files and drop the journal; the folder is then a finished dump. When they cannot
        be written (a full disk: the ``OSError`` is raised), the journal is closed and kept for ``recover``."""
        try:
            self.write_files()
        except BaseException:
            journal = self._end_journal()
            if journal is not None:
                journal.close()
            raise
        journal = self._end_journal()
        if journal is not None:
            journal.retire()  # (this process's spare: the next step's journal is the same file)
        else:
            try:
                os.unlink(self.journal_path)
            except FileNotFoundError:
                pass

    def _end_journal(self) -> Optional[Journal]:
        """The journal, which this recorder no longer writes."""
        with self._journal_lock:
            journal = self._journal
            self._use_journal(None)
        return journal

    def _use_journal(self, journal: Optional[Journal]) -> None:
        """Write ``journal`` from now on (None: none); the caller holds the journal lock."""
        self._journal = journal
        if self._text_journal is not None:
            self._text_journal.journal = journal

    def set_header(self, key: str, value: Any) -> None:
        """Add a field to the JSON file's header (written with the next ``write_files``/``finish``)."""
        self.header[key] = value
        self._changes += 1

    def drop_missing_files(self) -> int:
        """Remove the ``data_name`` of every tensor file that is not in the tensor folder (its write
        failed), so that no record names a file that is not there; returns how many. The header then
        counts them (``lost_tensor_files``)."""
        lost = 0
        for name, record in self.data.items():
            encoded = type(record) is str
            if encoded and '"data_name"' not in record:
                continue
            value = json.loads(record) if encoded else record
            dropped = _drop_missing_files(value, self.tensor_dir)
            if dropped and encoded:
                self.data[name] = _encode(value)
            lost += dropped
        if lost:
            self.set_header("lost_tensor_files", self.header.get("lost_tensor_files", 0) + lost)
        return lost


_PY_RESERVE = StepRecorder.reserve


def _descend(record: Any, path: Sequence[Any]) -> Any:
    """The container that holds ``path[-1]``, creating missing lists/dicts on the way."""
    target = record
    for key, nxt in zip(path[:-1], path[1:]):
        fresh: Any = [] if isinstance(nxt, int) else {}
        if isinstance(target, dict):
            target = target.setdefault(key, fresh)
        else:
            while len(target) <= key:
                target.append(None)
            if target[key] is None:
                target[key] = fresh
            target = target[key]
    return target


# ------------------------------------------------------------------------------------------- recovery
JSON_NAMES = ("dump.json", "debug.json")
_ENTRY_SIZES = {"h": 3, "r": 4, "j": 4, "J": 6, "f": 4, "t": 8, "S": 3, "s": 3, "c": 3}


def read_journal(raw: bytes) -> tuple[list[tuple], int]:
    """The journal's entries and the offset where reading stopped: a zero length is the journal's end (what
    follows it is unused, a frame the crash cut short, or a previous step's frames: ``files/journal.py``); a frame
    that cannot be read ends the list too."""
    entries = []
    pos, n = 0, len(raw)
    while pos + _LEN.size <= n:
        (size,) = _LEN.unpack_from(raw, pos)
        start, end = pos + _LEN.size, pos + _LEN.size + size
        if end > n or size == 0:
            break
        try:
            entries.append(marshal.loads(raw[start:end]))
        except (ValueError, EOFError, TypeError):
            break
        pos = end
    return entries, pos


def read_frames(raw: bytes) -> list[tuple]:
    """The journal's entries; a frame cut short by the crash (or unreadable) ends the list."""
    return read_journal(raw)[0]


class Replay:
    """What a journal rebuilds: header, JSON file name, records, stacks, hierarchy, and how many of its
    entries were damaged (not tuples of a known kind and shape: skipped, never guessed at)."""

    def __init__(self) -> None:
        self.header: Optional[dict[str, Any]] = None
        self.json_name = "dump.json"
        self.data: dict[str, Any] = {}
        self.order: dict[str, int] = {}
        self.stack: dict[str, list] = {}
        self.stacks: dict[int, list] = {}
        self.construct: dict[str, Any] = {}
        self.damaged = 0

    def apply(self, e: Any) -> None:
        if type(e) is not tuple or not e or _ENTRY_SIZES.get(e[0]) != len(e) or (e[0] != "S" and e[0] != "h"
                                                                                 and not isinstance(e[1], str)):
            self.damaged += 1
            return
        try:
            self._apply(e)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            self.damaged += 1

    def _apply(self, e: tuple) -> None:
        k = e[0]
        if k == "h":
            if not isinstance(e[1], dict) or e[2] not in JSON_NAMES:
                raise ValueError("not a header")
            self.header, self.json_name = e[1], e[2]
        elif k in ("r", "j"):
            self.data[e[1]] = json.loads(e[3]) if k == "j" else e[3]
            self.order.setdefault(e[1], int(e[2]))
        elif k == "J":  # a record as JSON text, its stack id (-1: none) and parent (NO_PARENT: none kept)
            self.data[e[1]] = json.loads(e[3])
            self.order.setdefault(e[1], int(e[2]))
            if e[4] >= 0:
                self.stack[e[1]] = self.stacks.get(e[4], [])
            if e[5] is not NO_PARENT:
                self.construct[e[1]] = e[5] if e[5] is None or isinstance(e[5], str) else str(e[5])
        elif k == "f":
            path = e[2]
            if not isinstance(path, list) or not path:
                raise ValueError("not a field path")
            target = _descend(self.data.setdefault(e[1], {}), path)
            last = path[-1]
            if isinstance(target, list):
                while len(target) <= last:
                    target.append(None)
            target[last] = e[3]
        elif k == "t":  # a field given as JSON text; the record's first one holds its skeleton, seq and parent
            _, name, seq, skeleton, field, index, text, parent = e
            record = self.data.get(name)
            if not isinstance(record, dict):
                record = self.data[name] = skeleton if isinstance(skeleton, dict) else {}
            if seq >= 0:
                self.order.setdefault(name, int(seq))
            if parent is not NO_PARENT:
                self.construct[name] = parent if parent is None or isinstance(parent, str) else str(parent)
            target = _descend(record, [field, index])
            while len(target) <= index:
                target.append(None)
            target[index] = json.loads(text)
        elif k == "S":
            self.stacks[e[1]] = [tuple(f) for f in e[2] if len(f) == 3]
        elif k == "s":
            self.stack[e[1]] = self.stacks.get(e[2], []) if isinstance(e[2], int) else list(e[2])
        elif k == "c":
            self.construct[e[1]] = e[2] if e[2] is None or isinstance(e[2], str) else str(e[2])

    def ordered_data(self) -> dict[str, Any]:
        return dict(sorted(self.data.items(), key=lambda kv: self.order.get(kv[0], 1 << 62)))


def replay_journal(entries: Iterable[tuple]) -> tuple[dict[str, Any], str, dict, dict, dict]:
    """Rebuild (header, json_name, data, stack, construct) from journal entries (damaged ones skipped)."""
    replay = Replay()
    for e in entries:
        replay.apply(e)
    return replay.header or {}, replay.json_name, replay.ordered_data(), replay.stack, replay.construct


def _drop_missing_files(obj: Any, tensor_dir: Path) -> int:
    """Tensor files still in the writer queue when the process died (or names that are no file of the
    tensor folder): drop their ``data_name``."""
    lost = 0
    if isinstance(obj, dict):
        name = obj.get("data_name")
        if name is not None and (not is_plain_file_name(name) or not (tensor_dir / name).exists()):
            del obj["data_name"]
            lost += 1
        for v in obj.values():
            lost += _drop_missing_files(v, tensor_dir)
    elif isinstance(obj, list):
        for v in obj:
            lost += _drop_missing_files(v, tensor_dir)
    return lost


def _frame_lines(frames: list) -> list[str]:
    """stack.json lines of a journaled stack; frames of a damaged journal that are not (file, line,
    function) are left out."""
    lines = []
    for f in frames:
        try:
            lines.append(format_frame(tuple(f)))
        except (TypeError, ValueError):
            pass
    return lines


def recover_journal(journal: Path) -> bool:
    """Rebuild the JSON files of a rank folder from one of its journals. Returns False when it is gone.

    Entries a damaged journal holds in a wrong shape are skipped and counted (``damaged_journal_entries``
    in the rebuilt file, which is always marked ``"recovered": true``); a journal that cannot be read, or
    holds no header of this tool, is a ``DumpInputError`` naming it and nothing is written."""
    rank_dir = journal.parent
    if not journal.exists():
        return False
    try:
        raw = journal.read_bytes()
    except OSError as e:
        raise DumpInputError(f"journal '{journal}' cannot be read: {e.strerror or e}") from None
    entries, stop = read_journal(raw)
    replay = Replay()
    for e in entries:
        replay.apply(e)
    if replay.header is None:
        raise DumpInputError(f"'{journal}' is not a dump journal of this tool (no readable header with "
                             f"dump.json or debug.json as its file): nothing was recovered from it")
    if raw[stop:stop + _LEN.size].strip(b"\0"):  # reading stopped at a frame that cannot be read, not at the end
        replay.damaged += 1  # (a zero length; what follows it is unused, a frame cut short or a previous step's)
    for leftover in [*rank_dir.glob(".*.tmp"), *(rank_dir / TENSOR_DIR_NAME).glob("*.tmp")]:
        leftover.unlink()  # files the process was writing when it died
    data = replay.ordered_data()
    lost = _drop_missing_files(data, rank_dir / TENSOR_DIR_NAME)
    doc = dict(replay.header)
    doc["data"] = data
    doc["recovered"] = True
    if lost:
        doc["lost_tensor_files"] = lost
    if replay.damaged:
        doc["damaged_journal_entries"] = replay.damaged
    write_json_atomic(rank_dir / replay.json_name, doc)
    if replay.json_name == "dump.json":
        write_lines_atomic(rank_dir / "stack.json", {k: _frame_lines(v) for k, v in replay.stack.items()}, _encode)
        write_lines_atomic(rank_dir / "construct.json", replay.construct)
    journal.unlink()
    return True
