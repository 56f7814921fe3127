"""JSON text exactly as the dump's files hold it, made without building the value first.

``encode`` is the one C encoder of the run (``", "`` and ``": "`` separators, non-ASCII as is, NaN and
Infinity allowed): records, stacks and hierarchy are written with it. The helpers below build the same
text from pieces already encoded (a record from the cached text of its tensors' summaries), so that a
record costs no tree of dicts and lists and no second walk to encode it.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

_c_encoder = json.encoder.c_make_encoder
encode_string = json.encoder.encode_basestring
"""A ``str`` as its JSON text (quoted and escaped, non-ASCII as is)."""

if _c_encoder is not None:  # one C encoder for the whole run (JSONEncoder.encode builds one per call)
    _c_encode = _c_encoder(None, None, encode_string, None, ": ", ", ", False, False, True)

    def encode(obj: Any) -> str:
        """``obj`` as JSON text, as ``json.dumps(obj, ensure_ascii=False)`` writes it."""
        if type(obj) is str:
            return encode_string(obj)
        return "".join(_c_encode(obj, 0))
else:  # pragma: no cover - CPython always has the C encoder
    encode = json.JSONEncoder(ensure_ascii=False).encode

_SPECIAL = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def number(v: float) -> str:
    """A float as ``encode`` writes it (its ``repr``; NaN and the infinities as JavaScript names them)."""
    text = float.__repr__(v)
    return _SPECIAL.get(text, text)


def array(items: Iterable[str]) -> str:
    """A JSON array of items already encoded."""
    return f"[{', '.join(items)}]"


def obj(pairs: Iterable[tuple[str, str]]) -> str:
    """A JSON object of (key, value already encoded) pairs."""
    return "{" + ", ".join(f"{encode_string(k)}: {v}" for k, v in pairs) + "}"
