"""Framework integrations of the msprobe-compatible toolkit: thin adapters that find the model inside a
framework (Hugging Face, vLLM, ...) and drive the core (``msprobe_core``) there; no statistics or file logic."""
