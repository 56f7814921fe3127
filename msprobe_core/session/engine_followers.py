"""Integrations bridged through the core: a trainer integration asks for an engine another one knows.

The Hugging Face Trainer can run DeepSpeed itself: the engine steps the optimizer inside ``backward()``,
where only the DeepSpeed integration knows how to read its (sharded) gradients and states. The HF
integration does not import the DeepSpeed one; it calls ``session.follow_engine("deepspeed", ...)`` and the
core finds the *engine follower* of that kind: one registered with ``register_engine_follower(kind,
follower)``, else one of the toolkit's own integrations listed in ``SHIPPED`` by module path (loaded on
first use, as ``msprobe_core.cli`` lists its commands).

A follower is ``follower(session, current_step) -> handle``: it makes the engine drive the session's
monitor at each optimizer step (``before_optimizer_step`` / ``after_optimizer_step(current_step())``, with
``session.set_state_reader`` for where the engine keeps its states) and returns a handle whose
``remove()`` undoes that (``msprobe_core.common.patch.PatchHandle``).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Optional

logger = logging.getLogger("msprobe_core.session")

Follower = Callable[[Any, Callable[[], int]], Any]

SHIPPED: dict[str, str] = {
    "deepspeed": "msprobe_integrations.deepspeed.trainer_bridge:follow_trainer_engine",
}
"""Engine kind -> ``module:function`` of the follower the toolkit ships."""

_FOLLOWERS: dict[str, Follower] = {}


def register_engine_follower(kind: str, follower: Follower) -> None:
    """Make ``follower`` the one ``session.follow_engine(kind, ...)`` uses."""
    _FOLLOWERS[kind] = follower


def engine_follower(kind: str) -> Optional[Follower]:
    """The follower of ``kind``: a registered one, else the shipped one (imported now); None if neither."""
    if kind not in _FOLLOWERS and kind in SHIPPED:
        module, _, name = SHIPPED[kind].partition(":")
        try:
            _FOLLOWERS.setdefault(kind, getattr(importlib.import_module(module), name))
        except ImportError:  # the framework (or the integration) is not installed: the caller warns
            logger.exception("msprobe: loading the %s engine follower (%s) failed", kind, SHIPPED[kind])
    return _FOLLOWERS.get(kind)
