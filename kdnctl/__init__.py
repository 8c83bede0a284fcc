"""kdnctl: the offline half of a knowledge delivery network for LLM KV caches."""

__version__ = "0.1.0"
