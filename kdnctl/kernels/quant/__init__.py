"""Groupwise KV quantization kernels (KIVI layout), dispatched by ``kdnctl.kernels.dispatch``:
CUDA tensors (or the interpreter with KDNCTL_FORCE_TRITON=1) run the Triton kernels in
``triton.py``, everything else the torch reference in ``reference.py``. Layouts, formats and
rounding rules are documented in ``reference.py``.

The Triton module is imported lazily so CPU-only installs without triton work, and so importing
this package has no side effects.
"""

from __future__ import annotations

import torch

from kdnctl.kernels.dispatch import use_triton

from . import reference
from .reference import FORMATS, LAYOUTS, out_shapes, pack_int4, unpack_int4

__all__ = [
    "FORMATS",
    "LAYOUTS",
    "dequantize",
    "out_shapes",
    "pack_int4",
    "quantize",
    "reference",
    "unpack_int4",
]


def quantize(x: torch.Tensor, fmt: str, group_size: int, layout: str,
             scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [H, T, D]`` -> (codes uint8, scale, zero); fmt int8|int4|fp8, layout channel|token."""
    if use_triton(x):
        from . import triton as tr

        return tr.quantize(x, fmt, group_size, layout, scale_dtype)
    return reference.quantize(x, fmt, group_size, layout, scale_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: str, group_size: int, layout: str,
               shape: tuple[int, int, int], out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``shape`` tensor from (codes, scale, zero) produced by :func:`quantize`."""
    if use_triton(q, scale, zero):
        from . import triton as tr

        return tr.dequantize(q, scale, zero, fmt, group_size, layout, shape, out_dtype)
    return reference.dequantize(q, scale, zero, fmt, group_size, layout, shape, out_dtype)
