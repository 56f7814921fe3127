"""msprobe_core: framework-agnostic precision-debugging and training-monitoring core.

Importing this package is cheap: nothing here imports torch. Framework entry points live in
``msprobe_core.pytorch`` (dump, save, seed_all, TrainerMon) and ``msprobe_integrations``.
"""

__version__ = "0.1.0"
