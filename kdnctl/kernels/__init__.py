"""Triton kernels, each beside its plain-torch reference (imported as ``kdnctl.kernels``)."""
