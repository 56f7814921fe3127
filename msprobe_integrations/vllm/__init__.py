"""vLLM integration: dump only the forward passes that produce tokens ``start..end`` (msprobe's ``token_range``).

    session = dump_tokens(llm, "config.json", [1, 3])
    llm.generate(prompts, sampling_params)
    session.finish()    # stop() + step() in every worker: dump.json written, one rank folder per worker

or ``with dump_tokens(llm, "config.json", [1, 3]): llm.generate(...)``. This package is thin: it finds the
model(s) (``model_paths``), checks that the engine runs eagerly (``eager_mode``), and drives a
``ProbeSession`` where the model lives (``workers``), reached from here through the engine (``client``).
The token counting, the rank folders and every file are the core's.

Where the model is (``route``):

* ``in_process``: vLLM V0, or V1 with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; msprobe's documented path
  ``llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()`` and its variants
  (``IN_PROCESS_PATHS``). Used when the LLM has no ``collective_rpc``.
* ``collective_rpc``: the V1 engine keeps the model in worker processes. ``LLM.collective_rpc`` runs
  ``worker_start`` / ``worker_finish`` (module-level functions of this file) with each worker object; the
  worker's rank names its folder (``rank{R}``). vLLM ships a callable to its engine process only with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the environment *before* ``LLM(...)`` is created.
* ``extension``: the same without pickled callables: create the LLM with
  ``worker_extension_cls="msprobe_integrations.vllm.MsprobeWorkerExtension"``; then only method names and
  plain arguments (a config path or dict, two ints, a path) travel. Chosen automatically when configured.
* ``apply_model``: ``LLM.apply_model(func)`` runs ``func(model)`` in each worker (no worker object: the
  folder is named by ``torch.distributed``'s rank, or ``proc{pid}``). Used when ``collective_rpc`` is missing.

Eager mode: CUDA graphs replay captured kernels without running Python, and vLLM's torch.compile dispatches
straight to compiled code, so neither the token counter (a forward-pre-hook on the root model) nor the dump
hooks would fire. ``dump_tokens`` refuses with ``EagerModeRequiredError`` unless the engine runs eagerly:
create the LLM with ``enforce_eager=True``. The check runs on the engine's config in this process and again
inside every worker.

Counting (the core's): forward call 0 is the prefill, each later call one engine step. Under continuous
batching one step produces one token for every running request; chunked prefill of a long prompt,
speculative decoding and requests that arrive mid-generation break the one-call-per-token mapping (as in
msprobe). Create the debugger's engine first and call ``dump_tokens`` after ``LLM(...)``: vLLM's profiling and
warm-up forward passes at start-up must not be counted.
"""

from msprobe_integrations.vllm.client import (EXTENSION_CLASS, INSECURE_SERIALIZATION_ENV, ROUTES,  # noqa: F401
                                             TokenDump, dump_tokens)
from msprobe_integrations.vllm.eager_mode import (EagerModeRequiredError, check_eager_mode,  # noqa: F401
                                                 eager_mode_problems)
from msprobe_integrations.vllm.model_paths import (IN_PROCESS_PATHS, WORKER_MODEL_PATHS,  # noqa: F401
                                                  find_in_process_model, find_vllm_config)
from msprobe_integrations.vllm.workers import (MsprobeWorkerExtension, WorkerDumpError, model_finish,  # noqa: F401
                                              model_start, worker_finish, worker_rank, worker_start)

__all__ = ["dump_tokens", "TokenDump", "MsprobeWorkerExtension", "EXTENSION_CLASS", "EagerModeRequiredError",
           "WorkerDumpError"]
