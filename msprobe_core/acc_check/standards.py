"""Pass rules: when a tested output agrees with its float64 CPU benchmark (framework-neutral).

Every compared tensor is judged by the standard of its *precision*: the lower of its own dtype and the
dtype the call computed in (a float32 gradient of a call that ran under bfloat16 autocast holds
bfloat16-rounded values and is judged as bfloat16).

* **float32, float64, integers, bools** (seed 002's rule): pass when the cosine similarity is greater
  than 0.99 *and* the maximum absolute error is less than 0.0001. For integers and bools this means
  equal. A float32 result that fails only because float32 itself cannot hold the values that closely
  (|values| above ~1000) is still an error, and its Message says how its error compares with float32's
  own rounding of the benchmark.
* **float16 and bfloat16** (this tool's dtype-aware standard): the absolute bound of 0.0001 fails every
  healthy bfloat16 value above ~0.03 (bfloat16 keeps 8 significant bits), so the tested error is
  measured against the error the *same call* makes when computed in that dtype by a trusted reference:
  the float64 benchmark run again with every primitive operation's result rounded to float16/bfloat16
  (what a correct kernel computing in float32 and rounding its output does; backward formulas are rounded
  op by op too, and gradients reach the inputs in their dtype). Backends that cannot run that reference
  use the float64 benchmark rounded once to the dtype. Pass when

  - RMSE(tested - bench) <= 2 x RMSE(reference - bench), and
  - MaxAbsErr(tested - bench) <= 4 x MaxAbsErr(reference - bench), and
  - cosine > 0.99 (unless the reference itself is not above 0.99, e.g. all its values underflow).

  Every element of the reference is a float16/bfloat16 value, so its error is never below that of the
  correctly rounded benchmark (the nearest such value): an output that passes against the correctly
  rounded benchmark passes against the reference. The runner therefore judges against the correctly
  rounded benchmark first and runs the reference only for calls with an output failing there.

  The reference errors count as at least half a unit roundoff u of the benchmark's values (RMSE:
  u/2 x RMS(bench), MaxAbsErr: u/2 x max|bench|; u = 2^-8 for bfloat16, 2^-11 for float16), so an
  output the dtype holds exactly, or a single number, is not held to a bound tighter than one rounding.
  Measured on CPU torch 2.13 (tests and benchmark dumps of a bf16-autocast GPT, plus conv, attention,
  var, rsqrt, einsum... in bfloat16): every healthy output scores at most 1.0x RMSE and 1.0x MaxAbsErr;
  gelu made wrong by a factor (1 + 2^-8), one unit roundoff, scores ~3x RMSE, by (1 + 2^-7) ~4.2x/4.7x,
  by (1 + 2^-6) ~8x/8.5x: all fail.
* NaN/Inf must be at the same positions with the same values; metrics cover the finite elements.
  Different shapes fail.

The metrics (cosine, max absolute and relative error, RMSE) come from ``msprobe_core.compare.tensors``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from msprobe_core.acc_check.api_calls import LOW_PRECISION
from msprobe_core.dumpdir.tensor_reader import ArrayTensor
from msprobe_core.compare.tensors import TensorResult, compare_arrays

PASS, ERROR, SKIP = "pass", "error", "skip"
COSINE = 0.99
MAX_ABS = 1e-4
RMSE_RATIO = 2.0
MAX_ABS_RATIO = 4.0
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}


@dataclass(frozen=True)
class Verdict:
    """The judgement of one tested tensor against its benchmark."""

    status: str
    cosine: Optional[float]
    max_abs: Optional[float]
    max_rel: Optional[float]
    message: str = ""   # the details row's Message
    failure: str = ""   # why it fails, in short (for the result row)


def _bfloat16_bits(values32: np.ndarray) -> np.ndarray:
    """float32 values rounded to nearest-even bfloat16, as float32 bit patterns (low 16 bits zero)."""
    bits = values32.view(np.uint32)
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)


def round_to(values: np.ndarray, dtype: str, shape: tuple) -> ArrayTensor:
    """Flat ``values`` (float32/float64) rounded to nearest-even in float16 or bfloat16, as a tensor of ``shape``."""
    if dtype == "float16":
        return ArrayTensor(values.astype(np.float16), "float16", shape)
    rounded = (_bfloat16_bits(values.astype(np.float32)) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = 0x7FC0
    return ArrayTensor(rounded, "bfloat16", shape)


def _fmt(x: Optional[float]) -> str:
    return "undefined" if x is None else f"{x:.6g}"


def judge(tested: ArrayTensor, bench: ArrayTensor, precision: str, reference: Optional[ArrayTensor] = None) -> Verdict:
    """Judge ``tested`` against ``bench`` by the standard of ``precision`` (a normalized dtype name);
    ``reference`` is the call computed in that precision by a trusted reference (see the module docstring)."""
    result = compare_arrays(tested, bench)
    if result.problem:
        return Verdict(ERROR, result.cosine, result.max_abs, result.max_rel, result.problem, result.problem)
    if tested.raw.size == 0:
        return Verdict(PASS, None, None, None, "empty tensors")
    if precision in LOW_PRECISION:
        return _judge_low_precision(result, bench, precision, reference)
    failures = []
    if result.cosine is None or math.isnan(result.cosine) or result.cosine <= COSINE:
        failures.append(f"cosine {_fmt(result.cosine)} <= {COSINE:g}")
    if result.max_abs is None or math.isnan(result.max_abs) or result.max_abs >= MAX_ABS:
        failures.append(f"MaxAbsErr {_fmt(result.max_abs)} >= {MAX_ABS:g}")
    failure = "; ".join(failures)
    message = failure
    if failures and precision == "float32":
        values = bench.values().reshape(-1)
        rmse_ratio, max_ratio, _ = _ratios(result, values, values.astype(np.float32), precision)
        message += (f" (against float32's own rounding of the benchmark: RMSE {rmse_ratio:.3g}x, "
                    f"MaxAbsErr {max_ratio:.3g}x)")
    return Verdict(ERROR if failures else PASS, result.cosine, result.max_abs, result.max_rel, message, failure)


def _judge_low_precision(result: TensorResult, bench: ArrayTensor, precision: str,
                         reference: Optional[ArrayTensor]) -> Verdict:
    b32 = bench.values().reshape(-1).astype(np.float32)
    if reference is not None and reference.shape == bench.shape:
        ref32 = reference.values().reshape(-1).astype(np.float32, copy=False)
        what = "the reference's computed in " + precision
    else:
        ref32 = _rounded32(b32, precision)
        what = "the correctly rounded result's"
    rmse_ratio, max_ratio, ref_cosine = _ratios(result, b32, ref32, precision)
    failures = []
    if ref_cosine > COSINE and (result.cosine is None or result.cosine <= COSINE):
        failures.append(f"cosine {_fmt(result.cosine)} <= {COSINE:g}")
    if rmse_ratio > RMSE_RATIO:
        failures.append(f"RMSE {rmse_ratio:.3g}x > {RMSE_RATIO:g}x")
    if max_ratio > MAX_ABS_RATIO:
        failures.append(f"MaxAbsErr {max_ratio:.3g}x > {MAX_ABS_RATIO:g}x")
    summary = (f"{precision} standard: RMSE {rmse_ratio:.3g}x, MaxAbsErr {max_ratio:.3g}x {what} "
               f"(limits {RMSE_RATIO:g}x, {MAX_ABS_RATIO:g}x)")
    failure = "; ".join(failures)
    message = f"{failure} ({summary})" if failures else summary
    return Verdict(ERROR if failures else PASS, result.cosine, result.max_abs, result.max_rel, message, failure)


def _ratios(result: TensorResult, bench: np.ndarray, reference: np.ndarray,
            precision: str) -> tuple[float, float, float]:
    """The tested RMSE and MaxAbsErr over the reference's (each reference error counted as at least half a unit
    roundoff of the benchmark's RMS / max magnitude), and the reference's cosine."""
    ref_rmse, ref_max, ref_cosine = _reference_error(bench, reference)
    finite = bench[np.isfinite(bench)]
    half_u = UNIT_ROUNDOFF[precision] / 2
    rms_floor = half_u * (math.sqrt(float(np.dot(finite, finite)) / finite.size) if finite.size else 0.0)
    max_floor = half_u * (float(np.abs(finite).max()) if finite.size else 0.0)
    return _ratio(result.rmse, ref_rmse, rms_floor), _ratio(result.max_abs, ref_max, max_floor), ref_cosine


def _rounded32(values32: np.ndarray, precision: str) -> np.ndarray:
    """float32 values rounded to nearest in ``precision`` (float16 or bfloat16), as float32."""
    with np.errstate(all="ignore"):
        if precision == "float16":
            return values32.astype(np.float16).astype(np.float32)
        return _bfloat16_bits(values32).view(np.float32)


def _reference_error(bench: np.ndarray, reference: np.ndarray) -> tuple[float, float, float]:
    """RMSE, max absolute error and cosine of ``reference`` against ``bench`` over the elements finite in both,
    in the dtype of the arrays (float32 serves for float16/bfloat16 references: the benchmark's float32
    rounding is 2^-13 of their unit roundoff or less)."""
    with np.errstate(all="ignore"):
        d = reference - bench
        finite = np.isfinite(d)
        if not finite.all():
            bench, reference, d = bench[finite], reference[finite], d[finite]
        if d.size == 0:
            return 0.0, 0.0, 1.0
        bb, rr = float(np.dot(bench, bench)), float(np.dot(reference, reference))
        if bb > 0 and rr > 0:
            cosine = float(np.dot(reference, bench)) / math.sqrt(bb * rr)
        else:
            cosine = 1.0 if bb == rr else 0.0
        return math.sqrt(float(np.dot(d, d)) / d.size), float(np.abs(d).max()), cosine


def _ratio(error: Optional[float], reference: Optional[float], floor: float) -> float:
    """``error`` over ``reference`` (at least ``floor``); 0 when there is no error, inf when only the tested
    side has one."""
    error = error or 0.0
    denominator = max(reference or 0.0, floor)
    if error == 0.0:
        return 0.0
    return error / denominator if denominator > 0 else math.inf
