"""Batch decoding of the entropy-coded ``ec`` layout on the CPU.

``reference`` is the spec: :func:`kdnctl.quant.entropy.decode_role` one layer and role at a
time (numpy bookkeeping per frame, torch arithmetic), as a load ran it before. ``cpu`` decodes
every layer of a chunk's role in one compiled pass (numba, no GIL): ISA-L's inflate of every
frame, digit tables, dequantization, the inverse key basis and RoPE, each element written once
into the cache. ``kdnctl.quant.ec_batch`` parses the bundles into the arrays it takes and runs
chunks on two threads. numba is optional: without it (or where the ISA-L library cannot be
bound) loads take the reference path.
"""

from __future__ import annotations
