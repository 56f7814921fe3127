"""The ``deepspeed`` engine follower: the monitor of a session another integration owns (the Hugging Face
Trainer's) driven at a DeepSpeed engine's optimizer step.

The Trainer steps the engine inside ``backward()``, so its own optimizer-step callbacks come too late to see
gradients. ``follow_trainer_engine`` wraps ``DeepSpeedEngine._take_model_step`` at class level: at every
optimizer step the session's monitor reads the engine's own (sharded) gradients and weights before the
update and its optimizer states after it, labelled ``current_step()``; an update the fp16 loss scaler skipped
(``engine.skipped_steps`` grew) is reported as a skipped step. The engine is bound on first sight
(the one whose ``module`` is the session's model, else the first that steps). Registered with the core as
the ``deepspeed`` engine follower (``msprobe_core.session.engine_followers``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from msprobe_core.common.patch import PatchHandle, wrap
from msprobe_core.session import ProbeSession
from msprobe_integrations.deepspeed.engine import skipped_since, skipped_steps, zero_stage
from msprobe_integrations.deepspeed.zero_readers import make_state_reader

logger = logging.getLogger("msprobe_core.deepspeed")


def follow_trainer_engine(session: ProbeSession, current_step: Callable[[], int]) -> PatchHandle:
    """Drive ``session``'s monitor at the optimizer steps of the engine that trains ``session.model``;
    returns the handle whose ``remove()`` restores ``DeepSpeedEngine._take_model_step``."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    bound: dict[str, Any] = {}

    def follows(engine: Any) -> bool:
        if session.monitor is None:
            return False
        if "engine" not in bound:
            model = session.model
            if model is not None and engine.module is not model:
                return False
            reader = make_state_reader(engine)
            session.set_state_reader(reader, reader.group)
            bound["engine"] = engine
            logger.info("msprobe: following the Trainer's DeepSpeed engine (ZeRO stage %d, reader %s)",
                        zero_stage(engine), type(reader).__name__)
        return bound["engine"] is engine

    def before(engine: Any, *args: Any, **kwargs: Any) -> Optional[tuple[Any, int]]:
        if not follows(engine):
            return None
        session.before_optimizer_step()
        return engine, skipped_steps(engine)

    def after(followed: Optional[tuple[Any, int]], _result: Any) -> None:
        if followed is not None:
            engine, skipped_before = followed
            session.after_optimizer_step(int(current_step()), skipped=skipped_since(engine, skipped_before))

    return wrap(DeepSpeedEngine, "_take_model_step", before=before, after=after,
                where="monitoring the Trainer's DeepSpeed optimizer step", logger=logger)
