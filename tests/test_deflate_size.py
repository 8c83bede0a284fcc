"""The scale fit's counted sizes (``kdnctl.kernels.ec.deflate_size``, ``PayloadSize``) against
what the encoder writes: zlib's own deflate is the reference, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdnctl.kernels.ec import deflate_size as ds
from kdnctl.quant.coders.deflate import deflate_compress
from kdnctl.quant.entropy import SPREAD_BINS_PER_OCTAVE, encode_codes, spread_bins


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


@pytest.mark.parametrize("own", [False, True], ids=["two-byte frames", "own widths"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [0.2, 1.5, 9.0, 300.0, 4000.0])
def test_blob_bytes_equal_the_encoders(shape, scale, own):
    g = torch.Generator().manual_seed(hash((shape, scale)) % 1000)
    h, t, d = shape
    codes = torch.round(torch.randn(h, t, d, generator=g) * scale * torch.rand(1, 1, d, generator=g))
    codes[0, 0, 0] = 0.0 if scale < 1000 else 32767.0  # (the widest code int16 holds)
    bins = spread_bins(codes).flatten()
    peaks = np.empty(h * d, np.int64)
    mine = np.empty(h * d, np.uint8)
    if ds.spread_bins_exact(codes.numpy(), mine, peaks, SPREAD_BINS_PER_OCTAVE):
        assert (mine == bins.numpy()).all()
    assert (peaks == codes.abs().amax(1).flatten().long().numpy()).all()
    want = len(encode_codes(codes, "deflate", own_widths=own)[0])
    assert ds.codes_blob_bytes(codes.numpy(), bins.numpy(), peaks, own) == want


def test_codes_beyond_int16_are_refused_as_the_encoder_refuses_them():
    codes = torch.zeros(1, 4, 3)
    codes[0, 2, 1] = 40000.0
    peaks = np.empty(3, np.int64)
    bins = np.empty(3, np.uint8)
    ds.spread_bins_exact(codes.numpy(), bins, peaks, SPREAD_BINS_PER_OCTAVE)
    assert ds.codes_blob_bytes(codes.numpy(), bins, peaks) == -1


@pytest.mark.parametrize("per_octave", [1, 2])
def test_bins_flag_a_spread_at_a_bins_edge(per_octave):
    """Codes 0 and 1, ``ones`` of them 1: spread ``sqrt(p (1 - p))``. A count whose spread puts
    ``per_octave`` times the log2 of (spread + 0.25) within the margin of a half is left to
    torch's rounding."""
    t = 1 << 16
    ones = np.arange(1, t)
    p = ones / t
    v = np.log2(np.sqrt(p * (1 - p)) + 0.25) * per_octave
    off = np.abs(v - np.floor(v) - 0.5)
    near, far = ones[off < ds.BIN_MARGIN / 2], ones[off > 2 * ds.BIN_MARGIN][::4000]
    assert len(near) and len(far)
    bins, peaks = np.empty(1, np.uint8), np.empty(1, np.int64)
    for n, trusted in [*((int(n), False) for n in near), *((int(n), True) for n in far)]:
        codes = torch.zeros(1, t, 1)
        codes[0, :n, 0] = 1.0
        assert ds.spread_bins_exact(codes.numpy(), bins, peaks, per_octave) == trusted
        if trusted:
            assert int(bins[0]) == int(spread_bins(codes, per_octave=per_octave)[0, 0])


def test_counted_payload_equals_the_encoded_one_through_a_compress(tiny_lm, tmp_path_factory, monkeypatch):
    """Every probe of real compresses (every token kept, and tokens evicted: chunks of unequal
    lengths) counts the bytes ``codes_at`` encodes, on a tiny model with odd chunk sizes."""
    from budgetkit import trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.compress.stages import payload_size as ps
    from kdnctl.compress.stages import quantize as qz

    checked, widths = [], set()
    counted = ps.PayloadSize.__call__

    def both(self, alpha):
        n = counted(self, alpha)
        checked.append((n, sum(t.numel() for c in qz.codes_at(self.job, alpha, own_widths=False) for t in c.values())))
        # the version's blobs from the counted codes are codes_at's, byte for byte and in its order
        stored, encoded = self.blobs(alpha), qz.codes_at(self.job, alpha)
        assert stored is not None and [list(c) for c in stored] == [list(c) for c in encoded]
        assert all(torch.equal(a[k], b[k]) for a, b in zip(stored, encoded) for k in a)
        widths.update(int(t[0]) for c in stored for k, t in c.items() if k.endswith(".codes"))
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
    assert widths == {1, 3}  # blobs of one-byte codes, and of frames at their own widths


