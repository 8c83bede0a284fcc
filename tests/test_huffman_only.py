"""The compiled Huffman-only deflate (kdnctl/kernels/ec/huffman_only.py) against zlib itself
(``coders.deflate.deflate_compress``): the same bytes for every kind of block zlib writes
(stored, fixed, dynamic; one block and several; length-limited trees; the empty last block),
one stream at a time and every frame of a buffer in one call, and blobs that inflate back."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kdnctl.kernels.ec import huffman_only as ho
from kdnctl.kernels.ec.zlib_blocks import BLOCK_LITERALS, DYNAMIC, STATIC, STORED, block_plan, new_work
from kdnctl.quant.coders.deflate import deflate_compress
from kdnctl.quant.entropy import encode_codes
from kdnctl.quant.frames import frame_blob


def _streams() -> list[np.ndarray]:
    g = np.random.default_rng(11)
    fib = [1, 1]
    while len(fib) < 22:
        fib.append(fib[-1] + fib[-2])
    deep = np.concatenate([np.full(f, i, np.uint8) for i, f in enumerate(fib)])  # one block, a tree past 15 bits
    g.shuffle(deep)
    out = [np.zeros(0, np.uint8), np.zeros(1, np.uint8), np.array([1, 2], np.uint8), np.full(5000, 3, np.uint8),
           g.integers(0, 256, 3001).astype(np.uint8),  # uniform: stays stored
           np.concatenate([np.zeros(999, np.uint8), np.full(3, 200, np.uint8), np.full(51, 7, np.uint8)]),
           (np.arange(30011) % 256).astype(np.uint8), deep]
    for n in (3, 17, 255, 1001, BLOCK_LITERALS - 1, BLOCK_LITERALS, BLOCK_LITERALS + 1, 2 * BLOCK_LITERALS, 70001):
        for p in (0.02, 0.3, 0.8):
            out.append((g.geometric(p, n) % 256).astype(np.uint8))
    return out


def test_every_kind_of_block_appears():
    kinds, longest = set(), 0
    for s in _streams():
        hist = np.bincount(s[:BLOCK_LITERALS], minlength=256).astype(np.int64)
        work = new_work()
        kind, _, ml, _, _ = block_plan(hist, min(s.shape[0], BLOCK_LITERALS), work)
        kinds.add(kind)
        if kind == DYNAMIC:
            longest = max(longest, int(work[1][:ml + 1].max()))
    assert kinds == {STORED, STATIC, DYNAMIC}
    assert longest == 15  # (a tree zlib had to limit)


def test_one_stream_equals_zlib():
    for s in _streams():
        assert ho.deflate(s.tobytes()) == deflate_compress(s.tobytes()), s.shape


def test_frames_equal_zlib_and_inflate_back():
    streams = _streams()
    buf = np.concatenate(streams)
    offsets = np.concatenate([[0], np.cumsum([s.shape[0] for s in streams])]).astype(np.int64)
    out, ends = ho.deflate_frames(buf, offsets)
    start = 0
    for s, end in zip(streams, ends.tolist()):
        frame = out[start:end].tobytes()
        assert frame == (deflate_compress(s.tobytes()) if s.shape[0] else b"")  # (an empty frame: no bytes)
        if s.shape[0]:
            assert zlib.decompress(frame, -15) == s.tobytes()
        start = end


@pytest.mark.parametrize("seed,h,t,d,scale", [(0, 3, 37, 16, 4.0), (1, 2, 256, 64, 30.0), (2, 1, 5, 7, 300.0),
                                                (3, 4, 61, 8, 0.4)])
def test_blob_equals_the_zlib_blob(seed, h, t, d, scale):
    """The codes blob the encoder stores (frames deflated in one compiled call) is the blob with
    each frame deflated by zlib."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.round(torch.randn(h, t, d, generator=g) * scale * torch.rand(h, 1, d, generator=g)).clamp(-32767, 32767)
    blob, bins = encode_codes(codes, "deflate")
    width = int(blob[0])
    assert bytes(blob.numpy()) == frame_blob(codes, bins, width, deflate_compress)


def test_warm_checks_the_writer():
    from kdnctl.kernels.ec import deflate_size

    assert deflate_size.writes_zlib_bytes()
