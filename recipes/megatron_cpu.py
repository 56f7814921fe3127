"""Real megatron-core on a machine without CUDA: the CPU stand-ins for its CUDA-only pieces, and gloo.

megatron-core 0.16.1 (the newest for Python 3.11) and 0.19.2 (Python 3.12) run on the CPU with a tiny
``GPTModel`` once the few pieces that hard-code CUDA are redirected; ``prepare_megatron_training`` adds the
three that Megatron-LM's own training loop (``megatron.training``, in megatron-core 0.17+) needs. Everything
that does so lives here, documented, and is undone by ``CpuPatches.remove()`` (each is a
``msprobe_core.common.patch`` handle):

1. ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on ``torch.cuda.current_device()``;
   the replacement allocates the same buffer on the CPU.
2. ``CudaRNGStatesTracker.fork`` raises "cuda rng state model-parallel-rng is not added" because
   ``model_parallel_cuda_manual_seed`` needs CUDA; the replacement is a no-op context (dropout is 0 in
   these models, so no RNG stream is consumed there).
3. ``torch.cuda.current_device`` returns 0 instead of initialising CUDA: the DDP grad buffers
   (``param_and_grad_buffer.py``), the distributed optimizer and the pipeline's p2p buffers allocate with
   ``device=current_device()``; ``torch.cuda.synchronize`` (pipeline p2p communication) does nothing.
4. ``CudaOnCpuMode``, a ``TorchFunctionMode`` active while patched, maps a CUDA ``device=`` argument of
   factory functions (``torch.zeros(..., device="cuda")`` in the optimizers, ``clip_grads.py`` and
   ``schedules.py``; ``device=0`` from item 3) to the CPU, makes ``Tensor.cuda()`` a no-op and answers
   ``Tensor.type()`` (no arguments) with the CUDA type name, so the type checks of
   ``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer`` ("torch.cuda.FloatTensor", ...)
   accept CPU parameters. It changes no numbers: every call runs unchanged, only on the CPU.
5. ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` are torch's CPU streams (``torch.cpu``, the same
   API): megatron-core 0.19's DDP grad sync (``param_and_grad_buffer.py``) and Megatron-LM's ``get_model``
   (which wraps the chunks in DDP on a side stream) use them.
6. ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is left undefined when Transformer Engine
   is not installed (its import fails before the name is bound), and the MoE router's gating reads it;
   it is set to None, the value megatron-core checks for "no Transformer Engine". The MoE token
   dispatcher ``alltoall`` creates a ``torch.cuda.Stream`` at construction: use ``allgather`` on the CPU.
7. Expert parallelism (``CpuPatches.for_expert_parallel``): ``torch.cuda.current_device`` returns
   ``torch.device("cpu")`` instead of 0, because ``tensor_parallel/mappings.py:_gather_along_first_dim``
   allocates with ``device=torch.cuda.current_device()`` inside autograd backward, where ``CudaOnCpuMode`` is not
   in effect (it failed there with "Cannot access accelerator device").

``use_cpu_initialization=True`` in the ``TransformerConfig`` keeps weight creation off CUDA, and gloo
(``init_distributed``) is the process-group backend; ``finish_megatron`` ends the run. Used by
``megatron_core_gpt.py`` and by the tests.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import os
import sys
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # runnable from a checkout without installing the package
    sys.path.insert(0, _ROOT)

from msprobe_core.common.patch import PatchHandle, patch  # noqa: E402
from msprobe_core.common.ports import free_port  # noqa: E402


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaOnCpuMode(TorchFunctionMode):
    """Runs megatron-core's CUDA-only allocations on the CPU (item 4 of the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class CpuPatches:
    """Install / remove the CPU stand-ins for megatron-core's CUDA-only pieces (see the module docstring)."""

    def __init__(self) -> None:
        self._handles: list[PatchHandle] = []
        self._added: list[tuple[Any, str]] = []
        self._mode: Optional[CudaOnCpuMode] = None

    def install(self) -> "CpuPatches":
        import megatron.core.utils as mcu
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            numel = functools.reduce(operator.mul, tensor_shape, 1)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < numel:
                self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, device="cpu", requires_grad=False)
            return self.buffer[(name, dtype)][0:numel].view(*tensor_shape)

        def fork(self, name=None):
            return contextlib.nullcontext()

        for owner, attr, value in ((mcu.GlobalMemoryBuffer, "get_tensor", get_tensor),
                                   (CudaRNGStatesTracker, "fork", fork),
                                   (torch.cuda, "current_device", lambda: 0),
                                   (torch.cuda, "synchronize", lambda device=None: None),
                                   (torch.cuda, "Stream", torch.cpu.Stream),
                                   (torch.cuda, "current_stream", torch.cpu.current_stream),
                                   (torch.cuda, "stream", torch.cpu.stream)):
            self.replace(owner, attr, lambda _original, value=value: value)

        import megatron.core.transformer.moe.moe_utils as moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # item 6 (a name to add, not one to patch)
            moe_utils.te_general_gemm = None
            self._added.append((moe_utils, "te_general_gemm"))
        self._mode = CudaOnCpuMode()
        self._mode.__enter__()
        return self

    def for_expert_parallel(self) -> "CpuPatches":
        """Item 7 of the module docstring (after ``install``)."""
        self.replace(torch.cuda, "current_device", lambda _original: (lambda: torch.device("cpu")))
        return self

    def replace(self, owner: Any, attr: str, make: Any) -> None:
        """Replace ``owner.attr`` by ``make(original)`` until ``remove()``."""
        self._handles.append(patch(owner, attr, make))

    def remove(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        while self._handles:
            self._handles.pop().remove()
        while self._added:
            delattr(*self._added.pop())

    def __enter__(self) -> "CpuPatches":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def init_distributed(rank: int = 0, world_size: int = 1, port: Optional[int] = None) -> None:
    """gloo process group (MASTER_ADDR/PORT from the environment unless ``port`` is given)."""
    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


def finish_megatron(barrier: bool = True) -> None:
    """The end of a megatron-core run, once the model chunks and the optimizer are released (out of scope
    or ``del``): megatron-core drops its parallel groups, then ``finish_distributed`` destroys them (see
    ``msprobe_core.pytorch.shutdown``: a wrapper or group alive at exit can abort the process)."""
    from megatron.core import parallel_state

    from msprobe_core.session import finish_distributed

    parallel_state.destroy_model_parallel()
    finish_distributed(barrier=barrier)


def prepare_megatron_training(args: Any) -> CpuPatches:
    """Megatron-LM's own training loop (``megatron.training``, shipped by megatron-core 0.17+) on the CPU.

    Call after ``parse_and_validate_args`` and before ``pretrain``. Besides ``CpuPatches`` (items 1-5 above):

    6. ``megatron.training.training.initialize_megatron`` is called with ``allow_no_cuda=True`` (its own switch
       for CPU-only use; ``pretrain`` passes none, so it would assert that CUDA is available).
    7. The gloo process group and megatron-core's parallel groups are started here, from Megatron's args:
       ``initialize_megatron`` keeps a process group that exists, and starts the parallel groups only when
       ``torch.cuda.device_count() > 0``.
    8. ``megatron.core.datasets.utils.compile_helpers`` (which ``initialize_megatron`` calls) runs ``make`` in
       megatron-core's ``datasets`` folder and exits the process when that fails; the wheel ships the compiled
       helpers (``helpers_cpp*.so``) and no Makefile, so there it does nothing. Not CPU-specific.
    """
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.training as training

    patches = CpuPatches().install()
    patches.replace(training, "initialize_megatron", lambda original: functools.partial(original, allow_no_cuda=True))
    if not os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")):
        patches.replace(dataset_utils, "compile_helpers", lambda _original: lambda: None)
    init_parallel(args)
    return patches


def init_parallel(args: Any) -> None:
    """gloo and megatron-core's parallel groups from Megatron's args (rank, world and parallel sizes)."""
    from megatron.core import parallel_state

    init_distributed(args.rank, args.world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1))


def chunk_stage(vp_stage: Optional[int]) -> dict:
    """``pre_process`` and ``post_process`` of this rank's model chunk of virtual pipeline stage ``vp_stage`` (None
    without a virtual pipeline), and the ``vp_stage`` itself, as keywords for ``GPTModel`` or a model provider.
    megatron-core 0.13 and later take the stage as an argument; 0.12 reads the global virtual pipeline rank,
    which is set here instead (as Megatron-LM's ``get_model`` of its time did)."""
    from megatron.core import parallel_state as ps

    if "vp_stage" in inspect.signature(ps.is_pipeline_first_stage).parameters:
        return {"pre_process": ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                "post_process": ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage), "vp_stage": vp_stage}
    if vp_stage is not None:
        ps.set_virtual_pipeline_model_parallel_rank(vp_stage)
    return {"pre_process": ps.is_pipeline_first_stage(ignore_virtual=False),
            "post_process": ps.is_pipeline_last_stage(ignore_virtual=False)}
