"""The RoPE tables' cache (``kdnctl.quant.transforms._CosSinCache``): the tables it returns are
the ones computed without it, and it holds no more than its byte limit."""

from __future__ import annotations

import threading

import torch

from kdnctl.quant import transforms as tf


def _key(pos: torch.Tensor, d: int, theta: float = 10000.0) -> tuple:
    p = pos.contiguous()
    return (p.numpy().tobytes(), p.dtype, tuple(p.shape), d, float(theta))


def test_tables_equal_the_uncached_ones_and_are_kept():
    g = torch.Generator().manual_seed(3)
    for pos, d in [(torch.arange(17, 17 + 37), 6), (torch.randint(0, 9000, (3, 29), generator=g), 10),
                   (torch.arange(5, dtype=torch.int32), 2)]:
        got = tf._cos_sin(pos, d, 500000.0)
        want = tf._cos_sin_of(pos, d, 500000.0)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        again = tf._cos_sin(pos.clone(), d, 500000.0)
        assert again[0] is got[0] and again[1] is got[1]  # the same positions: the kept tables


def test_other_theta_size_or_dtype_are_other_tables():
    pos = torch.arange(40)
    a = tf._cos_sin(pos, 8, 10000.0)
    assert not torch.equal(a[0], tf._cos_sin(pos, 8, 20000.0)[0])
    assert tf._cos_sin(pos, 16, 10000.0)[0].shape == (40, 16)
    b = tf._cos_sin(pos.to(torch.int32), 8, 10000.0)
    assert b[0] is not a[0] and torch.equal(b[0], a[0])


def test_byte_limit_least_recently_used_out_first():
    per = 2 * 10 * 4 * 4  # cos and sin of 10 positions at size 4, fp32
    cache = tf._CosSinCache(3 * per)
    keys = [_key(torch.arange(s, s + 10), 4) for s in range(0, 50, 10)]
    for k in keys[:3]:
        cache.get(k)
    cache.get(keys[0])  # used again: now the most recent
    cache.get(keys[3])  # pushes out keys[1], the least recently used
    assert list(cache.tables) == [keys[2], keys[0], keys[3]] and cache.bytes == 3 * per
    big = _key(torch.arange(100), 4)  # larger than the whole limit: returned, not kept
    cos, sin = cache.get(big)
    assert torch.equal(cos, tf._cos_sin_of(torch.arange(100), 4, 10000.0)[0])
    assert big not in cache.tables and cache.bytes == 3 * per
    for k in keys:
        cache.get(k)
        assert cache.bytes <= 3 * per and len(cache.tables) <= 3


def test_threads_asking_at_once_get_equal_tables():
    cache = tf._CosSinCache(1 << 20)
    keys = [_key(torch.arange(s, s + 64), 8) for s in range(0, 64 * 12, 64)]
    results, errors = [[] for _ in range(4)], []

    def ask(i: int) -> None:
        try:
            for _ in range(20):
                for k in keys:
                    results[i].append(cache.get(k)[0])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(1, 4):
        assert all(torch.equal(a, b) for a, b in zip(results[0], results[i]))
    assert cache.bytes == sum(2 * v[0].numel() * 4 for v in cache.tables.values()) <= 1 << 20
