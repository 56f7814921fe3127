"""The monitor's alert rules, framework-free (they see host-side statistics rows, never a tensor).

- ``nonfinite``: ``AnomalyNan``, NaN/Inf judged by where a tensor comes from (computed by the model, or an
  input, mask or constant).
- ``turbulence``: ``AnomalyTurbulence`` for norms and means, each judged against its own robust noise,
  activations and gradients also against their kind's common mode, spread and tail.
- ``learning_rate``: the optimizer's learning rate per param group.
- ``robust``: median, MAD and quantiles of short series.

``msprobe_core.monitor.detector.AnomalyDetector`` runs them; ``msprobe_core.monitor.events`` groups what
they find into one event per fault.
"""
