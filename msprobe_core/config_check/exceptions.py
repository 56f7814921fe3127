"""config_check's exception types (subclasses of the toolkit's ``MsprobeError``)."""

from __future__ import annotations

from msprobe_core.errors import MsprobeError


class PackPathError(MsprobeError, ValueError):
    """An output path that cannot be used: a folder where a file belongs, or another run's files."""


class PackInputError(MsprobeError, ValueError):
    """A path given to compare is not a config_check pack (or not a readable one)."""


class CheckpointError(MsprobeError, ValueError):
    """A checkpoint path that cannot be read, or a layout this tool does not know."""
