"""Compiled (numba) kernels that decode ec roles on the CPU; ``reference`` is the spec.

The kernels release the GIL, so a loader runs chunks on both cores with plain threads (no
second thread pool beside torch's). The frames are inflated by ISA-L's stateless inflate,
called straight from the compiled loop (the library python-isal ships; bound by name once per
process): no Python per frame. A frame must decode to exactly the bytes its header implies and
consume exactly its bytes, as ``coders.deflate.deflate_decompress`` demands.

``isal_inflate_stateless`` reads and writes the first fields of ISA-L's ``struct inflate_state``:
``next_out`` (offset 0), ``avail_out`` (8), ``next_in`` (16), ``avail_in`` (32); these have kept
their place in every ISA-L release, and :func:`available` decodes a known frame before anything
relies on them.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np

from .errors import MESSAGES  # noqa: F401 (the loader reads the kernels' messages here)

STATE_BYTES = 1 << 18  # > sizeof(struct inflate_state) (~80 KB in ISA-L 2.31), a margin for others


@functools.lru_cache(maxsize=1)
def _kernels():
    """(inflate_frames, decode_blobs, rope_blobs), compiled (or loaded from numba's cache) once; None where
    numba or the ISA-L library is missing."""
    try:
        import llvmlite.binding as llb
        import numba  # noqa: F401
        from isal import isal_zlib
    except ImportError:
        return None
    llb.load_library_permanently(isal_zlib.__file__)  # before the kernels bind its functions by name
    from . import cpu_jit

    return cpu_jit.inflate_frames, cpu_jit.decode_blobs, cpu_jit.rope_blobs


@functools.lru_cache(maxsize=1)
def digit_tables() -> np.ndarray:
    """int8 ``[8, 256, 5]``: digit ``k`` (least significant first) of byte ``b`` at peak ``p``
    (codes in ``[-p, p]`` as base-``2p+1`` digits), for the peaks that pack (1 to 7)."""
    out = np.zeros((8, 256, 5), np.int8)
    for p in range(1, 8):
        radix = 2 * p + 1
        out[p] = (np.arange(256)[:, None] // radix ** np.arange(5)) % radix - p
    return out


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """The kernels compile and ISA-L's inflate, bound by its first fields, decodes a known
    frame exactly (else loads take the reference path)."""
    k = _kernels()
    if k is None:
        return False
    data = bytes(range(256)) * 37
    z = zlib.compressobj(6, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    frame = np.frombuffer(z.compress(data) + z.flush(), np.uint8)
    dst = np.zeros(len(data), np.uint8)
    ok = np.zeros(2, np.bool_)
    k[0](frame, np.array([0, 0], np.int64), np.array([len(frame), len(frame) - 1], np.int64),
         dst, np.array([0, 0], np.int64), np.array([len(data), len(data)], np.int64), new_state(), ok)
    return bool(ok[0]) and not bool(ok[1]) and dst.tobytes() == data


def new_state() -> np.ndarray:
    return np.zeros(STATE_BYTES, np.uint8)


def kernels():
    return _kernels()


def inflate_blobs():
    """The host part of a device decode (``cpu_jit.inflate_blobs``), or None where the kernels
    are missing."""
    if _kernels() is None:
        return None
    from . import cpu_jit

    return cpu_jit.inflate_blobs
