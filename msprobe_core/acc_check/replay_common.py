"""What every replay backend decides the same way, whatever the framework (no framework imported here).

* which recorded calls are random, uninitialized, distributed or writes into part of another tensor
  (the API names PyTorch and MindSpore share: ``dropout``, ``randn``, ``__setitem__``...);
* how an output is numbered (``output_leaves``: ``0``, ``1.0``..., as the dumpers number them);
* ``x[i, j]`` versus ``x[[i, j]]`` for ``__getitem__`` (``index_variants``);
* which outputs get a gradient in the backward replay and from what (``grad_output_specs``);
* how both sides' backward outcomes combine (``run_backwards``);
* how the forward outputs pair up (``forward_pairs``), and the wording of failures (``failure_text``, ``shape_note``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from msprobe_core.acc_check.api_calls import ApiCall, TensorSpec, Typed, leaves_of, normalize_dtype
from msprobe_core.acc_check.replay import OutputPair, Replay

DISTRIBUTED_PREFIXES = frozenset({"Distributed", "DistributedC10d"})
RANDOM = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "normal", "bernoulli",
    "bernoulli_", "multinomial", "poisson", "binomial", "native_dropout", "gumbel_softmax", "rrelu", "rrelu_",
    "fractional_max_pool2d", "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
    "fractional_max_pool3d_with_indices", "uniform_", "normal_", "random_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "_standard_gamma", "_sample_dirichlet"})
DROPOUT = frozenset({"dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "alpha_dropout_",
                     "feature_alpha_dropout", "feature_alpha_dropout_", "feature_dropout", "feature_dropout_"})
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
VIEW_WRITES = frozenset({"__setitem__", "set_", "resize_", "resize_as_", "as_strided_"})
IN_PLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                              "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                              "__imatmul__"})

RANDOM_REASON = "random op: its output depends on the random number generator state of the training run"
VIEW_WRITE_REASON = "in-place op on a view: it writes into part of another tensor, which the dump does not hold"
UNINITIALIZED_REASON = "uninitialized memory: the output of this op has no defined values"
DISTRIBUTED_REASON = "distributed communication: it needs the process group of the training run"


def is_in_place(call: ApiCall) -> bool:
    """Does ``call`` write into its first argument (``add_``, ``__iadd__``, ``inplace=True``)?"""
    api = call.api
    return ((api.endswith("_") and not api.startswith("__")) or api in IN_PLACE_DUNDERS
            or call.kwargs.get("inplace") is True)


def dropout_active(call: ApiCall) -> bool:
    """Did a dropout call drop anything (p > 0 in training)?"""
    p = call.kwargs.get("p", call.args[1] if len(call.args) > 1 else 0.5)
    training = call.kwargs.get("training", call.kwargs.get("train", call.args[2] if len(call.args) > 2 else True))
    return not (isinstance(p, (int, float)) and p == 0) and training is not False


def shared_reason(call: ApiCall, random_names: frozenset = frozenset()) -> Optional[str]:
    """The reason a call of any framework cannot be replayed for what its name says (distributed, random,
    uninitialized, a write into part of a tensor); ``random_names``: the framework's own random APIs."""
    if call.prefix in DISTRIBUTED_PREFIXES:
        return DISTRIBUTED_REASON
    if call.api in UNINITIALIZED:
        return UNINITIALIZED_REASON
    if call.api in RANDOM or call.api in random_names or (call.api in DROPOUT and dropout_active(call)):
        return RANDOM_REASON
    if call.api in VIEW_WRITES:
        return VIEW_WRITE_REASON
    return None


def typed_in(tree: Any) -> list[Typed]:
    """The framework-typed values (``torch.dtype``, ``mindspore.dtype``...) of an argument tree."""
    return leaves_of(tree, Typed)


def unknown_typed_reason(call: ApiCall, known: frozenset) -> Optional[str]:
    """The reason when an argument is of a type the dumper could not describe (not in ``known``)."""
    unknown = [t.type for t in typed_in((call.args, call.kwargs)) if t.type not in known]
    if unknown:
        return f"an argument of type {unknown[0]} is not recorded in the dump (value unknown)"
    return None


def output_leaves(out: Any, value_sequence: Any = ()) -> list[tuple[str, Any]]:
    """(path, value) of every tensor and number of an output, numbered as the dumper numbers them (``0``, ``1.0``);
    sequences of the type(s) ``value_sequence`` (``torch.Size``) are values, as lists."""
    top = list(out) if isinstance(out, (list, tuple)) else [out]
    leaves: list[tuple[str, Any]] = []

    def walk(path: str, node: Any) -> None:
        if node is None or isinstance(node, str):
            return
        if isinstance(node, (list, tuple)) and not isinstance(node, value_sequence):
            for i, item in enumerate(node):
                walk(f"{path}.{i}", item)
        else:
            leaves.append((path, list(node) if isinstance(node, (list, tuple)) else node))

    for i, item in enumerate(top):
        walk(str(i), item)
    return leaves


