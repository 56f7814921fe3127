"""msprobe's ``dump_enable``: switch the dump on and off while the job runs by editing its config file.

A config file with a ``dump_enable`` key is watched: at every step boundary (each ``step()``, and the
``start()`` that opens a step) the debugger looks at the file's modification time, size and inode (one
``os.stat``, about a microsecond) and re-reads it only when one of them changed. ``dump_enable: false``
makes ``start()`` do nothing (steps are still counted, so the step folders keep the training's step
numbers); ``true`` dumps again from the next step. Other keys edited at the same time (``step``, ``level``,
``dump_path``, ...) apply from the next step too, in the same run (its step folders are not "another
run's"). An edit that does not validate is logged and ignored: the job keeps the configuration it had.
Without the key, the file is read once, as msprobe does.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Optional

from msprobe_core.dump.config import DumpConfig, load_dump_config
from msprobe_core.errors import MsprobeError

logger = logging.getLogger("msprobe_core")


class FileChange:
    """Tells whether a file changed since the last look: (mtime_ns, size, inode), so that an editor that
    writes a new file and renames it over the old one is seen as well as an in-place write."""

    def __init__(self, path: str):
        self.path = path
        self._seen = self._identity()

    def _identity(self) -> Optional[tuple[int, int, int]]:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def changed(self) -> bool:
        """True once per change (a file that vanished is not a change: the last config stays)."""
        now = self._identity()
        if now is None or now == self._seen:
            return False
        self._seen = now
        return True


def same_settings(a: DumpConfig, b: DumpConfig, ignore_enable: bool = False) -> bool:
    """Whether two configs dump the same way (where they were read from does not count)."""
    extra: dict[str, Any] = {"dump_enable": None} if ignore_enable else {}
    return replace(a, source=None, **extra) == replace(b, source=None, **extra)


class DynamicSwitch:
    """The watch on one config file for ``dump_enable``; ``poll()`` returns the new config after an edit."""

    def __init__(self, path: str, overrides: dict[str, Any]):
        self.watch = FileChange(path)
        self.overrides = overrides

    @classmethod
    def for_config(cls, config_path: Any, cfg: DumpConfig, overrides: dict[str, Any]) -> Optional["DynamicSwitch"]:
        """A switch when ``cfg`` came from a file that has a ``dump_enable`` key, else None."""
        if cfg.dump_enable is None or not isinstance(config_path, (str, os.PathLike)):
            return None
        return cls(os.fspath(config_path), overrides)

    def poll(self) -> Optional[DumpConfig]:
        """The config after an edit of the file, validated; None when unchanged or invalid (logged)."""
        if not self.watch.changed():
            return None
        try:
            cfg = load_dump_config(self.watch.path, **self.overrides)
        except (MsprobeError, ValueError) as e:
            logger.error("dump config %s changed but is invalid, keeping the previous one: %s", self.watch.path, e)
            return None
        return cfg
