"""The ``tensorboard`` format: event files written with tensorboardX into the rank's folder.

All scalars of a step go into one event (one ``Summary`` with a value per tag), so writing a step costs
one protobuf message, not thousands of ``add_scalar`` calls. Tags are ``{name}/{kind}_{op}``; the
TensorBoard step is the optimizer step.
"""

from __future__ import annotations

from typing import Sequence

from msprobe_core.errors import MsprobeError
from msprobe_core.monitor.records import MetricRow, display_name
from msprobe_core.monitor.step_rows import RowLayout, StepRows
from msprobe_core.monitor.writers.base import MetricWriter, WriterContext
from msprobe_core.monitor.writers.tensorboard_tags import tensorboard_tag


class TensorBoardUnavailableError(MsprobeError, ImportError):
    """``format`` asks for tensorboard but tensorboardX is not installed."""


class TensorBoardWriter(MetricWriter):
    """One tensorboardX ``SummaryWriter`` per rank folder."""

    def __init__(self, context: WriterContext):
        try:
            from tensorboardX import SummaryWriter
            from tensorboardX.proto.summary_pb2 import Summary
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise TensorBoardUnavailableError(
                f"monitor format 'tensorboard' needs tensorboardX ({e}); install it "
                "(pip install 'msprobe-toolkit[monitor]') or use format 'csv'") from None
        self.context = context
        self._summary = Summary
        context.rank_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(logdir=str(context.rank_dir))
        self._file_writer = self._writer._get_file_writer()
        self._tags: dict[tuple[str, str, int | None], list[str]] = {}

    def _tags_of(self, layout: RowLayout) -> list[str]:
        """Every tag of the rows of ``layout``, row after row, an op after the other (made once per layout)."""
        tags = layout.plans.get(self)
        if tags is None:
            made = self._tags
            tags = []
            for key in zip(layout.kinds, layout.names, layout.micros):
                row_tags = made.get(key)
                if row_tags is None:
                    name = display_name(key[1], key[2], self.context.with_micro)
                    row_tags = made[key] = [tensorboard_tag(name, key[0], op) for op in self.context.ops]
                tags += row_tags
            layout.plans[self] = tags
        return tags

    def write(self, step: int, rows: Sequence[MetricRow]) -> None:
        rows = StepRows.of(rows)
        value = self._summary.Value
        values = [value(tag=tag, simple_value=v)
                  for tag, v in zip(self._tags_of(rows.layout), rows.values.ravel().tolist())]
        if values:
            self._file_writer.add_summary(self._summary(value=values), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
