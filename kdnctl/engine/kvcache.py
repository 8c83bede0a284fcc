"""A transformers cache layer over preallocated K/V buffers.

``DynamicCache`` copies a loaded context once when it is built (``torch.cat`` onto an empty
tensor) and again at every forward (``torch.cat`` of the whole cache with the new tokens): at
4k tokens of SmolLM2 in fp32 that is ~190 MB moved twice before the first token. The loader
already holds each layer's K/V in one buffer with spare room behind the context, so this layer
writes new tokens into that room in place and hands attention views; when the room runs out it
grows the buffer once (doubling), like a vector. Behaviour otherwise equals ``DynamicLayer``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class PreallocLayer(DynamicLayer):
    """``DynamicLayer`` whose keys/values are views ``[:, :, :n]`` of larger buffers."""

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, n: int, wait=None):
        super().__init__()
        self._kbuf, self._vbuf, self._n = kbuf, vbuf, n
        self._wait = wait  # called once before the first update: the loader may still be writing the buffers
        self.dtype, self.device = kbuf.dtype, kbuf.device
        self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]
        self.is_initialized = True

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self._kbuf.shape[2])
        for name in ("_kbuf", "_vbuf"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], cap, old.shape[3])
            new[:, :, : self._n].copy_(old[:, :, : self._n])
            setattr(self, name, new)

    def update(self, key_states, value_states, *args, **kwargs):
        if self._wait is not None:
            self._wait()
            self._wait = None
        q = key_states.shape[2]
        end = self._n + q
        if end > self._kbuf.shape[2]:
            self._grow(end)
        self._kbuf[:, :, self._n : end].copy_(key_states)
        self._vbuf[:, :, self._n : end].copy_(value_states)
        self._n = end
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._n = self.keys.shape[2]


def prealloc_buffers(keys: torch.Tensor, values: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh buffers ``[B, H, T + room, D]`` holding a copy of ``keys``/``values`` in ``[:T]``."""
    b, h, t, d = keys.shape
    kbuf = keys.new_empty(b, h, t + room, d)
    vbuf = values.new_empty(b, h, t + room, d)
    kbuf[:, :, :t].copy_(keys)
    vbuf[:, :, :t].copy_(values)
    return kbuf, vbuf


def cache_over(config, layers: list[tuple[torch.Tensor, torch.Tensor, int]], wait=None):
    """A ``DynamicCache`` for ``config`` whose layers are :class:`PreallocLayer` s over
    ``(kbuf, vbuf, n_tokens)``; ``wait(i)`` (optional) blocks until layer ``i``'s buffers are
    written."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    cache.layers = [PreallocLayer(k, v, n, None if wait is None else (lambda i=i: wait(i)))
                    for i, (k, v, n) in enumerate(layers)]
    return cache
