"""The fp32 logsumexp of a vocabulary projection on the host, with numpy's BLAS.

Ingest's surprisal projects every token onto the whole vocabulary (for SmolLM2 49152 x 576 per
token, +27% of a forward's FLOPs) and spends nearly all of its time in that matmul. torch's CPU
matmul is MKL's, which on AMD CPUs runs well below the OpenBLAS that numpy ships (on a 2-core
AMD EPYC with AVX2: 52 against 68 GFLOPS on one thread, 89 against 131 on two, the shape of a
surprisal tile). Rows go in blocks to the process's torch thread count of Python threads, each
a single-threaded sgemm into its own scratch and a running logsumexp over vocabulary tiles (numpy
releases the GIL in both); numpy's BLAS runs on one thread meanwhile, so no BLAS worker threads
are left spinning against the forward's. The result is the reference's (``reference.py``) up to
the order of fp32 additions: at most 3.8e-5 nats on 40 real contexts
(``research/probes/surprisal_blas.py ranks``; ``tests/test_vocab_logsumexp.py``).
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# rows per sgemm and vocabulary rows per tile: a [256, 2048] fp32 scratch (2 MB) stays in the
# cache between the matmul and the logsumexp (on the 2-core EPYC: 0.90 s per 1,000 tokens on one
# thread against 1.01 for [128, 4096] and 0.79 for the matmuls alone)
ROW_BLOCK = 256
VOCAB_TILE = 2048


@functools.lru_cache(maxsize=1)
def _controller():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


class _OneBlasThread:
    """numpy's BLAS on one thread while any call runs (the first call in sets it, the last out
    restores it: calls from several threads at once do not restore each other's setting)."""

    def __init__(self):
        self.lock, self.depth, self.limit = threading.Lock(), 0, None

    def __enter__(self):
        with self.lock:
            if self.depth == 0:
                self.limit = _controller().limit(limits=1, user_api="blas")
            self.depth += 1

    def __exit__(self, *exc):
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self.limit.restore_original_limits()
                self.limit = None


_ONE_BLAS_THREAD = _OneBlasThread()


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """A pool of ``threads`` workers of this process (a forked child makes its own: the parent's
    workers do not exist there)."""
    key = (os.getpid(), threads)
    with _POOL_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="kdnctl-vocab")
        return pool


def _block_logsumexp(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out: np.ndarray,
                     tile: int) -> None:
    """``out[i]`` = logsumexp over the vocabulary of ``x[i] @ weight.T (+ bias)``, one row block."""
    m = x.shape[0]
    scratch = np.empty((m, min(tile, weight.shape[0])), np.float32)
    top = np.full(m, -np.inf, np.float32)
    total = np.zeros(m, np.float32)
    for s in range(0, weight.shape[0], tile):
        w = weight[s : s + tile]
        logits = scratch[:, : w.shape[0]]
        np.matmul(x, w.T, out=logits)
        if bias is not None:
            logits += bias[s : s + tile]
        new_top = np.maximum(top, logits.max(axis=1))
        # rows whose logits are all -inf keep a total of 0 (their logsumexp is -inf, as torch's)
        finite = np.isfinite(new_top)
        shift = np.where(finite, new_top, 0.0).astype(np.float32)
        total *= np.exp(np.where(np.isfinite(top), top - shift, -np.inf))
        np.subtract(logits, shift[:, None], out=logits)
        np.exp(logits, out=logits)
        total += logits.sum(axis=1)
        top = new_top
    with np.errstate(divide="ignore"):
        out[:] = np.log(total) + np.where(np.isfinite(top), top, 0.0)


def vocab_logsumexp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    threads: int | None = None, row_block: int = ROW_BLOCK, tile: int = VOCAB_TILE) -> torch.Tensor:
    """``x [m, d]`` and ``weight [V, d]`` (fp32, on the host) -> ``[m]`` fp32 logsumexp of
    ``x @ weight.T (+ bias)``, on ``threads`` threads (None: torch's thread count)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("the host vocabulary logsumexp takes fp32 CPU tensors")
    xs = np.ascontiguousarray(x.detach().numpy())
    ws = weight.detach().numpy()
    bs = None if bias is None else np.ascontiguousarray(bias.detach().float().numpy())
    m = xs.shape[0]
    out = np.empty(m, np.float32)
    threads = max(1, torch.get_num_threads() if threads is None else threads)
    blocks = [(s, min(m, s + row_block)) for s in range(0, m, row_block)]
    with _ONE_BLAS_THREAD:
        if threads == 1 or len(blocks) == 1:
            for s, e in blocks:
                _block_logsumexp(xs[s:e], ws, bs, out[s:e], tile)
        else:
            runs = [_pool(threads).submit(_block_logsumexp, xs[s:e], ws, bs, out[s:e], tile) for s, e in blocks]
            for r in runs:
                r.result()
    return torch.from_numpy(out)
