"""``channel_var`` compiled: the mean, then the mean squared deviation, both in float64, one
pass each over the tokens with every channel of a head in the inner loop (vectorized), rounded
to float32 at the end.

torch's ``var`` over the middle dimension of a float32 ``[H, T, D]`` runs a Welford update per
element in float64 and takes ~4.6 ns an element on a 2-core Xeon (54 ms of a 1,000-token
compress); this takes a fraction of that. Both carry ~29 bits beyond float32's, so their float32
results agree unless the exact variance lies within ~1e-16 of a float32 rounding boundary;
``tests/test_channel_stats.py`` compares them bit for bit, and the pinned digests of the defaults'
stored tensors (``tests/test_golden_defaults.py``) did not move.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def channel_var(x):
    """``x [H, T, D]`` float32 (C-contiguous, ``T`` >= 1) -> ``[H, D]`` float32."""
    h_n, t, d = x.shape
    out = np.empty((h_n, d), np.float32)
    s = np.zeros(d, np.float64)
    for h in range(h_n):
        s[:] = 0.0
        for j in range(t):
            for c in range(d):
                s[c] += x[h, j, c]
        for c in range(d):
            s[c] /= t
        q = np.zeros(d, np.float64)
        for j in range(t):
            for c in range(d):
                e = np.float64(x[h, j, c]) - s[c]
                q[c] += e * e
        for c in range(d):
            out[h, c] = np.float32(q[c] / t)
    return out