def test_a_compress_whose_probes_are_counted_encodes_once(tiny_lm, tmp_path_factory, monkeypatch):
    """Every probe counted, and an attempt whose counted objects miss the cap refitted without
    encoding: the version is encoded once, at the scale it stores, from the counted codes."""
    from budgetkit import trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.compress.stages import encode
    from kdnctl.compress.stages import payload_size as ps
    from kdnctl.compress.stages import quantize as qz

    encodes, stored = [], []
    real, real_blobs = qz.codes_at, ps.PayloadSize.blobs

    def counting(job, alpha, *a, **k):
        encodes.append(alpha)
        return real(job, alpha, *a, **k)

    def counting_blobs(self, alpha):
        stored.append(alpha)
        return real_blobs(self, alpha)

    monkeypatch.setattr(encode.qz, "codes_at", counting)
    monkeypatch.setattr(ps.PayloadSize, "blobs", counting_blobs)
    st = trimmed_store(tmp_path_factory, tiny_lm, {"lab-protocol.rst": 333})
    with st.writer():
        out = compress_document(st, "lab-protocol.rst", CompressRecipe(budget=0.6, quant="ec"), lm=tiny_lm)
    assert out.status == "compressed"
    assert encodes == [] and len(stored) == 1


def test_blobs_that_miss_their_counts_make_the_compress_fit_from_encodes(tiny_lm, tmp_path_factory, monkeypatch):
    """Where a stored blob's bytes are not its count (another deflate than the one counted), the
    compress drops the counts, fits from real encodes and stores ``codes_at``'s blobs: the
    version's codes blobs are those a compress without counting stores at the same scale, under
    the cap."""
    from budgetkit import fp16_size, trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.compress.stages import encode
    from kdnctl.compress.stages import payload_size as ps
    from kdnctl.compress.stages import quantize as qz
    from kdnctl.format.bundle import decode_bundle
    from kdnctl.kernels.ec import deflate_size

    st = trimmed_store(tmp_path_factory, tiny_lm, {"lab-protocol.rst": 333})
    encodes = []
    real, real_count = qz.codes_at, deflate_size.codes_blob_bytes

    def counting(job, alpha, *a, **k):
        out = real(job, alpha, *a, **k)
        encodes.append((alpha, k.get("own_widths", True), out))
        return out

    monkeypatch.setattr(encode.qz, "codes_at", counting)
    monkeypatch.setattr(ps.deflate_size, "codes_blob_bytes",
                        lambda codes, bins, peaks, own=False: real_count(codes, bins, peaks, own) + (1 if own else 0))
    with st.writer():
        compress_document(st, "lab-protocol.rst", CompressRecipe(budget=0.6, quant="ec"), lm=tiny_lm, label="missed")
    version = st.get_version("lab-protocol.rst", "missed")
    bundles = [decode_bundle(st.read_object(c.object)) for c in version.chunks]
    alpha = bundles[0].meta["quant"]["alpha"]
    probes = [a for a, own, _ in encodes if not own]
    assert len(probes) >= 2 and alpha in {round(a, 6) for a in probes}  # the fit encoded its probes
    last = [out for a, own, out in encodes if own]
    assert len(last) == 1  # the version, encoded once at its frames' own widths
    assert all(torch.equal(b.tensors[k], t) for b, chunk in zip(bundles, last[0]) for k, t in chunk.items())
    assert sum(c.nbytes for c in version.chunks) <= 0.6 * fp16_size(st, "lab-protocol.rst")
