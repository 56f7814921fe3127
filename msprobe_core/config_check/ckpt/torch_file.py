"""``torch.load`` for checkpoints: memory-mapped (nothing is read until a tensor is used), safe first.

A file is loaded with ``weights_only=True`` (``argparse.Namespace`` allowed: Megatron stores its
arguments). When it holds other Python objects (Megatron's enums, numpy RNG states of old versions),
it is loaded again with ``weights_only=False`` (the file is trusted: it is the user's own checkpoint)
through an unpickler that replaces classes this environment cannot import by inert stand-ins, so a
Megatron checkpoint loads without Megatron-LM installed. Files in the pre-1.6 format cannot be
memory-mapped and are read whole.
"""

from __future__ import annotations

import argparse
import logging
import pickle
import types
from typing import Any

import torch

from msprobe_core.config_check.exceptions import CheckpointError

logger = logging.getLogger("msprobe_core.config_check")


class _Missing:
    """Stands for an object whose class cannot be imported here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Missing,), {"__module__": module})


_LENIENT = types.SimpleNamespace(__name__="pickle", Unpickler=_LenientUnpickler,
                                 load=lambda f, **kw: _LenientUnpickler(f, **kw).load())


def load(path: str) -> Any:
    """The object ``path`` holds, tensors memory-mapped when the format allows."""
    try:
        return _load(path, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise CheckpointError(f"cannot load checkpoint file {path}: {e}") from None
        logger.warning("%s is in torch's legacy format: read whole (no memory map)", path)
        return _load(path, mmap=False)


def _load(path: str, mmap: bool) -> Any:
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError:
        logger.info("%s holds Python objects besides tensors: loaded with weights_only=False", path)
    except (OSError, EOFError) as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from None
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False, pickle_module=_LENIENT)
    except (OSError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from None
