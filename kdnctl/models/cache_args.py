"""How a forward call names the KV cache: ``cache`` in newer transformers 5 releases,
``past_key_values`` before. Passing the old name to a newer release prints a deprecation warning
on every forward (the user sees it on every command), so kdnctl asks the module's signature."""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def cache_name(cls: type) -> str:
    """The keyword ``cls.forward`` takes the KV cache by."""
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_arg(module, cache) -> dict:
    """``{name: cache}`` for a call of ``module`` (a causal LM or its decoder stack)."""
    return {cache_name(type(module)): cache}


def cache_out(output):
    """The cache a forward returned, under either name."""
    found = getattr(output, "cache", None)
    return found if found is not None else getattr(output, "past_key_values", None)
