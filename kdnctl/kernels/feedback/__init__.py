"""Compiled rounding with error feedback (``kdnctl.compress.feedback``); ``reference`` is the torch loop."""
