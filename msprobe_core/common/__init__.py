"""Shared utilities of every feature and framework; nothing here imports torch or another core package.

- ``patch``: the one way the toolkit patches an attribute (``PatchHandle``, RemovableHandle semantics).
- ``guard``: the "never break training" guard around the toolkit's own work.
- ``tool_guard``: the thread-local marker of the toolkit's own tensor work (the dump records none of it).
- ``rank_folder``: the name of a rank's output folder (``rank{R}``, ``proc{pid}``).
"""
