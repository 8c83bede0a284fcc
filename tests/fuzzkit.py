"""The byte mutations the decoders' fuzz tests apply to codes and params blobs."""

from __future__ import annotations

import random


def mutate(b: bytearray, rng: random.Random, n_ops: int = 5) -> int:
    """One mutation of ``b`` (non-empty) in place, chosen among the first ``n_ops``: a bit flipped,
    a byte overwritten, the tail cut, bytes inserted, a frame size or peak of a codes blob's
    header rewritten. Returns which."""
    op, i = rng.randrange(n_ops), rng.randrange(len(b))
    if op == 0:
        b[i] ^= 1 << rng.randrange(8)
    elif op == 1:
        b[i] = rng.randrange(256)
    elif op == 2:
        del b[i:]
    elif op == 3:
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    else:
        n = b[1] if len(b) > 1 else 0
        j = 2 + rng.randrange(max(1, 6 * n))
        if j < len(b):
            b[j] = rng.randrange(256)
    return op
