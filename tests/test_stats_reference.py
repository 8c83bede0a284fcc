"""The ingest statistics (``prefill``'s StatsObserver: window, accum, surprisal) and the
``reconstruct`` scorer against their naive eager-attention references, on the tiny random model:
odd sizes, fixed seeds, one tolerance table (same pattern as the kernel tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdnctl.engine.prefill import prefill, reference_stats
from kdnctl.scorers.reconstruct import reconstruct_scores, reference_reconstruct_scores

# fp32 on CPU; blockwise/tiled sums reorder additions, hence not bit-exact
TOL = {"window": 2e-5, "accum": 2e-4, "surprisal": 2e-4, "reconstruct": 2e-5, "keys": 1e-4,
       # ingest's default surprisal: logsumexp over a bf16 vocabulary projection (exact target logit)
       "surprisal_bf16": 0.25}


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("n,window,block,tile,seed", [
    (37, 5, 1024, 256, 0),   # one block, one tile
    (53, 7, 16, 5, 1),       # several blocks (last one merged to hold the window), odd tiles
    (29, 40, 8, 3, 2),       # window longer than the document
    (1, 3, 4, 2, 3),         # a single token
])
def test_prefill_stats_match_reference(tiny_lm, n, window, block, tile, seed):
    ids = _ids(n, seed, tiny_lm.model.config.vocab_size)
    got = prefill(tiny_lm.model, ids, stats=True, window=window, block_tokens=block, query_tile=tile,
                  surprisal_dtype=torch.float32)
    want = reference_stats(tiny_lm.model, ids, window=window)
    assert set(got.stats) == set(want) == {"window", "accum", "surprisal"}
    for name, ref in want.items():
        assert got.stats[name].shape == ref.shape, name
        torch.testing.assert_close(got.stats[name], ref, atol=TOL[name], rtol=0, msg=name)
    # sanity of the spec itself: every query's attention sums to one
    heads_per_group = tiny_lm.model.config.num_attention_heads // tiny_lm.model.config.num_key_value_heads
    total = want["accum"].sum(dim=-1)
    torch.testing.assert_close(total, torch.full_like(total, float(n * heads_per_group)), atol=1e-3, rtol=0)


def test_stats_do_not_depend_on_blocks_or_tiles(tiny_lm):
    ids = _ids(45, 7, tiny_lm.model.config.vocab_size)
    a = prefill(tiny_lm.model, ids, window=6, block_tokens=1024, query_tile=256)
    b = prefill(tiny_lm.model, ids, window=6, block_tokens=9, query_tile=4)
    for name in a.stats:
        torch.testing.assert_close(a.stats[name], b.stats[name], atol=TOL[name], rtol=0, msg=name)
    for ka, kb in zip(a.keys, b.keys):
        torch.testing.assert_close(ka, kb, atol=TOL["keys"], rtol=0)


@pytest.mark.parametrize("n,chunk,seed", [(31, 256, 0), (47, 13, 1), (20, 7, 2)])
def test_reconstruct_scores_match_reference(tiny_lm, n, chunk, seed):
    ids = _ids(n, seed, tiny_lm.model.config.vocab_size)
    res = prefill(tiny_lm.model, ids, stats=False)
    got = reconstruct_scores(tiny_lm, res.keys, res.values, ids, chunk_tokens=chunk)
    want = reference_reconstruct_scores(tiny_lm, ids, chunk_tokens=chunk)
    assert got.shape == want.shape == (2, 2, n)
    torch.testing.assert_close(got, want, atol=TOL["reconstruct"], rtol=0)
    assert (want > 0).all() and (want <= 1).all()


def test_bf16_surprisal_ranks_like_the_reference(lm):
    """The default (bf16 logsumexp) surprisal on the real model and real text: within
    TOL["surprisal_bf16"] nats of the fp32 eager reference and ranking tokens the same way."""
    text = (Path(__file__).resolve().parents[1] / "examples" / "corpus").glob("*")
    ids = lm.tokenizer("\n".join(p.read_text() for p in sorted(text)), add_special_tokens=False).input_ids[:300]
    want = reference_stats(lm.model, ids, window=8)["surprisal"]
    got = prefill(lm.model, ids, stats=("surprisal",), surprisal_dtype=torch.bfloat16).stats["surprisal"]
    exact = prefill(lm.model, ids, stats=("surprisal",), surprisal_dtype=torch.float32).stats["surprisal"]
    torch.testing.assert_close(exact, want, atol=TOL["surprisal"] * 10, rtol=0)
    assert (got - want).abs().max() <= TOL["surprisal_bf16"]
    assert (got - want).abs().max() > 0  # the bf16 path really ran (else this test proves nothing)
    ranks = torch.stack([want.argsort().argsort(), got.argsort().argsort()]).float()
    assert torch.corrcoef(ranks)[0, 1] >= 0.99
