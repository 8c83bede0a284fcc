"""The token loop of ``kdnctl.compress.feedback.round_with_feedback``, compiled (numba).

The torch loop (``reference.round_tokens``) runs a handful of small tensor ops per token, a few
microseconds each; at the 0.083 default that is most of the time its encode stage spends. This
loop does the same float64 arithmetic in the same order (each product rounded, then the
difference: no fused multiply-add; ``rint`` rounds half to even as ``torch.round`` does), so its
results are equal bit for bit (``tests/test_value_refit.py``).
"""

from __future__ import annotations

import functools

import numba
import numpy as np


@functools.partial(numba.njit, nogil=True, cache=True)
def round_tokens(w, u, m, dv, q):
    """In place: ``w [S, D]`` (float64, in rounding order) rounded row by row into ``q`` on the
    grid ``m + k * dv`` (``m [D]``, ``dv [S, D]``), each row's error carried into the rows after it
    through the upper Cholesky factor ``u [S, S]``."""
    s, d = w.shape
    e = np.empty(d)
    for i in range(s):
        for c in range(d):
            q[i, c] = m[c] + np.rint((w[i, c] - m[c]) / dv[i, c]) * dv[i, c]
        if i + 1 < s:
            for c in range(d):
                e[c] = (w[i, c] - q[i, c]) / u[i, i]
            for j in range(i + 1, s):
                a = u[i, j]
                for c in range(d):
                    w[j, c] = w[j, c] - a * e[c]
