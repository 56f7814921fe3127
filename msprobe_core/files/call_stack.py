"""Call stacks of records (stack.json), captured cheaply and shared.

The same call site is reached every step with the same stack, so stacks are interned: ``capture_stack``
walks the caller's frames reading only each frame's code object and instruction offset, looks that key up,
and returns the one ``CallStack`` already made for it. Line numbers, filtering and formatting happen once
per distinct stack, and its stack.json text is encoded once for the whole run.
"""

from __future__ import annotations

import linecache
import sys
from typing import Any, Callable, Optional

from msprobe_core.stats.kernel import KERNEL

Frame = tuple[str, int, str]
_frame_key = getattr(KERNEL, "frame_key", None)
"""The compiled walk over the frames (``stats/_fast_stats.c``): each frame's code address and offset as bytes;
None without the kernel (the same key is then built here, as a tuple)."""

_MAX_STACKS = 200_000  # distinct call stacks kept; beyond this, stacks are built without interning


class CallStack:
    """One distinct call stack: ``frames`` (filename, line, function) outermost first, and a run-wide id."""

    __slots__ = ("sid", "frames", "_lines", "_json")

    def __init__(self, sid: int, frames: tuple[Frame, ...]):
        self.sid = sid
        self.frames = frames
        self._lines: Optional[list[str]] = None
        self._json: Optional[str] = None

    @property
    def lines(self) -> list[str]:
        """The stack as msprobe's stack.json lists it."""
        if self._lines is None:
            self._lines = [format_frame(f) for f in self.frames]
        return self._lines

    def json_text(self, encode: Callable[[Any], str]) -> str:
        """``lines`` encoded as JSON (once)."""
        if self._json is None:
            self._json = encode(self.lines)
        return self._json


_formatted: dict[tuple, str] = {}


def format_frame(frame: Frame) -> str:
    """A stack line in msprobe's stack.json style (cached: the same frames recur in every step)."""
    frame = tuple(frame)
    line = _formatted.get(frame)
    if line is None:
        filename, lineno, func = frame
        code = linecache.getline(filename, lineno).strip()
        line = _formatted[frame] = f"File {filename}, line {lineno}, in {func}, \n {code}"
    return line


class StackCapture:
    """Captures interned call stacks, leaving out frames whose file path starts with one of ``skip_dirs``
    or ends with one of ``skip_suffixes`` (the toolkit's own frames, torch.nn's hook plumbing)."""

    def __init__(self, skip_dirs: tuple[str, ...], skip_suffixes: tuple[str, ...]):
        self._skip_dirs = skip_dirs
        self._skip_suffixes = skip_suffixes
        self._keep: dict[int, tuple[Any, bool]] = {}  # id(code) -> (code, kept?)
        # key (code ids and offsets) -> CallStack; the codes are held in _keep, so their ids stay unique
        self._interned: dict[tuple, CallStack] = {}
        self._made = 0

    @property
    def interned(self) -> dict:
        """The stacks made so far by key (``frame_key``'s bytes): a compiled caller looks its key up here and
        calls ``capture`` only when it is missing (``stats/_fast_api.c``)."""
        return self._interned

    def capture(self, depth: int = 2) -> CallStack:
        """The stack of the caller ``depth`` frames up (2: the caller of the function that calls this)."""
        if _frame_key is not None:
            k: Any = _frame_key(depth)
        else:
            f = sys._getframe(depth)
            key = []
            append = key.append
            while f is not None:
                append(id(f.f_code))
                append(f.f_lasti)
                f = f.f_back
            k = tuple(key)
        stack = self._interned.get(k)
        if stack is None:
            stack = self._build(sys._getframe(depth))
            if len(self._interned) < _MAX_STACKS:
                self._interned[k] = stack
        return stack

    def _build(self, f) -> CallStack:
        frames = []
        keep = self._keep
        while f is not None:
            code = f.f_code
            # by id: a code object hashes its constants, and torch.compile's generated code holds slices
            # (unhashable before Python 3.12); the code is kept in the entry, so its id stays unique
            entry = keep.get(id(code))
            if entry is None:
                fn = code.co_filename
                entry = keep[id(code)] = (code, not fn.startswith(self._skip_dirs) and not fn.endswith(self._skip_suffixes))
            kept = entry[1]
            if kept:
                frames.append((code.co_filename, f.f_lineno, code.co_name))
            f = f.f_back
        frames.reverse()
        self._made += 1
        return CallStack(self._made, tuple(frames))

