"""``python -m msprobe_core parse RANK_DIR RECORD_NAME [--json]``.

Prints, as ptdbg_ascend's ``parse`` did, a record's tensors (dtype, shape, Max/Min/Mean/Norm; recomputed
from its tensor files when the dump has them, with NaN/Inf counts), its stack and its parent chain. The
name of one tensor (``Functional.linear.0.forward.input.0``) shows that tensor's record. A name that is not
in the dump is an error listing the nearest names.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from msprobe_core.dumpdir.layout import discover
from msprobe_core.dumpdir.rank_dump import RankDump, data_file, load_rank_dump
from msprobe_core.dumpdir.record_info import nearest_names, parent_chain, record_stack, tensor_file_summary
from msprobe_core.dumpdir.record_leaves import flatten_record
from msprobe_core.errors import DumpInputError

STATS = ("Max", "Min", "Mean", "Norm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the parse arguments to ``parser``."""
    parser.add_argument("rank_dir", metavar="RANK_DIR", help="a rank folder (step0/rank0) or its dump.json")
    parser.add_argument("record", metavar="RECORD_NAME",
                        help="a record name (Functional.relu.0.forward, Module.conv1.Conv2d.forward.0) or one "
                             "tensor's name (Functional.relu.0.forward.input.0)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def load_single_rank(path: str) -> RankDump:
    """The rank folder ``path`` names (a step or dump folder must hold exactly one)."""
    _, units = discover(Path(path))
    if len(units) != 1:
        listed = ", ".join(str(u.path) for u in units[:6]) + (" ..." if len(units) > 6 else "")
        raise DumpInputError(f"{path}: holds {len(units)} rank folders ({listed}); give one of them")
    return load_rank_dump(units[0].path)


def resolve(dump: RankDump, name: str) -> tuple[str, Optional[str]]:
    """``(record, tensor path or None)`` for a record or tensor name; ``DumpInputError`` with the nearest names."""
    if name in dump.data:
        return name, None
    cut = len(name)
    while (cut := name.rfind(".", 0, cut)) > 0:
        if name[:cut] in dump.data:
            return name[:cut], name[cut + 1:]
    dotted = name.replace("_", ".")  # ptdbg's names: Functional_conv2d_0_forward
    if dotted in dump.data:
        return dotted, None
    near = nearest_names(name, list(dump.data))
    hint = ("; nearest: " + ", ".join(near)) if near else ""
    raise DumpInputError(f"no record '{name}' in {dump.json_path} ({len(dump.data)} records){hint}")


def record_summary(dump: RankDump, record: str, only: Optional[str] = None) -> dict[str, Any]:
    """Everything ``parse`` shows about ``record`` (one tensor of it when ``only`` is given)."""
    tensor_dir = dump.tensor_dir
    tensors = []
    for leaf in flatten_record(dump.data[record]):
        if only is not None and leaf.path != only and not leaf.path.startswith(only + "."):
            continue
        entry: dict[str, Any] = {"name": f"{record}.{leaf.path}" if leaf.path else record}
        s = leaf.summary
        if leaf.is_tensor:
            entry.update(dtype=s.get("dtype"), shape=s.get("shape"), **{k: s.get(k) for k in STATS})
            for key in ("md5", "data_name"):
                if s.get(key):
                    entry[key] = s[key]
            file = data_file(s, tensor_dir)
            if file:
                entry["from_file"] = tensor_file_summary(file)
        else:
            entry.update(type=s.get("type"), value=s.get("value"))
        tensors.append(entry)
    if only is not None and not tensors:
        paths = [leaf.path for leaf in flatten_record(dump.data[record])]
        raise DumpInputError(f"record '{record}' has no tensor '{only}'; it has: {', '.join(paths) or 'none'}")
    stack, note = record_stack(dump, record)
    return {"record": record, "rank_dir": str(dump.path), "tensors": tensors, "stack": stack, "stack_note": note,
            "parent_chain": parent_chain(record, dump.construct)}


def _fmt(value: Any) -> str:
    return f"{value:.8g}" if isinstance(value, float) else str(value)


def summary_text(info: dict[str, Any]) -> str:
    """ptdbg's layout: ``Statistic Info:`` one line per tensor, then the parent chain and ``Trace back``."""
    lines = ["Statistic Info:"]
    for t in info["tensors"]:
        if "dtype" in t:
            parts = [t["name"], f"dtype: {t['dtype']}", f"shape: {t['shape']}"]
            parts += [f"{k.lower()}: {_fmt(t[k])}" for k in STATS if t.get(k) is not None]
            parts += [f"{k}: {t[k]}" for k in ("md5", "data_name") if k in t]
            lines.append("  " + "".join(f"[{p}]" for p in parts))
            f = t.get("from_file")
            if f:
                stats = " ".join(f"{k.lower()}={_fmt(f[k])}" for k in STATS if k in f)
                lines.append(f"    from file: {stats} nan={f['nan']} inf={f['inf']} numel={f['numel']}")
        else:
            lines.append(f"  [{t['name']}][type: {t['type']}][value: {t['value']}]")
    chain = info["parent_chain"]
    lines.append("Parent chain: " + (" < ".join(chain) if chain else "none (a top-level call)"))
    note = f", {info['stack_note']}" if info["stack_note"] else ""
    if info["stack"]:
        lines.append(f"Trace back({info['record']}{note}):")
        for frame in info["stack"]:
            lines.extend(f"  {part.strip()}" for part in str(frame).splitlines() if part.strip())
    else:
        lines.append("Trace back: stack.json has no stack for this record")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the record; 2 (raised as DumpInputError) when it is not in the dump."""
    dump = load_single_rank(args.rank_dir)
    record, only = resolve(dump, args.record)
    info = record_summary(dump, record, only)
    print(json.dumps(info, indent=1, default=str) if args.json else summary_text(info))
    return 0
