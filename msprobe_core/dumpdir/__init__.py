"""Reading dump folders, the one reader every analysis tool uses (compare, nan_analyze, acc_check, parse, report).

- ``layout``: the folder layout (dump path / ``step{N}`` / ``rank{R}`` or ``proc{pid}``, the file names),
  ``discover`` of the rank folders under a path and ``check_finished``.
- ``rank_dump``: one rank folder read: dump.json, construct.json, stack.json, where its tensor files are.
- ``record_leaves``: dump.json's record names and the leaves (tensors and plain values) a record holds.
- ``record_info``: one record read in full: its stack, its parent chain (construct.json), the statistics of
  its tensor files, the record names nearest a missing one.
- ``tensor_reader``: a dumped tensor file (``.pt`` or ``.npy``) loaded as a numpy array, without torch
  when possible.

Nothing here imports torch unless a tensor file needs ``torch.load``.
"""
