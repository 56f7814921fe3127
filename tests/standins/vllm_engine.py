"""STAND-INS FOR vLLM's ENGINE OBJECTS, used by tests/msprobe_integrations/vllm/test_vllm.py.

vLLM cannot run on these CPU-only machines (its wheels link CUDA libraries; see
/work/shared/notes/frameworks-on-cpu.md). Everything here that looks like vLLM is a stand-in for the *shape*
of vLLM's engine objects only, as the integration sees them:

* ``InProcessLLM``: V0 / in-process V1, ``llm.llm_engine.model_executor.driver_worker...get_model()``;
* ``InProcessRpcLLM``: V1 with an in-process engine (``collective_rpc`` / ``apply_model`` run here);
* ``MultiprocLLM``: V1 with workers in real subprocesses: ``collective_rpc`` sends the method (a name, or a
  module-level function pickled by reference) to every worker process and gathers one answer per worker,
  refusing callables without ``VLLM_ALLOW_INSECURE_SERIALIZATION`` as vLLM's msgpack encoder does.

What is real: the torch model (``TinyCausalLM``, a real ``nn.Module`` run under ``torch.inference_mode`` with
vLLM's call pattern: ``forward(input_ids, positions)`` once per engine step, then ``compute_logits`` outside
forward, then greedy sampling), and the dump core (``msprobe_core``) that the integration drives.
"""

from __future__ import annotations

import enum
import multiprocessing as mp
import os
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from msprobe_integrations.vllm import INSECURE_SERIALIZATION_ENV, MsprobeWorkerExtension

VOCAB = 64
HIDDEN = 16
PROMPT = [3, 17, 42, 5, 9, 11]


# ----------------------------------------------------------------------------------- the real model
class TinyBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class TinyCausalLM(nn.Module):
    """A real torch model with vLLM's model interface: ``forward`` returns hidden states and the model
    runner calls ``compute_logits`` (lm_head) outside ``forward``."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = 2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([TinyBlock(hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids) + 0.01 * positions.to(torch.float32).unsqueeze(-1)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def build_model(seed: int = 0) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM().eval()


def run_generation(model: nn.Module, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """vLLM's per-step call pattern for one request: step 0 is the prefill of the whole prompt, each later
    step feeds the last token (a KV cache would hold the rest); every step = one ``model(...)`` call."""
    out: list[int] = []
    ids = torch.tensor([list(prompt)])
    pos = torch.arange(len(prompt)).unsqueeze(0)
    with torch.inference_mode():
        for step in range(max_tokens):
            hidden = model(ids, pos)
            logits = model.compute_logits(hidden[:, -1])
            token = int(torch.argmax(logits, dim=-1)[0])
            out.append(token)
            ids = torch.tensor([[token]])
            pos = torch.tensor([[len(prompt) + step]])
    return out


# ------------------------------------------------------------------------------- config stand-ins
class CompilationMode(enum.IntEnum):
    """Stand-in for vllm.config.CompilationMode."""
    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


class CUDAGraphMode(enum.Enum):
    """Stand-in for vllm.config.CUDAGraphMode (some values are tuples, as in vLLM)."""
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)
    FULL_AND_PIECEWISE = (2, 1)


def fake_vllm_config(enforce_eager: bool = True, mode: Any = "auto", cudagraph_mode: Any = "auto",
                     worker_extension_cls: str = "", world_size: int = 1, legacy: bool = False) -> SimpleNamespace:
    """Stand-in for VllmConfig. ``auto`` resolves as recent vLLM does: enforce_eager -> no compile, no graphs;
    otherwise VLLM_COMPILE + FULL_AND_PIECEWISE. ``legacy`` uses the older ``level`` / ``use_cudagraph`` fields."""
    if mode == "auto":
        mode = CompilationMode.NONE if enforce_eager else CompilationMode.VLLM_COMPILE
    if cudagraph_mode == "auto":
        cudagraph_mode = CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode.FULL_AND_PIECEWISE
    if legacy:
        compilation = SimpleNamespace(level=int(mode), use_cudagraph=cudagraph_mode is not CUDAGraphMode.NONE)
    else:
        compilation = SimpleNamespace(mode=mode, cudagraph_mode=cudagraph_mode)
    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=enforce_eager),
        compilation_config=compilation,
        parallel_config=SimpleNamespace(worker_extension_cls=worker_extension_cls, world_size=world_size,
                                        data_parallel_size=1))


# -------------------------------------------------------------------------------- worker stand-ins
class FakeModelRunner:
    """Stand-in for vLLM's GPUModelRunner: holds the model."""

    def __init__(self, model: nn.Module):
        self.model = model

    def get_model(self) -> nn.Module:
        return self.model


