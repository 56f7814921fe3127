"""StepHooks: torch hook handles held as (hook dict, id) pairs remove exactly their own hooks."""

from collections import OrderedDict

import pytest
import torch
from torch.utils.hooks import RemovableHandle

from msprobe_core.pytorch import step_hooks
from msprobe_core.pytorch.step_hooks import HookPlan, StepHooks
from msprobe_core.stats.kernel import KERNEL

_remove_c = getattr(KERNEL, "remove_hooks", None)
_valid_c = getattr(KERNEL, "plan_valid", None)
_hooks_c = getattr(KERNEL, "tensor_hooks", None)


@pytest.fixture(autouse=True, params=["c", "python"])
def route(request, monkeypatch):
    """Every test on both routes of ``StepHooks.remove``, ``StepHooks.tensor_hooks`` and ``HookPlan.still_valid``:
    the kernel's ``remove_hooks``, ``tensor_hooks`` and ``plan_valid``, and the Python loops."""
    if request.param == "c" and _remove_c is None:
        pytest.skip("the C kernel is not built")
    monkeypatch.setattr(step_hooks, "_remove_fast", _remove_c if request.param == "c" else None)
    monkeypatch.setattr(step_hooks, "_valid_fast", _valid_c if request.param == "c" else None)
    monkeypatch.setattr(step_hooks, "_hooks_fast", _hooks_c if request.param == "c" else None)
    return request.param


def test_remove_deletes_only_the_kept_hooks():
    calls = []
    w = torch.ones(3, requires_grad=True)
    y = (w * 2).sum()
    hooks = StepHooks()
    assert not hooks
    hooks.keep(w.register_hook(lambda g: calls.append("ours leaf")))
    hooks.keep(y.grad_fn.register_hook(lambda gi, go: calls.append("ours node")))
    w.register_hook(lambda g: calls.append("user leaf"))      # the user's own hooks stay
    y.grad_fn.register_hook(lambda gi, go: calls.append("user node"))
    assert hooks
    hooks.remove()
    assert not hooks
    y.backward()
    assert sorted(calls) == ["user leaf", "user node"]
    hooks.remove()  # nothing left: a second remove is harmless


def test_module_hooks_with_extra_dicts():
    calls = []
    m = torch.nn.Linear(2, 2)
    hooks = StepHooks()
    hooks.keep(m.register_forward_pre_hook(lambda mod, a, k: calls.append("pre"), with_kwargs=True))
    hooks.keep(m.register_forward_hook(lambda mod, a, k, o: calls.append("post"), with_kwargs=True))
    m(torch.ones(2))
    assert calls == ["pre", "post"]
    hooks.remove()
    m(torch.ones(2))
    assert calls == ["pre", "post"]
    assert not m._forward_pre_hooks and not m._forward_pre_hooks_with_kwargs
    assert not m._forward_hooks and not m._forward_hooks_with_kwargs


def test_tensor_hooks_puts_in_plain_tensors_hooks_and_hands_on_the_others():
    class Sub(torch.Tensor):
        pass

    plain = torch.nn.Parameter(torch.ones(2))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    sub = torch.ones(2).as_subclass(Sub).requires_grad_()
    seen, others = [], []
    hooks = StepHooks()
    hooks.tensor_hooks([(plain, seen.append), (frozen, seen.append), (sub, seen.append)],
                       lambda t, hook: others.append(t))
    assert others == [sub] and frozen._backward_hooks is None
    assert list(plain._backward_hooks.values()) == [seen.append]  # as register_hook puts it
    (plain * 2).sum().backward()
    assert len(seen) == 1
    hooks.remove()
    assert not plain._backward_hooks and not hooks


def test_tensor_hooks_takes_the_keys_register_hook_takes():
    """Keys in order from ``RemovableHandle.next_id`` on, also where ``other`` registers hooks in between (the
    counter moved on as torch moves it); a non-leaf tensor's new hook dict goes to its ``grad_fn``."""
    class Sub(torch.Tensor):
        pass

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    mid = (torch.ones(2, requires_grad=True) * 3)  # a plain non-leaf tensor
    sub = torch.ones(2).as_subclass(Sub).requires_grad_()
    seen = []
    hooks = StepHooks()
    start = RemovableHandle.next_id
    hooks.tensor_hooks([(a, seen.append), (sub, seen.append), (mid, seen.append), (b, seen.append)],
                       lambda t, hook: hooks.keep(t.register_hook(hook)))
    assert [list(t._backward_hooks) for t in (a, sub, mid, b)] == [[start], [start + 1], [start + 2], [start + 3]]
    assert RemovableHandle.next_id == start + 4
    (a.sum() + sub.sum() + mid.sum() + b.sum()).backward()
    assert len(seen) == 4
    hooks.remove()
    assert not a._backward_hooks and not sub._backward_hooks and not mid._backward_hooks and not b._backward_hooks


