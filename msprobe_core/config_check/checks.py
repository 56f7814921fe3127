"""The six checks of a pack comparison; each returns a ``CheckResult`` with only the differing items.

Pass rules (a row's ``level`` is ``error`` or ``info``; a check fails on any error row):

- env: a recorded variable (launcher-exported ones included) that differs, an unset one counting as its
  default; machine-specific paths and endpoints (``resource/env.yaml``'s ``info``) are information.
- pip: a package of ``resource/dependency.yaml`` (torch, numpy, transformers, megatron-core, ...) or the
  Python version that differs; other packages are information.
- hyperparameters: a setting, matched across spellings and compared by meaning (``values``), that
  differs or is set on one side only; output folders, ports and run names are information.
- weights: a parameter whose hash differs at a rank's first recorded micro-step (the initial weights);
  differences at later micro-steps follow from training (learning rate, data) and are information.
- dataset: a forward input whose hash differs at any recorded micro-step of any rank.
- random: information only: call sites whose count or seed differs, or that one run has and the other not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from msprobe_core.config_check import pack
from msprobe_core.config_check.environment import env_default, env_is_info, relevant_packages
from msprobe_core.config_check.pack import PackFolder
from msprobe_core.config_check.values import canonical_name, informational_names, same_value

ERROR, INFO = "error", "info"
PASS, FAIL, INFORMATION, SKIPPED = "pass", "fail", "info", "skipped"
MISSING = "(missing)"


@dataclass
class CheckResult:
    """One check's outcome: status, a note for the summary, and its differing items."""

    name: str
    status: str
    header: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    note: str = ""

    @property
    def errors(self) -> int:
        level = self.header.index("level") if "level" in self.header else None
        return sum(1 for r in self.rows if level is not None and r[level] == ERROR)


def _finish(name: str, header: list[str], rows: list[list[Any]], note: str = "") -> CheckResult:
    result = CheckResult(name, PASS, header, rows, note)
    result.status = FAIL if result.errors else PASS
    infos = len(rows) - result.errors
    if infos and not result.note:
        result.note = f"{infos} difference(s) shown as information"
    return result


def _presence(name: str, header: list[str], bench: Any, cmp: Any) -> Optional[CheckResult]:
    """A result when one or both packs lack the check's data (None when both have it)."""
    if bench is None and cmp is None:
        return CheckResult(name, SKIPPED, header, note="collected by neither run")
    if bench is None or cmp is None:
        side = "bench" if bench is None else "cmp"
        return CheckResult(name, FAIL, header, note=f"collected only by one run ({side} has none)")
    return None


# ------------------------------------------------------------------------------------------ env / pip
def check_env(bench: PackFolder, cmp: PackFolder) -> CheckResult:
    header = ["source", "variable", "bench", "cmp", "level"]
    b, c = bench.read(pack.ENV), cmp.read(pack.ENV)
    early = _presence("env", header, b, c)
    if early:
        return early
    rows = []
    for source in ("process", "script"):
        bv, cv = b.get(source) or {}, c.get(source) or {}
        for name in sorted(set(bv) | set(cv)):
            x = bv.get(name, env_default(name))
            y = cv.get(name, env_default(name))
            if x != y:
                rows.append([source, name, MISSING if x is None else x, MISSING if y is None else y,
                             INFO if env_is_info(name) else ERROR])
    return _finish("env", header, rows)


def check_pip(bench: PackFolder, cmp: PackFolder) -> CheckResult:
    header = ["package", "bench", "cmp", "level"]
    b, c = bench.read(pack.PIP), cmp.read(pack.PIP)
    early = _presence("pip", header, b, c)
    if early:
        return early
    rows = []
    if b.get("python") != c.get("python"):
        rows.append(["python", b.get("python"), c.get("python"), ERROR])
    relevant = relevant_packages()
    bp, cp = b.get("packages") or {}, c.get("packages") or {}
    for name in sorted(set(bp) | set(cp)):
        if bp.get(name) != cp.get(name):
            rows.append([name, bp.get(name, MISSING), cp.get(name, MISSING), ERROR if name in relevant else INFO])
    return _finish("pip", header, rows)


