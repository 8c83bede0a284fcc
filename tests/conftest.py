"""Shared fixtures. TRITON_INTERPRET must be set before any Triton kernel module is imported so
kernel tests can run the Triton path on CPU tensors."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
