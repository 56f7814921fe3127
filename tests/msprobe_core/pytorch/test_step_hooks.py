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


def test_a_handle_with_extra_dicts_is_removed_by_itself():
    removed = []

    class Handle:
        extra_dict_ref = (object(),)

        def remove(self):
            removed.append(self)

    hooks = StepHooks()
    h = Handle()
    hooks.keep(h)
    hooks.remove()
    assert removed == [h]
