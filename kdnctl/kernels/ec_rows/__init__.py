"""The device half of an ec decode: inflated code frames (``kdnctl.kernels.ec.cpu_jit.inflate_blobs``
on the host) to cache rows, in one launch per role. Digits unpacked, codes scaled by their
tokens' level, dequantized, rotated out of the key basis and RoPE'd, each cache row written once
in the cache's dtype. Dispatched by ``kdnctl.kernels.dispatch``: CUDA tensors (or the interpreter
with KDNCTL_FORCE_TRITON=1) run ``triton.py``, everything else the torch reference in
``reference.py``, which documents the layouts.

The Triton module is imported lazily so CPU-only installs without triton work, and so importing
this package has no side effects.
"""

from __future__ import annotations

import torch

from kdnctl.kernels.dispatch import use_triton

from . import reference
from .reference import BLOB_FIELDS

__all__ = ["BLOB_FIELDS", "decode_rows", "reference"]


def decode_rows(u: torch.Tensor, blobs: torch.Tensor, ch_off: torch.Tensor, ch_first: torch.Tensor,
                ch_mode: torch.Tensor, step: torch.Tensor, mean: torch.Tensor, lsc: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, basis_t: torch.Tensor | None, out: torch.Tensor) -> None:
    """See :func:`reference.decode_rows`."""
    if use_triton(u, out):
        from . import triton as tr

        tr.decode_rows(u, blobs, ch_off, ch_first, ch_mode, step, mean, lsc, cos, sin, basis_t, out)
        return
    reference.decode_rows(u, blobs, ch_off, ch_first, ch_mode, step, mean, lsc, cos, sin, basis_t, out)
