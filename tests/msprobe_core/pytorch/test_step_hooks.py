"""StepHooks: torch hook handles held as (hook dict, id) pairs remove exactly their own hooks."""

import torch

from msprobe_core.pytorch.step_hooks import StepHooks


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
