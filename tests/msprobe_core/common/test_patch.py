"""The patch primitive: RemovableHandle semantics (idempotent remove, undo only while still ours, context
manager) and the "never break training" guard around a wrapper's callbacks."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from msprobe_core.common.patch import MARKER, mark, marked, patch, wrap


class Base:
    def run(self, x):
        return x + 1


class Child(Base):
    pass


def test_instance_wrap_calls_around_the_original_and_remove_restores_the_class_method():
    obj, calls = Base(), []
    handle = wrap(obj, "run", before=lambda x: calls.append(("before", x)) or x,
                  after=lambda t, result: calls.append(("after", t)))
    assert "run" in vars(obj) and obj.run(1) == 2
    assert calls == [("before", 1), ("after", 1)]
    handle.remove()
    assert "run" not in vars(obj) and obj.run(1) == 2
    handle.remove()  # idempotent
    assert not handle.active and calls == [("before", 1), ("after", 1)]


def test_after_gets_the_originals_result_and_cannot_change_it():
    obj, seen = Base(), []
    with wrap(obj, "run", before=lambda x: "token", after=lambda token, result: seen.append((token, result)) or 99):
        assert obj.run(1) == 2
    assert seen == [("token", 2)]


def test_one_marker_names_the_patch_and_wrapped_is_the_original():
    handle = wrap(Child, "run", before=lambda *_: None)
    try:
        assert marked(Child.run, "wrap") and not marked(Child.run, "random_patch")
        assert Child.run.__wrapped__ is Base.run
        assert not [name for name in vars(Child.run) if name.startswith("__msprobe") and name != MARKER]
    finally:
        handle.remove()

    def replacement():
        pass

    assert mark(replacement, "api", original=len) is replacement
    assert marked(replacement, "api") and replacement.__wrapped__ is len and not marked(len, "api")


def test_class_patch_of_an_inherited_attribute_is_deleted_again():
    with wrap(Child, "run", after=lambda *_: None) as handle:
        assert "run" in vars(Child) and Child().run(2) == 3
        assert handle.installed
    assert "run" not in vars(Child) and Child.run is Base.run


def test_an_own_attribute_is_put_back():
    module = types.ModuleType("m")
    module.f = original = lambda: "original"
    handle = patch(module, "f", lambda orig: lambda: "patched " + orig())
    assert module.f() == "patched original"
    handle.remove()
    assert module.f is original


def test_remove_leaves_a_patch_made_on_top_and_ours_passes_through():
    obj, seen = Base(), []
    ours = wrap(obj, "run", before=lambda x: seen.append("ours"))
    inner = obj.run
    theirs = lambda x: inner(x) * 10  # e.g. an LR scheduler wrapping optimizer.step after us  # noqa: E731
    obj.run = theirs
    ours.remove()
    assert obj.run is theirs  # their chain is intact...
    assert obj.run(1) == 20 and seen == []  # ...and ours only calls the original now


def test_callback_failures_are_logged_never_raised_but_the_originals_are(caplog):
    obj = Base()

    def boom(*args):
        raise RuntimeError("monitoring failed")

    with caplog.at_level(logging.ERROR, logger="msprobe_core"):
        with wrap(obj, "run", before=boom, after=boom, where="test step"):
            assert obj.run(1) == 2  # training goes on
    assert sum("test step" in r.getMessage() for r in caplog.records) == 2

    def broken(self, x):
        raise ValueError("the user's own error")

    with patch(Base, "run", lambda orig: broken), wrap(obj, "run", before=lambda x: None):
        with pytest.raises(ValueError, match="user's own"):
            obj.run(1)


def test_unguarded_callbacks_raise():
    with wrap(Base(), "run", before=lambda x: 1 / 0, guard=False) as handle:
        with pytest.raises(ZeroDivisionError):
            handle.owner.run(1)


def test_a_torch_module_instance_method_is_patched_without_registering_anything():
    model = torch.nn.Linear(2, 2)
    calls = []
    with wrap(model, "forward", before=lambda x: calls.append(x.shape)):
        model(torch.ones(1, 2))
    assert calls == [torch.Size([1, 2])]
    assert "forward" not in vars(model) and not list(model._modules)
