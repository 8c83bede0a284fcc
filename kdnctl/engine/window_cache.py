"""A loaded context as the model's own transformers cache: each layer the type the model's config
asks for (``DynamicSlidingWindowLayer`` for sliding-window layers, ``DynamicLayer`` otherwise).

kdnctl's own generation keeps every layer in one preallocated buffer and applies windows by
position (kdnctl/engine/attention.py). A caller that runs the model's own forward or
``generate`` with transformers' attention needs the cache that model builds itself: a sliding
layer holding the last ``W - 1`` tokens and knowing how many came before. Versions stored with
``window_layers=window`` hold exactly what that layer needs (kdnctl/presses/window_layers.py);
versions stored whole hold more, and the layer takes its window of them.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError


def model_cache(lm, ctx):
    """A ``transformers.DynamicCache`` for ``lm``'s config over ``ctx`` (a LoadedContext whose
    layers hold every token, or, in window layers, at least the window's last ``W - 1``)."""
    from transformers import DynamicCache

    ctx.settle()  # (reads every layer's K/V)
    cache = DynamicCache(config=lm.model.config)
    n = ctx.next_position
    if len(cache.layers) != len(ctx.keys):
        raise UnsupportedError(f"the model's cache has {len(cache.layers)} layers, the context {len(ctx.keys)}")
    for i, (layer, k, v) in enumerate(zip(cache.layers, ctx.keys, ctx.values)):
        if getattr(layer, "is_sliding", False):
            keep = layer.sliding_window - 1
            pos = ctx.positions.get(i)
            want = torch.arange(max(0, n - keep), n)
            have = pos[-len(want):].cpu() if pos is not None and len(want) else want
            if k.shape[2] < len(want) or not torch.equal(have, want):
                raise UnsupportedError(f"layer {i} does not hold the last {keep} tokens the model's sliding-window "
                                       "cache needs (a pruned version)")
            k, v = k[:, :, k.shape[2] - len(want):], v[:, :, v.shape[2] - len(want):]
        elif k.shape[2] != n:
            raise UnsupportedError(f"layer {i} holds {k.shape[2]} of {n} tokens: the model's own cache needs them all")
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k.contiguous(), v.contiguous()
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = n
    return cache
