"""Decode attention over a stored KV cache (dense or quantized, GQA, additive bias), dispatched
by ``kdnctl.kernels.dispatch``: CUDA tensors (or the interpreter with KDNCTL_FORCE_TRITON=1) run
the Triton flash-decoding kernel in ``triton.py``, everything else the torch reference in
``reference.py`` (which documents the semantics).

    from kdnctl.kernels.attention import QuantizedKV, decode_attention
    k = QuantizedKV.quantize(keys, "int4", 32, "channel")    # keys: per channel
    v = QuantizedKV.quantize(values, "int4", 32, "token")    # values: per token
    out = decode_attention(query, k, v, bias=bias)           # float32 [Hq, D]

The Triton module is imported lazily so CPU-only installs without triton work.
"""

from __future__ import annotations

import torch

from kdnctl.kernels.dispatch import use_triton

from . import reference
from .reference import QuantizedKV

__all__ = ["QuantizedKV", "decode_attention", "reference"]


def _tensors(x) -> tuple[torch.Tensor, ...]:
    return (x.q, x.scale, x.zero) if isinstance(x, QuantizedKV) else (x,)


def decode_attention(query: torch.Tensor, k, v, bias: torch.Tensor | None = None, scale: float | None = None, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token's ``query [Hq, D]`` (or a few, ``[Hq, Q, D]``) over cached
    ``k``/``v`` (each a float ``[Hkv, T, D]`` tensor or a :class:`QuantizedKV`), plus an optional
    additive ``bias [Hq, T]`` (or ``[Hq, Q, T]``); ``scale`` defaults to ``1/sqrt(D)``.
    Query head ``h`` reads KV head ``h // (Hq // Hkv)``. Returns float32 ``[Hq, (Q,) D]``."""
    tensors = (query, *_tensors(k), *_tensors(v)) + ((bias,) if bias is not None else ())
    if use_triton(*tensors):
        from . import triton as tr

        return tr.decode_attention(query, k, v, bias, scale, out=out)
    return reference.decode_attention(query, k, v, bias, scale, out=out)
