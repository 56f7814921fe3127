"""File names made from names users choose: one sanitiser for every file the toolkit names after a record.

Record names carry names that come from users (``save()`` names, ``module_dump`` names, custom API prefixes,
a module's own attribute path, the keys of a saved dict), and tensor files are named after records
(``dump_tensor_data/{record}.{path}.pt``). ``safe_file_name`` turns such a name into one file name that
stays inside its folder, whatever the name holds:

- ``/``, ``\\``, NUL, control characters and ``%`` itself are escaped as ``%XX`` (the UTF-8 bytes in hex,
  as in URLs), so a name with path separators or ``..`` is one file in the folder, never a path out of
  it, and two different names never share a file;
- a name that is only dots (``.``, ``..``) has its dots escaped;
- where Python names files in ASCII (the C locale with UTF-8 mode off), non-ASCII characters are escaped too;
- a name longer than the file system allows (``NAME_MAX``, 255 bytes on Linux file systems, less the room
  the atomic writers need for their temporary names) is cut and ends with ``~`` and 16 hex digits of
  its SHA-1, before its suffix (``.pt``, ``.npy``), which is kept.

The record in dump.json keeps the name as given; its ``data_name`` is the safe file name. Readers of dumps
use ``is_plain_file_name`` to refuse a ``data_name`` (from a damaged or hostile dump.json) that would
reach outside the tensor folder.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sys
from typing import Optional

NAME_MAX = 255
# room for the temporary names the atomic writers use beside the file (``{name}.tmp``,
# ``.{name}.{pid}.tmp``): a name that fits NAME_MAX must still fit while it is being written
TEMP_ROOM = 24
_ESCAPED = frozenset("/\\%")
_HASH_DIGITS = 16
_name_max: dict[str, int] = {}


def name_max(folder: Optional[str | os.PathLike] = None) -> int:
    """The longest file name (bytes) the file system of ``folder`` (or its nearest existing parent) takes."""
    if folder is None:
        return NAME_MAX
    key = os.fspath(folder)
    found = _name_max.get(key)
    if found is None:
        probe = key
        while probe and not os.path.isdir(probe):
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        try:
            found = int(os.pathconf(probe or ".", "PC_NAME_MAX"))
        except (OSError, ValueError):
            found = NAME_MAX
        found = max(64, min(found, NAME_MAX))
        _name_max[key] = found
    return found


_ASCII_FILE_NAMES = codecs.lookup(sys.getfilesystemencoding()).name == "ascii"
"""Python names files in ASCII (the C locale with UTF-8 mode off): a non-ASCII character cannot be in a file
name at all then, so it is escaped too (readers follow ``data_name``, so they find the file either way)."""


def _needs_escape(c: str) -> bool:
    """Separators, ``%``, control characters (C0, DEL, C1) and lone surrogates (no file system takes them);
    every non-ASCII character where file names are ASCII."""
    code = ord(c)
    return (c in _ESCAPED or code < 0x20 or 0x7F <= code < 0xA0 or 0xD800 <= code < 0xE000
            or (_ASCII_FILE_NAMES and code > 0x7F))


def safe_file_name(name: str, suffix: str = "", limit: int = NAME_MAX) -> str:
    """``name + suffix`` as a single file name that stays in its folder (see the module docstring).

    ``suffix`` (``.pt``) is kept as is; ``limit`` is the file system's ``NAME_MAX`` (``name_max(folder)``).
    A name that needs none of it (the usual record name) is returned unchanged, after a few C-speed
    checks."""
    full = name + suffix
    budget = limit - TEMP_ROOM
    if (full.isascii() and full.isprintable() and len(full) <= budget and "/" not in full and "\\" not in full
            and "%" not in full and full.strip(".")):
        return full
    escaped = "".join(("".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass")) if _needs_escape(c) else c)
                      for c in name)
    if not escaped.strip("."):  # "", ".", "..": never a name of the folder itself or its parent
        escaped = escaped.replace(".", "%2E") or "%"  # a lone "%" is no other name's escape
    out = escaped + suffix
    if len(out.encode("utf-8", "surrogatepass")) <= budget:
        return out
    digest = hashlib.sha1(full.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_DIGITS]
    tail = f"~{digest}{suffix}".encode()
    head = escaped.encode("utf-8", "surrogatepass")[:max(0, budget - len(tail))]
    return head.decode("utf-8", "ignore") + tail.decode()


def is_plain_file_name(name: object) -> bool:
    """Is ``name`` one file name inside a folder (no separator, not ``.``/``..``, no NUL): what a dump's
    ``data_name`` must be before a reader joins it to the tensor folder."""
    return (isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\x00" not in name and not os.path.isabs(name))