class FakeWorker:
    """Stand-in for vllm.v1.worker.gpu_worker.Worker: ``rank``, ``vllm_config``, ``model_runner``, ``get_model()``,
    ``apply_model(fn)``; ``execute_generation`` plays the engine steps of one request."""

    def __init__(self, rank: int, model: nn.Module, vllm_config: Any):
        self.rank = rank
        self.local_rank = rank
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.model_runner = FakeModelRunner(model)

    def get_model(self) -> nn.Module:
        return self.model_runner.get_model()

    def apply_model(self, fn: Callable[[nn.Module], Any]) -> Any:
        return fn(self.get_model())

    def execute_generation(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        return run_generation(self.get_model(), prompt, max_tokens)


class FakeWorkerWithExtension(FakeWorker, MsprobeWorkerExtension):
    """What vLLM builds for ``worker_extension_cls=...MsprobeWorkerExtension`` (the extension is mixed in)."""


def run_method(obj: Any, method: Union[str, Callable[..., Any]], args: Sequence[Any], kwargs: Optional[dict]) -> Any:
    """vLLM's rule: a string names a method of the worker; a callable is called with the worker first."""
    if isinstance(method, str):
        try:
            fn = getattr(obj, method)
        except AttributeError:
            raise NotImplementedError(f"Method {method!r} is not implemented.") from None
        return fn(*args, **(kwargs or {}))
    return method(obj, *args, **(kwargs or {}))


# ----------------------------------------------------------------------------------- LLM stand-ins
class InprocClient:
    """Stand-in for vLLM V1's in-process engine-core client (nothing is serialized)."""


class SyncMPClient:
    """Stand-in for vLLM V1's multiprocess engine-core client (requests are msgpack-encoded)."""


_IN_PROCESS_SHAPES = {
    # which attribute path of IN_PROCESS_PATHS the engine graph exposes
    "worker.model_runner.get_model()": lambda m: SimpleNamespace(worker=SimpleNamespace(model_runner=FakeModelRunner(m))),
    "worker.model_runner.model": lambda m: SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(model=m))),
    "model_runner.get_model()": lambda m: SimpleNamespace(model_runner=FakeModelRunner(m)),
    "model_runner.model": lambda m: SimpleNamespace(model_runner=SimpleNamespace(model=m)),
    "worker.get_model()": lambda m: SimpleNamespace(worker=SimpleNamespace(get_model=lambda: m)),
    "get_model()": lambda m: SimpleNamespace(get_model=lambda: m),
}


class InProcessLLM:
    """Stand-in for a vLLM V0 ``LLM`` (model in this process, no collective_rpc)."""

    def __init__(self, model: nn.Module, shape: str = "worker.model_runner.get_model()", vllm_config: Any = None):
        self.model = model
        self.llm_engine = SimpleNamespace(
            vllm_config=vllm_config if vllm_config is not None else fake_vllm_config(),
            model_executor=SimpleNamespace(driver_worker=_IN_PROCESS_SHAPES[shape](model)))

    def generate(self, prompt: Sequence[int] = PROMPT, max_tokens: int = 5) -> list[int]:
        return run_generation(self.model, prompt, max_tokens)


