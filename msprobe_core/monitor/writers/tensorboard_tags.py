"""TensorBoard tag naming: ``{name}/{kind}_{op}``, with ``name`` as ``records.display_name`` gives it
(``name`` or ``name:micro_step``)."""

from __future__ import annotations


def tensorboard_tag(name: str, kind: str, op: str) -> str:
    """``{name}/{kind}_{op}``: TensorBoard groups charts by name; regex ``actv_norm`` filters a kind and op."""
    return f"{name}/{kind}_{op}"