# ------------------------------------------------------------------------------------------ hyperparameters
def comparable_hyperparameters(doc: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """``{canonical name: (value, "section.key")}`` from a hyperparameters document; earlier sections
    (Megatron's arguments, integrations) win over launch scripts, which win over config files."""
    sections = (doc.get("config_check") or {}).get("sections") or []
    out: dict[str, tuple[Any, str]] = {}
    for section in sections:
        content = doc.get(section)
        if not isinstance(content, dict):
            continue
        for key, value in content.items():
            out.setdefault(canonical_name(key), (value, f"{section}.{key}"))
    return out


def check_hyperparameters(bench: PackFolder, cmp: PackFolder) -> CheckResult:
    header = ["name", "bench", "cmp", "bench origin", "cmp origin", "level"]
    b, c = bench.read(pack.HYPERPARAMETERS), cmp.read(pack.HYPERPARAMETERS)
    early = _presence("hyperparameters", header, b, c)
    if early:
        return early
    bv, cv = comparable_hyperparameters(b), comparable_hyperparameters(c)
    if not bv and not cv:
        return CheckResult("hyperparameters", SKIPPED, header, note="no hyperparameters in either run")
    info = informational_names()
    rows = []
    for name in sorted(set(bv) | set(cv)):
        x, y = bv.get(name), cv.get(name)
        if x is not None and y is not None and same_value(x[0], y[0]):
            continue
        rows.append([name, MISSING if x is None else cell_value(x[0]), MISSING if y is None else cell_value(y[0]),
                     x[1] if x else "", y[1] if y else "", INFO if name in info else ERROR])
    unparsed = sum(len((d.get("config_check") or {}).get("unparsed") or []) for d in (b, c))
    note = f"{unparsed} script line(s) not parsed: see config_check.unparsed in bench|cmp/hyperparameters.json" \
        if unparsed else ""
    return _finish("hyperparameters", header, rows, note)


def cell_value(value: Any) -> Any:
    """A value a spreadsheet cell holds as is (lists and dicts become their text)."""
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


# ------------------------------------------------------------------------------------------ weights / dataset
def _stats(entry: Optional[dict[str, Any]]) -> list[Any]:
    if entry is None:
        return [MISSING, "", "", "", "", ""]
    if "value" in entry:
        return [entry["value"], "", "", "", "", ""]
    return [entry.get("hash"), entry.get("max"), entry.get("min"), entry.get("mean"), entry.get("norm"),
            f"{entry.get('dtype')}{entry.get('shape')}"]


def _same(x: Optional[dict[str, Any]], y: Optional[dict[str, Any]]) -> bool:
    if x is None or y is None:
        return x is y
    if "value" in x or "value" in y:
        return x.get("value") == y.get("value") and "value" in x and "value" in y
    return x.get("hash") == y.get("hash") and x.get("shape") == y.get("shape") and x.get("dtype") == y.get("dtype")


def _recorded(p: PackFolder, member: str) -> Optional[bool]:
    """True when some rank recorded ``member`` at some step, else None (not collected)."""
    return True if any((p.root / pack.step_member(r, s, member)).is_file() for r in p.ranks() for s in p.steps(r)) \
        else None


def _per_step(name: str, member: str, bench: PackFolder, cmp: PackFolder,
              level_of: Callable[[int, int], str]) -> CheckResult:
    what = "parameter" if member == pack.WEIGHTS else "input"
    columns = ("hash", "max", "min", "mean", "norm", "dtype/shape")
    header = ["rank", "step", what, "level"] + [f"bench {c}" for c in columns] + [f"cmp {c}" for c in columns]
    early = _presence(name, header, _recorded(bench, member), _recorded(cmp, member))
    if early:
        return early
    rows = []
    for rank in sorted(set(bench.ranks()) | set(cmp.ranks())):
        steps = sorted(set(bench.steps(rank)) | set(cmp.steps(rank)))
        for step in steps:
            level = level_of(step, steps[0])
            b = bench.read(pack.step_member(rank, step, member))
            c = cmp.read(pack.step_member(rank, step, member))
            if b is None or c is None:
                side = "bench" if b is None else "cmp"
                rows.append([rank, step, f"(rank {rank} step {step} not recorded by {side})", level] + [""] * 12)
                continue
            for key in list(b) + [k for k in c if k not in b]:
                if not _same(b.get(key), c.get(key)):
                    rows.append([rank, step, key, level] + _stats(b.get(key)) + _stats(c.get(key)))
    return _finish(name, header, rows)


def check_weights(bench: PackFolder, cmp: PackFolder) -> CheckResult:
    return _per_step("weights", pack.WEIGHTS, bench, cmp, lambda step, first: ERROR if step == first else INFO)


def check_dataset(bench: PackFolder, cmp: PackFolder) -> CheckResult:
    return _per_step("dataset", pack.DATASET, bench, cmp, lambda step, first: ERROR)


# ------------------------------------------------------------------------------------------ random
def check_random(bench: PackFolder, cmp: PackFolder) -> CheckResult:
    header = ["rank", "step", "api", "call site", "bench count", "cmp count", "bench seeds", "cmp seeds", "stack"]

    def calls(p: PackFolder) -> Optional[dict[tuple, dict[str, Any]]]:
        found = None
        for rank in p.ranks():
            entries = p.read(pack.rank_member(rank, pack.RANDOM))
            if entries is None:
                continue
            found = found or {}
            for e in entries:
                found[(rank, str(e.get("step")), e.get("api"), e.get("location"))] = e
        return found

    b, c = calls(bench), calls(cmp)
    if b is None and c is None:
        return CheckResult("random", SKIPPED, header, note="collected by neither run (ConfigChecker.apply_patches)")
    b, c = b or {}, c or {}
    rows = []
    for key in list(b) + [k for k in c if k not in b]:
        x, y = b.get(key), c.get(key)
        if x and y and x.get("count") == y.get("count") and x.get("seeds") == y.get("seeds"):
            continue
        stack = (x or y).get("stack") or []
        rows.append([key[0], key[1], key[2], key[3], x.get("count") if x else 0, y.get("count") if y else 0,
                     ", ".join(x.get("seeds") or []) if x else "", ", ".join(y.get("seeds") or []) if y else "",
                     "\n".join(stack[:8])])
    return CheckResult("random", INFORMATION, header, rows,
                       f"{len(rows)} call site(s) differ" if rows else "same call sites and counts")


CHECKS: tuple[Callable[[PackFolder, PackFolder], CheckResult], ...] = (
    check_env, check_pip, check_hyperparameters, check_weights, check_dataset, check_random)


def run_checks(bench: PackFolder, cmp: PackFolder) -> list[CheckResult]:
    """Every check, in the summary's order."""
    return [check(bench, cmp) for check in CHECKS]


def overall_pass(results: Iterable[CheckResult]) -> bool:
    """True when no check failed (random is information, skipped checks do not fail)."""
    return all(r.status != FAIL for r in results)
