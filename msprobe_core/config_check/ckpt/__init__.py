"""Checkpoint compare: per parameter L2 distance and cosine similarity of two checkpoints.

``open_checkpoint`` (``layout``) recognises Megatron-LM/MindSpeed (``megatron``: TP/PP/EP/virtual-pipeline
shards merged by name), megatron-core's ``torch_dist`` (``dist``), Hugging Face (``hf``) and DeepSpeed
(``deepspeed``) checkpoints and lists their parameters lazily (``source.Entry``); ``mapping`` renames a
Megatron checkpoint's parameters to Hugging Face's; ``compare.compare_checkpoints`` writes the JSON.
"""
