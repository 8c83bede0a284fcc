"""The host logsumexp of a vocabulary projection (``kdnctl.kernels.vocab.cpu``, numpy's BLAS on
threads) against its torch reference and a whole-vocabulary logsumexp: odd sizes, fixed seeds,
one tolerance table, every thread count and row split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdnctl.kernels.vocab import cpu, reference

# fp32, tiles and blocks reorder the additions: not bit-exact against torch
TOL = {"logsumexp": dict(atol=2e-5, rtol=0)}


def _case(m: int, vocab: int, d: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g) * 2
    w = torch.randn(vocab, d, generator=g) * 0.3
    b = torch.randn(vocab, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("m,vocab,d,seed,bias,threads,row_block,tile", [
    (1, 257, 3, 0, False, 1, 128, 64),     # one row, several odd tiles
    (37, 1001, 19, 1, True, 2, 5, 300),    # odd blocks over two threads, a bias
    (130, 4099, 64, 2, False, 3, 16, 4096),  # more threads than cores, a last tile of 3 rows
    (7, 33, 5, 3, True, 2, 128, 4096),     # one block, one tile smaller than the default
])
def test_equals_the_reference(m, vocab, d, seed, bias, threads, row_block, tile):
    x, w, b = _case(m, vocab, d, seed, bias)
    got = cpu.vocab_logsumexp(x, w, b, threads=threads, row_block=row_block, tile=tile)
    logits = x @ w.T + (0 if b is None else b)
    assert got.dtype == torch.float32 and got.shape == (m,)
    torch.testing.assert_close(got, torch.logsumexp(logits, -1), **TOL["logsumexp"])
    torch.testing.assert_close(got, reference.vocab_logsumexp(x, w, b, tile=97), **TOL["logsumexp"])
    # the thread count does not change a result: the blocks are the same, whichever thread runs them
    assert torch.equal(got, cpu.vocab_logsumexp(x, w, b, threads=1, row_block=row_block, tile=tile))


def test_large_logits_and_masked_vocabulary():
    """Logits far beyond exp's range stay finite (the running maximum), a vocabulary masked by a
    -inf bias in whole tiles counts for nothing, and a row masked everywhere gives -inf as torch."""
    x, w, _ = _case(9, 300, 8, 4, False)
    x = x * 200
    b = torch.zeros(300)
    b[:100] = float("-inf")  # the first tiles entirely masked
    got = cpu.vocab_logsumexp(x, w, b, threads=2, row_block=4, tile=50)
    torch.testing.assert_close(got, torch.logsumexp(x @ w.T + b, -1), atol=1e-3, rtol=1e-6)
    assert torch.isfinite(got).all()
    every = torch.full((300,), float("-inf"))
    assert torch.equal(cpu.vocab_logsumexp(x, w, every, tile=64), torch.full((9,), float("-inf")))


def test_blas_runs_on_one_thread_during_the_call_and_is_restored():
    from threadpoolctl import threadpool_info

    before = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    seen = []
    real = cpu._block_logsumexp

    def spy(*args):
        seen.append([lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"])
        return real(*args)

    cpu._block_logsumexp = spy
    try:
        x, w, _ = _case(20, 100, 8, 5, False)
        cpu.vocab_logsumexp(x, w, threads=2, row_block=8)
    finally:
        cpu._block_logsumexp = real
    assert len(seen) == 3 and all(all(n == 1 for n in s) for s in seen)
    assert [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"] == before


def test_calls_from_several_threads_at_once_restore_the_blas_setting():
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_info

    before = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    x, w, _ = _case(64, 3000, 32, 7, False)
    want = cpu.vocab_logsumexp(x, w, threads=2, row_block=8, tile=500)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: cpu.vocab_logsumexp(x, w, threads=2, row_block=8, tile=500), range(12)))
    assert all(torch.equal(g, want) for g in got)
    assert [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"] == before


def test_refuses_what_it_does_not_compute():
    x, w, _ = _case(3, 10, 4, 6, False)
    for args in ((x.double(), w.double()), (x.half(), w.half())):
        with pytest.raises(ValueError, match="fp32 CPU"):
            cpu.vocab_logsumexp(*args)
    assert cpu.vocab_logsumexp(x[:0], w).shape == (0,)
    assert np.isfinite(cpu.vocab_logsumexp(x, w).numpy()).all()
