"""The statistics kernel: one read of a buffer gives max, min, sum, sum of squares, zero and NaN counts.

``_fast_stats.c`` is an optional C extension (built by ``pip install``; skipped without a C compiler)
that works on raw host buffers (an address, an element count and a dtype code), so any framework can use
it; ``kernel`` loads it behind a small interface with its kill switch (``MSPROBE_FAST_STATS=0``). The
PyTorch binding (which tensors it may read, dtype codes, threads) is ``msprobe_core.pytorch.tensor_stats``.
``_torch_facts.cpp`` is an optional C++ extension (built only where torch imports at build time): the kernel's
``TensorRows``, ``RecordText`` and ``GradText`` read a tensor's facts (device, layout, dtype, address, shape,
version, requires_grad...) from torch's C++ tensor through it, instead of through torch's Python API
(``_fast_facts.c``).
"""