def index_variants(call: ApiCall, args: list) -> list[list]:
    """``x[i, j]`` and ``x[[i, j]]`` are recorded alike (a list): for ``__getitem__`` try the tuple first, then
    the list when every element is an int (the recorded output shape picks)."""
    if call.api != "__getitem__" or len(args) < 2 or not isinstance(args[1], list):
        return [args]
    as_tuple = [args[0], tuple(args[1]), *args[2:]]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in args[1]):
        return [as_tuple, args]
    return [as_tuple]


def run_tested(call: ApiCall, host_args: list, attempt: Callable[[list], Any],
               output_shapes: Callable[[Any], list]) -> tuple[list, Any, Optional[BaseException]]:
    """The tested forward: ``attempt(args)`` for each of ``index_variants``; the first whose ``output_shapes`` are the
    recorded ones wins, else the first that ran, else the first failure. Returns (the positional arguments used,
    what ``attempt`` returned or None, the exception it raised)."""
    recorded = [s.shape for s in call.output_tensors()]
    result: Optional[tuple] = None
    for args in index_variants(call, host_args):
        try:
            run = attempt(args)
        except Exception as e:  # noqa: BLE001 - the tested kernel failing is a finding, not a crash
            result = result or (args, None, e)
            continue
        if output_shapes(run) == recorded:
            return args, run, None
        if result is None or result[2] is not None:
            result = (args, run, None)
    assert result is not None
    return result


def failure_text(e: BaseException) -> str:
    """``TypeError: first line of the message``."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def benchmark_failed(e: BaseException, tested_error: Optional[BaseException], what: str = "") -> str:
    """The skip reason when the CPU benchmark raised (``what``: "backward " or "")."""
    both = f"; the tested {what or 'call '}failed too ({failure_text(tested_error)})" if tested_error else ""
    return f"{what}replay failed: the CPU float64 benchmark raised {failure_text(e)}{both}"


def run_backwards(tested: Callable[[], Any], bench: Callable[[], Any], replay: Replay,
                  device: str) -> Optional[tuple[Any, Any]]:
    """Both sides' input gradients: (``tested()``, ``bench()``), or None when either raised: a benchmark failure
    makes the backward a skip (``replay.backward_skip``), a tested failure alone an error
    (``replay.backward_failure``, no pairs)."""
    t_error: Optional[BaseException] = None
    try:
        t_grads = tested()
    except Exception as e:  # noqa: BLE001 - judged with the benchmark's outcome below
        t_error = e
    try:
        b_grads = bench()
    except Exception as e:  # noqa: BLE001
        replay.backward_skip = benchmark_failed(e, t_error, "backward ")
        return None
    if t_error is not None:
        replay.backward_failure = f"the tested backward on {device} raised {failure_text(t_error)}"
        replay.backward = []
        return None
    return t_grads, b_grads


def shape_note(recorded: Sequence[TensorSpec], replayed: Sequence[tuple[str, str, tuple]]) -> Optional[str]:
    """A note when the replayed output tensors (normalized dtype, framework dtype name, shape) differ from the
    recorded ones."""
    if len(recorded) != len(replayed):
        return None
    for spec, (dtype, name, shape) in zip(recorded, replayed):
        if (dtype, tuple(shape)) != (spec.dtype, spec.shape):
            return f"replayed output is {name}{list(shape)}, the dump recorded {spec.framework_dtype}{list(spec.shape)}"
    return None


def forward_pairs(call: ApiCall, tested: Sequence[tuple[str, Any]], bench: Sequence[tuple[str, Any]], tensor: type,
                  pair: Callable[[str, Any, Any, str], OutputPair], notes: list[str]) -> list[OutputPair]:
    """The forward outputs' pairs from both sides' ``output_leaves``, matched by path: ``pair(details name, tested
    value, benchmark value, path)``; ``notes`` get a ``shape_note`` on the ``tensor`` outputs and every tested
    output the benchmark lacks."""
    b_leaves = dict(bench)
    note = shape_note(call.output_tensors(), [(normalize_dtype(str(t.dtype)), str(t.dtype), tuple(t.shape))
                                              for _, t in tested if isinstance(t, tensor)])
    if note:
        notes.append(note)
    pairs = []
    for path, t in tested:
        if path not in b_leaves:
            notes.append(f"output {path} has no benchmark counterpart")
            continue
        pairs.append(pair(f"{call.name}.forward.output.{path}", t, b_leaves[path], path))
    return pairs


def grad_output_specs(call: ApiCall, outputs: Sequence[tuple[bool, str, str, tuple]],
                      notes: list[str]) -> list[tuple[int, TensorSpec]]:
    """(output tensor index, spec of its gradient) for the replayed output tensors, given as (takes a gradient,
    normalized dtype, framework dtype name, shape): the backward record's entry (tensor file or statistics),
    random in [-1, 1] when the dump has no backward record (noted), none where the record shows that no
    gradient reached the output."""
    specs = call.grad_outputs
    chosen = []
    for i, (differentiable, dtype, name, shape) in enumerate(outputs):
        if not differentiable:
            continue
        spec = specs[i] if specs is not None and i < len(specs) else None
        if specs is not None and not isinstance(spec, TensorSpec):
            continue  # no gradient reached this output in the training run
        chosen.append((i, spec or TensorSpec(dtype, name, tuple(shape), 1.0, -1.0)))
    if chosen and specs is None:
        notes.append("no backward record: random output gradients in [-1, 1]")
    return chosen

