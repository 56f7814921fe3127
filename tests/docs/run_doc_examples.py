"""Runs every Python example of one Markdown file, in order, in one namespace (Sybil), in a fresh folder:

    python tests/docs/run_doc_examples.py README.md WORKDIR

Code blocks fenced as ``python`` run; ``<!-- invisible-code-block: python -->`` comments run without being
shown (fixtures, checks); ``<!-- skip: next "reason" -->`` skips the next example and must say why. Prints one
JSON line (examples run, examples skipped with their reasons) and exits with 0 when every example passed.
A subprocess per file keeps each page's process-wide state (the debugger, patches, process groups, DeepSpeed's
globals) away from the others and from the pytest worker."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from unittest import SkipTest

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "support", ROOT / "tests" / "docs", ROOT / "benchmarks"):
    sys.path.insert(0, str(extra))


def parsers():
    """The parsers for the docs' Markdown: Python code blocks, skip and clear-namespace directives."""
    from sybil.parsers.markdown import ClearNamespaceParser, PythonCodeBlockParser, SkipParser
    return [PythonCodeBlockParser(), SkipParser(), ClearNamespaceParser()]


def main(doc: str, workdir: str) -> int:
    from sybil import Sybil
    path = Path(doc).resolve()
    document = Sybil(parsers=parsers()).parse(path)
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    import torch
    torch.set_num_threads(1)
    ran, skipped = [], []
    for example in document:
        try:
            example.evaluate()
        except SkipTest as skip:
            skipped.append({"line": example.line, "reason": str(skip)})
            continue
        except BaseException:
            print(f"{path.name}, line {example.line}: the example failed", file=sys.stderr)
            raise
        if example.parsed is not None and not isinstance(example.parsed, tuple):
            ran.append(example.line)
    print(json.dumps({"ran": ran, "skipped": skipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
