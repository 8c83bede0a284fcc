"""Token chunking and the hashes that key stored chunks.

Prefix mode: chunk i's KV depends on every token before it, so its key is a hash *chain*:
``h_0 = sha256(sha256(seed).digest() + bytes(chunk_0))``, ``h_i = sha256(h_{i-1}.digest() +
bytes(chunk_i))`` where ``bytes`` is the chunk's token ids as int32 little-endian. Two
sequences share chunk i's hash exactly when they share every token up to the end of chunk i,
so a stored chunk whose hash matches can be reused as-is.

Only full chunks plus the final partial chunk are hashed; a query's final partial chunk can
therefore only match a stored *final partial* chunk with exactly the same tokens, never the
first part of a longer stored chunk (that KV would hold tokens the query does not have).

Independent mode: a chunk's KV depends only on its own tokens, so its key is a content hash
with no chain (``chunk_content_hash``). It is domain-separated from chain hashes so an
independent chunk can never be looked up as the first chunk of a prefix chain or vice versa,
even though the bytes hashed would otherwise coincide.

The ``seed`` should carry everything else the KV depends on (e.g. the model fingerprint).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kdnctl.errors import UsageError

__all__ = [
    "chunk_bounds",
    "iter_chain_hashes",
    "chain_hashes",
    "chunk_content_hash",
    "content_hash",
    "longest_prefix",
]

_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1
# Prefix for independent-chunk hashes; see the module docstring for why it exists.
_INDEPENDENT_DOMAIN = b"kdnctl/independent-chunk/v1\x00"


def _whole_number(value: Any, what: str, minimum: int, unit: str = "") -> int:
    """``value`` as an int >= ``minimum``; a float or a string is refused (``operator.index``)."""
    try:
        n = operator.index(value)
    except TypeError:
        raise UsageError(f"{what} must be an integer, got {value!r}") from None
    if n < minimum:
        raise UsageError(f"{what} must be >= {minimum}{unit}, got {n}")
    return n


def _check_chunk_tokens(chunk_tokens: Any) -> int:
    return _whole_number(chunk_tokens, "chunk size", 1, " token")


def _as_int32_bytes_source(token_ids: Sequence[int] | Any) -> np.ndarray:
    """Token ids as a 1-D little-endian int32 array; refuses floats and out-of-range ids.

    Silently truncating a float or wrapping an id >= 2**31 would give a hash that collides
    with different tokens, so these are errors rather than conversions.
    """
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise UsageError(f"token ids must be a 1-D sequence, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise UsageError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < _INT32_MIN or hi > _INT32_MAX:
        raise UsageError(f"token id out of int32 range ({lo}..{hi})")
    return arr.astype("<i4", copy=False)


def chunk_bounds(n_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` (end exclusive) covering ``n_tokens``; the last may be partial."""
    size = _check_chunk_tokens(chunk_tokens)
    n = _whole_number(n_tokens, "token count", 0)
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def iter_chain_hashes(token_ids: Sequence[int] | Any, chunk_tokens: int, seed: str) -> Iterator[str]:
    """Lazily yield the chain hash (hex) of each chunk, so callers can stop at a miss."""
    size = _check_chunk_tokens(chunk_tokens)
    arr = _as_int32_bytes_source(token_ids)
    prev = hashlib.sha256(seed.encode("utf-8")).digest()
    for start, end in chunk_bounds(len(arr), size):
        h = hashlib.sha256(prev + arr[start:end].tobytes())
        prev = h.digest()
        yield h.hexdigest()


def chain_hashes(token_ids: Sequence[int] | Any, chunk_tokens: int, seed: str) -> list[str]:
    """Chain hash (hex sha256) of every chunk of ``token_ids``, in order."""
    return list(iter_chain_hashes(token_ids, chunk_tokens, seed))


def chunk_content_hash(token_ids: Sequence[int] | Any, seed: str) -> str:
    """Hash of one independent chunk: depends on the seed and its own tokens only."""
    arr = _as_int32_bytes_source(token_ids)
    seed_digest = hashlib.sha256(seed.encode("utf-8")).digest()
    return hashlib.sha256(_INDEPENDENT_DOMAIN + seed_digest + arr.tobytes()).hexdigest()


# The contracts doc names it ``content_hash``; both names are the same function.
content_hash = chunk_content_hash


def longest_prefix(
    token_ids: Sequence[int] | Any,
    chunk_tokens: int,
    seed: str,
    has: Callable[[str], bool],
) -> int:
    """Number of leading chunks of ``token_ids`` whose chain hashes ``has`` reports present.

    Stops at the first miss: a later chunk's KV is only usable together with the earlier
    ones, so a hit past a miss is useless. The tokens covered are
    ``chunk_bounds(len(token_ids), chunk_tokens)[count - 1][1]`` (0 when count is 0).
    """
    count = 0
    for digest in iter_chain_hashes(token_ids, chunk_tokens, seed):
        if not has(digest):
            break
        count += 1
    return count
