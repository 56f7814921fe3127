"""The end of a process that used ``torch.distributed``: ``finish_distributed()``, the one way every script
of this project (and a script of yours) ends a multi-process run so that it exits 0 every time.

Why: a framework wrapper still alive at interpreter exit (the ``DistributedDataParallel`` module, whose
reducer holds the gloo process group; a DeepSpeed engine; megatron-core's DDP and its optimizer) keeps the
process group's worker threads alive until Python finalizes, and tearing them down then aborts the process
("terminate called without an active exception", exit status -6 under torchrun) even after
``destroy_process_group()``. Releasing the wrappers before destroying the group ends it cleanly.

The order, at the end of training::

    session.close()            # msprobe (the Trainer's end, unpatch(engine), hooks.close() do it too)
    del ddp, model, optimizer  # every framework wrapper and what holds it (engine, trainer, model chunks)
    finish_distributed()       # collect them, wait for every rank, destroy the process groups

A closed msprobe session, monitor, debugger, config checker or integration holds none of these objects,
and ``finish_distributed`` closes what is still open of msprobe before it collects.
"""

from __future__ import annotations

import gc
import logging

import torch
import torch.distributed as dist

from msprobe_core.common.exit_close import close_all
from msprobe_core.pytorch.ranks import dist_ready

logger = logging.getLogger("msprobe_core.pytorch")


def finish_distributed(barrier: bool = True) -> None:
    """Close whatever of msprobe is still open (the dump's open step, the monitor, a config_check pack, a
    Megatron probe: what would otherwise be closed at exit), collect the framework wrappers the caller
    released (reference cycles included), wait for every rank (``barrier``), destroy every process group,
    and collect once more; nothing to destroy when ``torch.distributed`` is not initialised. Call it once
    everything is written, after ``del`` of the ``DistributedDataParallel`` module / DeepSpeed engine /
    Trainer / model chunks and the optimizer. Megatron: ``parallel_state.destroy_model_parallel()`` first,
    which drops megatron-core's own references to its groups. Logs a warning naming a wrapper still alive.
    """
    close_all()
    gc.collect()
    if dist_ready():
        alive = live_wrappers()
        if alive:
            logger.warning("msprobe: %s still alive at finish_distributed(); its reducer holds the process group, "
                           "which can abort the process at exit: release it first (del it and whatever holds it)",
                           ", ".join(alive))
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()


def live_wrappers() -> list[str]:
    """The class names of torch ``DistributedDataParallel`` modules still alive in this process, once each:
    the wrapper whose C++ reducer holds the process group. (DeepSpeed's engine and megatron-core's DDP have
    no reducer, and their own autograd hooks can keep them alive out of ``gc``'s reach, so they are not
    reported.)"""
    ddp = torch.nn.parallel.DistributedDataParallel
    return sorted({type(obj).__name__ for obj in gc.get_objects() if issubclass(type(obj), ddp)})
