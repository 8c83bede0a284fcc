"""Compression: a stored version -> a size-budgeted, pruned and/or quantized new version."""
