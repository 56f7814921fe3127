"""Host-side records of one monitored step: what the writers and the anomaly rules consume (no torch).

A ``MetricRow`` is one statistics row: the kind of tensor (``actv``, ``actv_grad``, ``grad``, ``exp_avg``,
``exp_avg_sq``, ``param`` or an integration's own kind), its name, the module it belongs to, the
micro-batch it came from (None for per-step kinds), its values in the order of the config's ``ops``, and
the call order in which the monitor saw it during the step.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

ACTV = "actv"
ACTV_GRAD = "actv_grad"
GRAD = "grad"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
PARAM = "param"
KINDS = (ACTV, ACTV_GRAD, GRAD, EXP_AVG, EXP_AVG_SQ, PARAM)

# Where in a step a kind is produced; anomalies are ordered by it (see ``anomaly.order_key``).
STAGE_PARAM = "param"          # the weights this step's forward used (read before the optimizer update)
STAGE_FORWARD = "forward"
STAGE_BACKWARD = "backward"
STAGE_GRADIENT = "gradient"    # accumulated (and reduced) weight gradients, after the last backward
STAGE_OPTIMIZER = "optimizer"  # optimizer state after the update
STAGES = (STAGE_PARAM, STAGE_FORWARD, STAGE_BACKWARD, STAGE_GRADIENT, STAGE_OPTIMIZER)
KIND_STAGE = {
    PARAM: STAGE_PARAM, ACTV: STAGE_FORWARD, ACTV_GRAD: STAGE_BACKWARD, GRAD: STAGE_GRADIENT,
    EXP_AVG: STAGE_OPTIMIZER, EXP_AVG_SQ: STAGE_OPTIMIZER,
}


def stage_of(kind: str) -> str:
    """The step stage of a kind; integration-defined kinds count as gradient-stage data."""
    return KIND_STAGE.get(kind, STAGE_GRADIENT)


class MetricRow(NamedTuple):
    """One row of statistics of one tensor at one step (values follow the config's ``ops``).

    A named tuple (immutable, built by the thousand every step, so it must be cheap to make)."""

    kind: str
    name: str
    module: str
    micro_step: int | None
    call_id: int
    numel: int
    values: Sequence[float]
    alias: bool = False
    """The same tensor as an earlier row of this kind (ln.output is linear.input): written, not judged."""
    external: bool = False
    """An activation the model did not compute from its weights (an input batch, a mask, a constant: it
    does not require grad). -inf/+inf there is what the tensor means (a mask); only NaN is an anomaly."""

    @property
    def stage(self) -> str:
        return stage_of(self.kind)


def display_name(name: str, micro_step: int | None, with_micro: bool) -> str:
    """The name used in TensorBoard tags and the ``api`` dict: ``name`` or ``name:micro`` (msprobe style).

    The micro-batch suffix is used with gradient accumulation, and for any later micro-batch otherwise
    (so two micro-batches never write the same tag).
    """
    if micro_step is not None and (with_micro or micro_step > 0):
        return f"{name}:{micro_step}"
    return name

