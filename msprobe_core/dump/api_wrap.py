"""The L1 API list (msprobe's support_wrap_ops.yaml) and the wrapper each listed API gets, for any framework.

A framework's patcher (``msprobe_core.pytorch.api_patch``, ``msprobe_core.mindspore.api_patch``) names its
yaml sections (``functional``, ``tensor``, ``mint.ops``...) and the owners they stand for; this module reads
and checks the list and makes the wrappers, which call the dump's handler while recording and the original
directly otherwise (one flag test).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable

from msprobe_core.common.patch import mark, marked
from msprobe_core.common.yaml_file import read_yaml_mapping
from msprobe_core.errors import ConfigError

logger = logging.getLogger("msprobe_core")

# handler(original, prefix, api_name, args, kwargs) -> result
ApiHandler = Callable[[Callable, str, str, tuple, dict], Any]


def load_wrap_list(path: str, sections: Iterable[str], not_hooked: Iterable[str] = ()) -> dict[str, list[str]]:
    """Read a support_wrap_ops.yaml (section -> list of API names) whose sections are among ``sections``.
    Sections of msprobe's own file that this build does not hook (``not_hooked``: ``torch_npu``,
    ``mindspeed``...) are left out with one warning naming them; anything else is a ``ConfigError`` naming
    the file or section."""
    allowed = list(sections)
    skipped = [s for s in not_hooked if s not in allowed]
    doc = read_yaml_mapping(path, "wrap_list", "a YAML mapping of namespace -> list of API names")
    left_out = [section for section in doc if section in skipped]
    for section, names in doc.items():
        if section not in allowed and section not in skipped:
            raise ConfigError(f"wrap_list.{section}", section, ", ".join(allowed)
                              + (f" (and msprobe's {', '.join(skipped)}, which are skipped)" if skipped else ""))
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"wrap_list.{section}", names, "a list of API names")
    if left_out:
        logger.warning("wrap list %s: section%s %s not hooked by this build (skipped); dumping the APIs of %s",
                       path, "s" if len(left_out) > 1 else "", ", ".join(left_out),
                       ", ".join(s for s in doc if s not in left_out) or "no section")
    return {section: names for section, names in doc.items() if section not in left_out}


def next_call(counters: dict, key: str) -> tuple[int, str]:
    """Count a call of the API ``key`` (``{prefix}.{api}``) in the step's ``counters``: its index ``n`` in the step
    and its record's name ``{key}.{n}.forward``. The one naming of API records (``CallRecords.on_api_call``, the
    PyTorch fast route's ``api_fast``; ``stats/_fast_api.c`` writes the same in C)."""
    n = counters.get(key, 0)
    counters[key] = n + 1
    return n, f"{key}.{n}.forward"


def make_wrapper(original: Callable, prefix: str, api: str, handler: ApiHandler,
                 should_record: Callable[[], bool]) -> Callable:
    """A wrapper that calls ``handler`` while recording, and ``original`` directly otherwise."""

    def wrapper(*args, **kwargs):
        if should_record():
            return handler(original, prefix, api, args, kwargs)
        return original(*args, **kwargs)

    return as_wrapper(wrapper, original)


def as_wrapper(fn: Callable, original: Callable) -> Callable:
    """``fn``, made to stand for ``original`` (its name, doc and ``__wrapped__``) and marked as an API wrapper
    (``is_api_wrapper``): a framework's own wrapper of one API (e.g. a faster route) passes for ``make_wrapper``'s."""
    try:
        functools.update_wrapper(fn, original)
    except (AttributeError, TypeError):
        pass
    return mark(fn, "api", original)


def is_api_wrapper(fn: Any) -> bool:
    """True for a wrapper ``make_wrapper`` made (its ``__wrapped__`` is the API it wraps)."""
    return marked(fn, "api")
