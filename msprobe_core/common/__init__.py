"""Shared utilities of every feature and framework; nothing here imports torch or another core package.

- ``patch``: the one way the toolkit patches an attribute (``PatchHandle``, RemovableHandle semantics).
- ``never_break``: the "never break training" guard around the toolkit's own work.
- ``tool_guard``: the thread-local marker of the toolkit's own tensor work (the dump records none of it).
- ``exit_close``: what the toolkit closes when the process ends (``close_at_exit``, ``close_all``).
- ``rank_folder``: the name of a rank's output folder (``rank{R}``, ``proc{pid}``) and "never overwrite".
- ``output_dir``: checking a folder before the first record depends on it.
- ``ports``: a free TCP port for a local multi-process job.
- ``crc32``, ``yaml_file``: CRC-32 of bytes; a user-editable YAML mapping.
"""
