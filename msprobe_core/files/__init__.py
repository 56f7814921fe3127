"""Tensor and record files, framework-free: what is written, in which format, and how it survives a crash.

- ``step_recorder``: one rank's step of dump records (dump.json / stack.json / construct.json / debug.json),
  journaled as they arrive (``.dump.journal``) and rebuilt from the journal after a crash.
- ``call_stack``: the call stacks of stack.json, captured cheaply and encoded once per distinct stack.
- ``pt_archive``: the ``.pt`` file layout (``torch.save``'s zip archive) written without torch.
- ``writer_process``: the tensor-file writer process fed through a shared-memory arena and job ring.
- ``atomic_write``: atomic text writes (temporary file + rename).
"""
