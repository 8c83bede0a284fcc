"""One dispatch rule for every kernel: CUDA tensors go to Triton, everything else to the torch
reference. ``KDNCTL_DISABLE_TRITON=1`` forces the reference; ``TRITON_INTERPRET=1`` lets tests
run the Triton path on CPU tensors (the interpreter), which is how CI checks the kernels.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when this call should run the Triton kernel rather than the torch reference."""
    if os.environ.get("KDNCTL_DISABLE_TRITON", "") == "1" or not triton_available():
        return False
    if any(t.is_cuda for t in tensors):
        return True
    # On CPU only the interpreter can run Triton; the reference is the normal CPU path.
    return interpreting() and os.environ.get("KDNCTL_FORCE_TRITON", "") == "1"