def test_tensor_hooks_leaves_the_counter_as_other_left_it_when_it_raises():
    """An error of ``other`` goes to the caller, ``RemovableHandle.next_id`` past every key taken (ours and its)."""
    class Sub(torch.Tensor):
        pass

    def other(t, hook):
        t.register_hook(hook)
        raise ValueError("refused")

    a = torch.nn.Parameter(torch.ones(2))
    sub = torch.ones(2).as_subclass(Sub).requires_grad_()
    start = RemovableHandle.next_id
    with pytest.raises(ValueError, match="refused"):
        StepHooks().tensor_hooks([(a, print), (sub, print), (torch.nn.Parameter(torch.ones(2)), print)], other)
    assert list(a._backward_hooks) == [start] and list(sub._backward_hooks) == [start + 1]
    assert RemovableHandle.next_id == start + 2


@pytest.mark.skipif(_hooks_c is None, reason="the C kernel is not built")
def test_tensor_hooks_refuses_malformed_pairs_and_moves_the_counter_on():
    """A pair that is no (tensor, hook) tuple raises; the keys taken before it stay taken."""
    a = torch.nn.Parameter(torch.ones(2))
    flat = []
    start = RemovableHandle.next_id
    with pytest.raises(TypeError):
        _hooks_c(flat, [(a, print), [a, print]], None, torch.Tensor, torch.nn.Parameter, RemovableHandle, OrderedDict)
    assert flat == [start, 1, a._backward_hooks] and RemovableHandle.next_id == start + 1


def test_remove_pops_from_dict_subclasses_and_skips_dead_refs():
    """A dict of another type is emptied through its own ``pop``; a dead weak reference (None) is skipped."""
    class Popper(dict):
        def pop(self, key, default=None):
            popped.append(key)
            return super().pop(key, default)

    popped = []
    plain, ordered, odd = {1: "a", 2: "b"}, OrderedDict([(1, "a"), (3, "c")]), Popper({1: "a"})
    hooks = StepHooks()
    hooks.keep_keys([1, 4, plain, ordered, odd, None, 3, 1, ordered, 5, 1, plain])
    hooks.remove()
    assert plain == {2: "b"} and list(ordered.items()) == [] and odd == {} and popped == [1]
    assert not hooks


@pytest.mark.skipif(_remove_c is None, reason="the C kernel is not built")
@pytest.mark.parametrize("flat", [[1], [1, -1, {}], [1, "x", {}], (1, 1, {})])
def test_remove_hooks_refuses_malformed_lists(flat):
    """The kernel's loop raises on a list ``StepHooks`` never makes (no crash)."""
    with pytest.raises((IndexError, ValueError, TypeError)):
        _remove_c(flat)


def _sealed(root: torch.nn.Module) -> HookPlan:
    plan = HookPlan("")
    plan.seal(root, list(root.modules()))
    return plan


class _Other(torch.nn.Linear):
    pass


@pytest.mark.parametrize("change, valid", [
    (lambda m: None, True),
    (lambda m: m.__setitem__(1, torch.nn.ReLU()), False),                        # a child replaced
    (lambda m: m.add_module("extra", torch.nn.ReLU()), False),                     # a child added
    (lambda m: setattr(m[0], "bias", torch.nn.Parameter(torch.ones(2))), False),  # a parameter replaced
    (lambda m: m[0].register_parameter("bias", None), False),                     # a parameter unset
    (lambda m: setattr(m[0], "__class__", _Other), False),                        # a class changed
    (lambda m: setattr(m[0], "_compiled_call_impl", m[0].forward), False),        # compiled
    (lambda m: m.train(False), True),                                              # not part of the plan
])
def test_still_valid_sees_every_change_of_the_model(change, valid):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.GELU())
    plan = _sealed(model)
    change(model)
    assert plan.still_valid(model) is valid


@pytest.mark.parametrize("valid", [True, False])
def test_still_valid_of_odd_module_dicts_is_the_python_loops(valid):
    """A module whose ``_modules`` is no plain dict (or has a key that is no str) is decided by the Python loop."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model._modules = OrderedDict(model._modules)
    plan = _sealed(model)
    if _valid_c is not None:
        assert _valid_c(model, plan.modules) is None
    if not valid:
        model._modules["1"] = torch.nn.ReLU()
    assert plan.still_valid(model) is valid
