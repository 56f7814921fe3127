"""Every Python example of README.md and docs/ runs (Sybil), and the site builds with ``mkdocs build --strict``.

One test per Markdown file: ``run_doc_examples.py`` evaluates its examples in order in a subprocess, in a fresh
folder. Why Sybil: docs/contributing.md."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sybil", reason="the docs' examples run in .venv, which requirements/docs.txt completes "
                                   "(make venv); a venv without it (make test-oldest) leaves them out")

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("run_doc_examples.py")
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^\s*```+\s*([\w+-]*)", re.M)
SKIP = re.compile(r"<!--\s*skip:\s*(\w+)(.*?)-->", re.S)


def has_examples(path: Path) -> bool:
    text = path.read_text(encoding="utf-8")
    return "```python" in text or "invisible-code-block: python" in text


EXAMPLE_PAGES = [p for p in PAGES if has_examples(p)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_python_example_is_seen_and_every_skip_says_why():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for action, reason in SKIP.findall(text):
            assert action != "next" or re.search(r'"[^"]{10,}"', reason), \
                f"{page_id(page)}: every 'skip: next' says why, as skip: next \"reason\""
        odd = {lang for lang in FENCE.findall(text) if lang.lower() in ("py", "python3", "pycon", "ipython")}
        assert not odd, f"{page_id(page)}: fence Python examples as ```python so that they run (found {odd})"
    assert ROOT / "README.md" in EXAMPLE_PAGES


@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=page_id)
def test_examples_of_the_page_run(page, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               MONITOR_OUTPUT_DIR=str(tmp_path / "work" / "monitor_output"))
    proc = subprocess.run([sys.executable, str(RUNNER), str(page), str(tmp_path / "work")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ran"] or summary["skipped"], f"{page_id(page)}: Sybil found no example"


def test_the_readme_stays_short():
    """README.md is the short door (what, the two commands, install, quick starts, links); the rest is in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move the detail into a page of docs/"


def test_the_readme_links_point_at_files():
    """mkdocs checks the links of docs/; README.md is outside it, so its relative links are checked here."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert targets and not missing, f"README.md links to missing files: {missing}"
