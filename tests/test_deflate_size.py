"""The scale fit's counted sizes (``kdnctl.kernels.ec.deflate_size``, ``PayloadSize``) against
what the encoder writes: zlib's own deflate is the reference, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdnctl.kernels.ec import deflate_size as ds
from kdnctl.quant.coders.deflate import deflate_compress
from kdnctl.quant.entropy import encode_codes, spread_bins


def _streams():
    g = np.random.default_rng(3)
    fib = [1, 1]
    while len(fib) < 24:
        fib.append(fib[-1] + fib[-2])
    # Fibonacci frequencies: a Huffman tree deeper than deflate's 15 bits (zlib's length fix-up)
    deep = np.repeat(np.arange(24), fib).astype(np.uint8)
    g.shuffle(deep)
    yield "one byte", np.zeros(1, np.uint8)
    yield "one symbol", np.full(4097, 9, np.uint8)
    yield "uniform (stored blocks)", g.integers(0, 256, 5000).astype(np.uint8)
    yield "uniform, several blocks", g.integers(0, 256, 3 * ds.BLOCK_LITERALS + 11).astype(np.uint8)
    yield "deep tree", deep
    for n in (ds.BLOCK_LITERALS - 1, ds.BLOCK_LITERALS, ds.BLOCK_LITERALS + 1, 2 * ds.BLOCK_LITERALS):
        yield f"skewed {n}", np.minimum(g.geometric(0.2, n), 255).astype(np.uint8)
    for p in (0.02, 0.3, 0.8):
        yield f"geometric {p}", np.minimum(g.geometric(p, int(g.integers(1, 40000))), 255).astype(np.uint8)
    yield "few symbols", g.integers(0, 3, 777).astype(np.uint8) * 80
    yield "normal codes", (np.round(g.standard_normal(20000) * 9) % 256).astype(np.uint8)


@pytest.mark.parametrize("name,data", list(_streams()), ids=[n for n, _ in _streams()])
def test_stream_bytes_equal_zlibs(name, data):
    assert ds.stream_bytes(data) == len(deflate_compress(data.tobytes()))


def test_this_zlib_is_the_one_counted():
    assert ds.matches_zlib()


SHAPES = [(3, 256, 64), (2, 7, 8), (4, 100, 16), (1, 1, 5), (3, 37, 24), (2, 20001, 4)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [0.2, 1.5, 9.0, 300.0, 4000.0])
def test_blob_bytes_equal_the_encoders(shape, scale):
    g = torch.Generator().manual_seed(hash((shape, scale)) % 1000)
    h, t, d = shape
    codes = torch.round(torch.randn(h, t, d, generator=g) * scale * torch.rand(1, 1, d, generator=g))
    codes[0, 0, 0] = 0.0 if scale < 1000 else 32767.0  # (the widest code int16 holds)
    bins = spread_bins(codes).flatten()
    peaks = np.empty(h * d, np.int64)
    mine = np.empty(h * d, np.uint8)
    if ds.spread_bins_exact(codes.numpy(), mine, peaks):
        assert (mine == bins.numpy()).all()
    assert (peaks == codes.abs().amax(1).flatten().long().numpy()).all()
    want = len(encode_codes(codes, "deflate", own_widths=False)[0])
    assert ds.codes_blob_bytes(codes.numpy(), bins.numpy(), peaks) == want


def test_codes_beyond_int16_are_refused_as_the_encoder_refuses_them():
    codes = torch.zeros(1, 4, 3)
    codes[0, 2, 1] = 40000.0
    peaks = np.empty(3, np.int64)
    bins = np.empty(3, np.uint8)
    ds.spread_bins_exact(codes.numpy(), bins, peaks)
    assert ds.codes_blob_bytes(codes.numpy(), bins, peaks) == -1


def test_bins_flag_a_spread_at_a_bins_edge():
    """Codes 0 and 1, ``ones`` of them 1: spread ``sqrt(p (1 - p))``. A count whose spread puts
    twice the log2 of (spread + 0.25) within the margin of a half is left to torch's rounding."""
    t = 1 << 16
    ones = np.arange(1, t)
    p = ones / t
    v = np.log2(np.sqrt(p * (1 - p)) + 0.25) * 2
    off = np.abs(v - np.floor(v) - 0.5)
    near, far = ones[off < ds.BIN_MARGIN / 2], ones[off > 2 * ds.BIN_MARGIN][::4000]
    assert len(near) and len(far)
    bins, peaks = np.empty(1, np.uint8), np.empty(1, np.int64)
    for n, trusted in [*((int(n), False) for n in near), *((int(n), True) for n in far)]:
        codes = torch.zeros(1, t, 1)
        codes[0, :n, 0] = 1.0
        assert ds.spread_bins_exact(codes.numpy(), bins, peaks) == trusted
        if trusted:
            assert int(bins[0]) == int(spread_bins(codes)[0, 0])


def test_counted_payload_equals_the_encoded_one_through_a_compress(tiny_lm, tmp_path_factory, monkeypatch):
    """Every probe of real compresses (every token kept, and tokens evicted: chunks of unequal
    lengths) counts the bytes ``codes_at`` encodes, on a tiny model with odd chunk sizes."""
    from budgetkit import trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.compress.stages import payload_size as ps
    from kdnctl.compress.stages import quantize as qz

    checked = []
    counted = ps.PayloadSize.__call__

    def both(self, alpha):
        n = counted(self, alpha)
        checked.append((n, sum(t.numel() for c in qz.codes_at(self.job, alpha, own_widths=False) for t in c.values())))
        return n

    monkeypatch.setattr(ps.PayloadSize, "__call__", both)
    st = trimmed_store(tmp_path_factory, tiny_lm, {"meeting-notes-2026-03.txt": 301, "faq.md": 190})
    with st.writer():
        for doc in ("meeting-notes-2026-03.txt", "faq.md"):
            # (the tiny model's chunks carry headers of a fifth of their fp16 bytes: larger budgets)
            for recipe in (CompressRecipe(budget=0.6, quant="ec"),
                           CompressRecipe(budget=0.6, quant="ec", keep=0.5, protect=16, scorer="sentences")):
                compress_document(st, doc, recipe, lm=tiny_lm)
    assert len(checked) >= 8
    assert all(a == b for a, b in checked), checked


def test_a_compress_whose_probes_are_counted_encodes_once(tiny_lm, tmp_path_factory, monkeypatch):
    """Every probe counted, and an attempt whose counted objects miss the cap refitted without
    encoding: the version is encoded once, at the scale it stores."""
    from budgetkit import trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.compress.stages import encode
    from kdnctl.compress.stages import quantize as qz

    encodes = []
    real = qz.codes_at

    def counting(job, alpha, *a, **k):
        encodes.append(alpha)
        return real(job, alpha, *a, **k)

    monkeypatch.setattr(encode.qz, "codes_at", counting)
    st = trimmed_store(tmp_path_factory, tiny_lm, {"lab-protocol.rst": 333})
    with st.writer():
        out = compress_document(st, "lab-protocol.rst", CompressRecipe(budget=0.6, quant="ec"), lm=tiny_lm)
    assert out.status == "compressed"
    assert len(encodes) == 1
