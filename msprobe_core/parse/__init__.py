"""``python -m msprobe_core parse RANK_DIR RECORD_NAME``: one record's tensors, stack and parent chain.

The successor of ptdbg_ascend's ``parse(pkl, api_name)``. ``record_info`` holds the pieces that
``nan_analyze`` and ``report`` share (parent chain, stack, nearest names); ``cli`` the command.
"""
