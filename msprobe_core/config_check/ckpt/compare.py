"""``config_check --compare CKPT_A CKPT_B -o ckpt_similarity.json``: per parameter L2 and cosine.

Both checkpoints are opened lazily (``layout.open_checkpoint``); when their names hardly match, one side
is renamed with the Megatron -> Hugging Face rules (``mapping``). Parameters are then compared one at a
time in the first checkpoint's order (a progress bar on stderr), so memory holds one parameter per side.
The output is ``{name: {"l2", "cos", "numel", "shape"}}`` (the seed's format), with a ``note`` where a
parameter exists on one side only, shapes differ (embeddings padded to different vocabulary sizes are
compared on their common rows), values are not finite, or shards were merged by a guess. An existing
output file is an error; the file is written atomically.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Optional

from msprobe_core.config_check.ckpt.layout import open_checkpoint
from msprobe_core.config_check.ckpt.mapping import align_names, load_rules, overlap
from msprobe_core.config_check.ckpt.metrics import similarity
from msprobe_core.config_check.ckpt.source import Entry
from msprobe_core.config_check.exceptions import PackPathError

logger = logging.getLogger("msprobe_core.config_check")
DEFAULT_OUTPUT = "./ckpt_similarity.json"
_VOCAB = re.compile(r"word_embeddings|embed_tokens|output_layer|lm_head|wte")


def _finite(value: Optional[float]) -> Optional[float]:
    return value if value is not None and math.isfinite(value) else None


def compare_entries(name: str, a: Optional[Entry], b: Optional[Entry], path_a: str, path_b: str) -> dict[str, Any]:
    """One parameter's record."""
    ref = a or b
    record: dict[str, Any] = {"l2": None, "cos": None, "numel": ref.numel, "shape": list(ref.shape)}
    notes = [e.note for e in (a, b) if e is not None and e.note]
    if a is None or b is None:
        notes.append(f"only in {path_a if b is None else path_b}")
    else:
        ta, tb = a.load(), b.load()
        if tuple(ta.shape) != tuple(tb.shape):
            if _VOCAB.search(name) and ta.shape[1:] == tb.shape[1:]:
                rows = min(ta.shape[0], tb.shape[0])
                notes.append(f"vocabulary padding differs ({ta.shape[0]} vs {tb.shape[0]} rows): first {rows} compared")
                ta, tb = ta[:rows], tb[:rows]
            else:
                notes.append(f"shape differs: {list(ta.shape)} vs {list(tb.shape)}")
                ta = tb = None
        if ta is not None:
            l2, cos = similarity(ta, tb)
            record["l2"], record["cos"] = _finite(l2), _finite(cos)
            if record["l2"] is None:
                notes.append("NaN or Inf in the values")
        del ta, tb
    if notes:
        record["note"] = "; ".join(notes)
    return record


def _write_new(path: Path, text: str) -> None:
    """Write ``path`` atomically and only if it does not exist (a hard link cannot replace a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise PackPathError(f"output '{path}' appeared while comparing; it is not overwritten") from None
    finally:
        tmp.unlink()


def compare_checkpoints(path_a: str | os.PathLike, path_b: str | os.PathLike,
                        output: str | os.PathLike = DEFAULT_OUTPUT, mapping: Optional[str] = None,
                        progress: bool = True) -> dict[str, dict[str, Any]]:
    """Compare two checkpoints into ``output`` (JSON); returns the records."""
    out = Path(output)
    if out.exists():
        raise PackPathError(f"output '{out}' already exists; it is not overwritten: remove it or choose another path")
    a, b = open_checkpoint(path_a), open_checkpoint(path_b)
    a, b = align_names(a, b, load_rules(mapping))
    for ckpt in (a, b):
        logger.info("%s: %s checkpoint, %d parameters", ckpt.path, ckpt.kind, len(ckpt.entries))
        for note in ckpt.notes:
            logger.warning("%s: %s", ckpt.path, note)
    if overlap(a, b) < 0.5:
        logger.warning("the two checkpoints share few parameter names (%.0f%%): are they the same model? "
                       "(--name-mapping gives renaming rules)", 100 * overlap(a, b))
    names = list(a.entries) + [n for n in b.entries if n not in a.entries]
    from tqdm import tqdm

    result = {}
    for name in tqdm(names, desc="ckpt compare", unit="param", disable=not progress):
        result[name] = compare_entries(name, a.entries.get(name), b.entries.get(name), a.path, b.path)
    _write_new(out, json.dumps(result, indent=2) + "\n")
    return result