class InProcessRpcLLM:
    """Stand-in for a vLLM V1 ``LLM`` whose engine runs in this process (UniProcExecutor): ``collective_rpc``
    and ``apply_model`` run on the one worker here."""

    def __init__(self, worker: FakeWorker, client_config: Any = None):
        self.worker = worker
        self.llm_engine = SimpleNamespace(vllm_config=client_config if client_config is not None else worker.vllm_config,
                                          engine_core=InprocClient())

    def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        return [run_method(self.worker, method, args, kwargs)]

    def apply_model(self, func: Callable[[nn.Module], Any]) -> list:
        return self.collective_rpc("apply_model", args=(func,))

    def generate(self, prompt: Sequence[int] = PROMPT, max_tokens: int = 5) -> list[int]:
        return self.worker.execute_generation(prompt, max_tokens)


def _worker_main(conn, rank: int, world_size: int, config_kwargs: dict, with_extension: bool) -> None:
    """Body of one stand-in worker process: a real model, then a request loop (like vLLM's worker_busy_loop)."""
    torch.set_num_threads(1)
    cls = FakeWorkerWithExtension if with_extension else FakeWorker
    worker = cls(rank, build_model(0), fake_vllm_config(world_size=world_size, **config_kwargs))
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, args, kwargs = msg
        try:
            if method == "__generate__":
                result = worker.execute_generation(*args)
            else:
                result = run_method(worker, method, args, kwargs)
            conn.send(("ok", result))
        except BaseException as e:  # vLLM reports a worker's failure to the caller
            conn.send(("error", f"{type(e).__name__}: {e}"))
    conn.close()


class MultiprocLLM:
    """Stand-in for a vLLM V1 ``LLM`` with ``world_size`` workers in real subprocesses (spawned, as vLLM does
    with CUDA). Every worker holds the same real model and runs every engine step, like tensor-parallel ranks."""

    def __init__(self, world_size: int = 2, with_extension: bool = False, **config_kwargs: Any):
        ext = "msprobe_integrations.vllm.MsprobeWorkerExtension" if with_extension else ""
        self.llm_engine = SimpleNamespace(
            vllm_config=fake_vllm_config(world_size=world_size, worker_extension_cls=ext, **config_kwargs),
            engine_core=SyncMPClient())
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(child, rank, world_size,
                                                       dict(config_kwargs, worker_extension_cls=ext), with_extension),
                            daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self.worker_pids = []
        for conn in self._conns:
            if not conn.poll(120):
                self.shutdown()
                raise RuntimeError("a stand-in worker did not start within 120 s")
            self.worker_pids.append(conn.recv()[1])

    def _broadcast(self, method, args: tuple, kwargs: Optional[dict]) -> list:
        for conn in self._conns:
            conn.send((method, tuple(args), kwargs))
        answers = []
        for conn in self._conns:
            if not conn.poll(120):
                raise TimeoutError("a stand-in worker did not answer within 120 s")
            answers.append(conn.recv())
        for status, value in answers:
            if status == "error":
                raise RuntimeError(f"Worker failed with error '{value}', please check the stack trace above "
                                   "for the root cause")
        return [value for _, value in answers]

    def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        odd = [x for x in (method, *args, *(kwargs or {}).values()) if callable(x)]
        if odd and os.environ.get(INSECURE_SERIALIZATION_ENV, "0") in ("", "0"):
            # vLLM's MsgpackEncoder refuses anything it cannot encode natively (a function, a partial)
            raise TypeError(f"Object of type {type(odd[0])} is not serializable. Set {INSECURE_SERIALIZATION_ENV}=1 "
                            "to allow fallback to pickle-based serialization.")
        return self._broadcast(method, args, kwargs)

    def apply_model(self, func: Callable[[nn.Module], Any]) -> list:
        return self.collective_rpc("apply_model", args=(func,))

    def generate(self, prompt: Sequence[int] = PROMPT, max_tokens: int = 5) -> list[int]:
        return self._broadcast("__generate__", (list(prompt), max_tokens), None)[0]

    def shutdown(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self) -> "MultiprocLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
