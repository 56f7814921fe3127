"""TEST STAND-IN for Megatron-LM's ``megatron.training`` -- used only by the launcher tests.

Megatron-LM's ``megatron.training`` is not installable here (PyPI's megatron-core wheel ships only
``megatron.core``). The launcher (``python -m msprobe_integrations.megatron``) patches
``megatron.training.training.train_step`` / ``setup_model_and_optimizer`` and
``megatron.training.arguments.parse_args``, so its test needs functions at those dotted paths. This
package maps them onto ``recipes/megatron_core_gpt.py`` (a Megatron-LM-shaped loop on real megatron-core
with the same names and signatures): ``megatron.training.training``, ``.arguments`` and ``.global_vars``
are that module. It is put on ``PYTHONPATH`` only by the launcher tests
(``tests/msprobe_integrations/megatron``); ``megatron`` is a namespace package, so ``megatron.core`` still
comes from the installed megatron-core.
"""

import os
import sys

_RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "..", "recipes")
if os.path.abspath(_RECIPES) not in sys.path:
    sys.path.insert(0, os.path.abspath(_RECIPES))

import megatron_core_gpt as _impl  # noqa: E402

training = arguments = global_vars = _impl
for _name in ("training", "arguments", "global_vars"):
    sys.modules[f"{__name__}.{_name}"] = _impl

get_args = _impl.get_args
pretrain = _impl.pretrain
print_rank_0 = _impl.print_rank_0
