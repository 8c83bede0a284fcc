"""Chunk bounds, chain hashes, content hashes and prefix matching."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kdnctl.ingest.chunking import (
    chain_hashes,
    chunk_bounds,
    chunk_content_hash,
    content_hash,
    longest_prefix,
)
from kdnctl.errors import UsageError

SEED = "fingerprint-abc"


def _tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_chunk_bounds_full_and_partial() -> None:
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(3, 4) == [(0, 3)]
    assert chunk_bounds(0, 4) == []
    assert chunk_bounds(5, 1) == [(i, i + 1) for i in range(5)]


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", None])
def test_chunk_size_must_be_a_positive_int(bad) -> None:
    with pytest.raises(UsageError):
        chunk_bounds(10, bad)
    with pytest.raises(UsageError):
        chain_hashes([1, 2, 3], bad, SEED)
    with pytest.raises(UsageError):
        longest_prefix([1, 2, 3], bad, SEED, lambda h: True)


def test_negative_token_count_is_refused() -> None:
    with pytest.raises(UsageError):
        chunk_bounds(-1, 4)


def test_chain_hash_matches_the_documented_construction() -> None:
    toks = _tokens(10)
    prev = hashlib.sha256(SEED.encode()).digest()
    expected = []
    for start, end in [(0, 4), (4, 8), (8, 10)]:
        h = hashlib.sha256(prev + np.asarray(toks[start:end], dtype="<i4").tobytes())
        prev = h.digest()
        expected.append(h.hexdigest())
    assert chain_hashes(toks, 4, SEED) == expected
    # Independent of the container type (list, int64 array, int32 array).
    assert chain_hashes(np.asarray(toks, dtype=np.int64), 4, SEED) == expected
    assert chain_hashes(np.asarray(toks, dtype=np.int32), 4, SEED) == expected


def test_chain_hashes_are_stable_across_calls() -> None:
    toks = _tokens(50)
    assert chain_hashes(toks, 8, SEED) == chain_hashes(list(toks), 8, SEED)
    assert len(chain_hashes(toks, 8, SEED)) == 7  # 6 full chunks + 1 partial


def test_chain_of_a_prefix_is_a_prefix_of_the_chain() -> None:
    toks = _tokens(40)
    full = chain_hashes(toks, 8, SEED)
    for n_chunks in range(6):
        assert chain_hashes(toks[: 8 * n_chunks], 8, SEED) == full[:n_chunks]


def test_partial_final_chunk_hash_differs_from_the_full_chunk() -> None:
    toks = _tokens(16)
    full = chain_hashes(toks, 8, SEED)
    part = chain_hashes(toks[:12], 8, SEED)
    assert part[0] == full[0]
    assert part[1] != full[1]


def test_different_seed_gives_different_hashes() -> None:
    toks = _tokens(20)
    a = chain_hashes(toks, 8, SEED)
    b = chain_hashes(toks, 8, SEED + "x")
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_changing_one_token_in_chunk_2_changes_only_chunks_2_onward() -> None:
    toks = _tokens(40)
    changed = list(toks)
    changed[2 * 8 + 3] += 1
    a = chain_hashes(toks, 8, SEED)
    b = chain_hashes(changed, 8, SEED)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_token_ids_are_hashed_as_int32_not_text() -> None:
    # 256 and [1, 0]-style byte coincidences must not collide across chunk layouts.
    assert chain_hashes([256], 1, SEED) != chain_hashes([0, 1], 2, SEED)
    assert chain_hashes([1, 2], 2, SEED) != chain_hashes([12], 2, SEED)


def test_empty_sequence_has_no_chunks() -> None:
    assert chain_hashes([], 4, SEED) == []
    assert longest_prefix([], 4, SEED, lambda h: True) == 0


@pytest.mark.parametrize(
    "bad", [[1.5, 2.0], [2**31], [-(2**31) - 1], [[1, 2], [3, 4]], ["a", "b"]]
)
def test_bad_token_ids_are_refused(bad) -> None:
    with pytest.raises(UsageError):
        chain_hashes(bad, 2, SEED)


def test_content_hash_ignores_position_but_not_seed_or_tokens() -> None:
    a = chunk_content_hash([5, 6, 7], SEED)
    assert a == chunk_content_hash(np.asarray([5, 6, 7]), SEED)
    assert a != chunk_content_hash([5, 6, 8], SEED)
    assert a != chunk_content_hash([5, 6, 7], SEED + "x")
    assert content_hash is chunk_content_hash


def test_content_hash_is_not_a_chain_hash() -> None:
    # An independent chunk must never be found by a prefix lookup (and vice versa).
    toks = [5, 6, 7]
    assert chunk_content_hash(toks, SEED) != chain_hashes(toks, 3, SEED)[0]


class _Store:
    def __init__(self, hashes) -> None:
        self.hashes = set(hashes)
        self.calls = 0

    def __call__(self, h: str) -> bool:
        self.calls += 1
        return h in self.hashes


def test_longest_prefix_counts_leading_hits_and_stops_at_first_miss() -> None:
    doc = _tokens(40)
    store = _Store(chain_hashes(doc, 8, SEED))  # 5 full chunks stored
    # Query shares the first 2.5 chunks, then diverges.
    query = doc[:20] + [1, 2, 3, 4] + doc[24:]
    assert longest_prefix(query, 8, SEED, store) == 2
    assert store.calls == 3  # looked up chunks 0, 1 and the miss, nothing after
    assert longest_prefix(doc, 8, SEED, _Store(chain_hashes(doc, 8, SEED))) == 5
    assert longest_prefix(doc, 8, "other seed", _Store(chain_hashes(doc, 8, SEED))) == 0


def test_longest_prefix_does_not_resume_after_a_gap() -> None:
    doc = _tokens(32)
    hashes = chain_hashes(doc, 8, SEED)
    store = _Store([hashes[0], hashes[2], hashes[3]])  # chunk 1 missing (e.g. gc'd)
    assert longest_prefix(doc, 8, SEED, store) == 1


def test_query_partial_final_chunk_needs_an_identical_stored_partial_chunk() -> None:
    doc = _tokens(20)  # stored as chunks [0,8) [8,16) [16,20) (partial)
    store = _Store(chain_hashes(doc, 8, SEED))
    # Same 20 tokens: the partial chunk matches exactly.
    assert longest_prefix(doc, 8, SEED, store) == 3
    # Query ends inside stored full chunk 1: its partial [8,12) is not a stored chunk.
    assert longest_prefix(doc[:12], 8, SEED, store) == 1
    # Query ends inside the stored partial chunk: [16,18) != [16,20).
    assert longest_prefix(doc[:18], 8, SEED, store) == 2
    # Query extends past the stored document: its chunk 2 is [16,24), not the stored [16,20).
    assert longest_prefix(doc + _tokens(10, 5000), 8, SEED, store) == 2
    # Exactly the full chunks: matches both, no partial chunk to look up.
    assert longest_prefix(doc[:16], 8, SEED, store) == 2


def test_longest_prefix_token_coverage_via_chunk_bounds() -> None:
    doc = _tokens(20)
    store = _Store(chain_hashes(doc, 8, SEED))
    n = longest_prefix(doc, 8, SEED, store)
    assert chunk_bounds(len(doc), 8)[n - 1][1] == 20
