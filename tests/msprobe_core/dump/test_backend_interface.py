"""The dump's framework back-end is one documented interface (``msprobe_core.dump.backend.DumpBackend``): both
back-ends provide every required method, and what else they override of the shared service is one of its
documented override points. Read from the source (``ast``), so MindSpore need not be installed."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from msprobe_core.dump.backend import DumpBackend
from msprobe_core.dump.service import DumpServiceBase

ROOT = Path(__file__).resolve().parents[3]
BACKENDS = ("msprobe_core/pytorch/dump_service.py", "msprobe_core/mindspore/dump_service.py")
OVERRIDE_POINTS = {"should_record", "_may_record_exclusive", "_end", "_finish_step"}
"""The shared code's methods a back-end may extend (named in ``dump.backend``'s docstring)."""


def _members(path: str) -> set[str]:
    """The methods and class attributes of the back-end's ``DumpService`` class."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DumpService")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return names


def test_the_interface_names_every_framework_method_and_documents_it():
    required = DumpBackend.__abstractmethods__
    assert {"_is_model", "_named_modules", "_hook_param_grad", "_quiet", "_capture_stack"} <= required
    for name, member in vars(DumpBackend).items():
        if inspect.isfunction(member):
            assert member.__doc__, name
    assert inspect.isabstract(DumpServiceBase)


def test_both_backends_provide_every_required_method():
    for path in BACKENDS:
        missing = sorted(DumpBackend.__abstractmethods__ - _members(path))
        assert missing == [], (path, missing)


def test_a_backend_overrides_only_the_interface_and_the_documented_points():
    interface = {n for n in vars(DumpBackend) if not n.startswith("__")}
    shared = {n for cls in DumpServiceBase.__mro__ if cls is not DumpBackend for n in vars(cls)
              if not n.startswith("__")} - interface
    for path in BACKENDS:
        stray = sorted((_members(path) & shared) - OVERRIDE_POINTS)
        assert stray == [], (path, stray)


def test_the_pytorch_backend_is_complete():
    from msprobe_core.pytorch.dump_service import DumpService

    assert not inspect.isabstract(DumpService)
