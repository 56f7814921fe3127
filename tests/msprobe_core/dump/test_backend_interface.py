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


def test_the_service_is_a_composition_of_its_parts():
    """``CallRecords`` and ``UserApi`` are parts the service holds (given the service at construction, typed),
    not base classes that read attributes they never define."""
    from msprobe_core.dump.call_records import CallRecords
    from msprobe_core.dump.user_api import UserApi

    assert DumpServiceBase.__bases__ == (DumpBackend,)
    for part in (CallRecords, UserApi):
        assert part not in DumpServiceBase.__mro__
        params = inspect.signature(part.__init__).parameters
        assert params["service"].annotation == "DumpHost", part  # (postponed annotations: names)
        assert params["backend"].annotation == "DumpBackend", part
    assert inspect.signature(UserApi.__init__).parameters["records"].annotation == "CallRecords"


def test_the_pytorch_service_holds_its_parts_bound_to_it(tmp_path):
    from msprobe_core.dump.config import load_dump_config
    from msprobe_core.pytorch.dump_service import DumpService

    svc = DumpService(load_dump_config({"task": "statistics", "level": "mix", "dump_path": str(tmp_path)}))
    assert svc.records.service is svc.records.backend is svc and svc.user_api.records is svc.records
    assert svc.records.patcher is svc.patcher is not None
    assert svc._on_api_call == svc.records.on_api_call  # what the API patcher calls


def test_the_service_offers_every_member_of_the_host_protocol(tmp_path):
    """``dump.host.DumpHost`` is what the parts use of the service: the service has each of them."""
    from msprobe_core.dump.config import load_dump_config
    from msprobe_core.dump.host import DumpHost
    from msprobe_core.pytorch.dump_service import DumpService

    members = set(DumpHost.__annotations__) | {n for n, v in vars(DumpHost).items()
                                               if inspect.isfunction(v) or isinstance(v, property)}
    assert {"recorder", "dumping_thread", "_open_step", "_end", "collecting"} <= members
    svc = DumpService(load_dump_config({"task": "statistics", "level": "L1", "dump_path": str(tmp_path)}))
    assert [m for m in sorted(members) if not hasattr(svc, m)] == []
