"""Would interleaved rANS decode ec's code frames faster than ISA-L inflates them, in fewer bytes?

    python research/probes/rans_frames.py [--tokens 8000] [--repeats 5] [--ways 4,8] [--bits 11,12]

The CPU decode of the 0.25 default spends about 40% of its time in ISA-L's inflate of the code
frames (``inflate_floor.py``): Huffman-only deflate streams, one per (chunk, layer, role, spread
bin). A format made for fast decoding would code the same bytes (the frames as inflated: int8
codes or packed digits) with another entropy coder. This probe measures one candidate on the
frames a real load inflates, one thread, the same run:

* per frame, an order-0 model: the byte histogram normalised to ``2**bits`` (every byte present
  at least 1), stored as a table of frequencies (its bytes counted below: the number of the
  largest byte value present, then each value's frequency in one byte below 128, else two);
* ``ways`` rANS states interleaved over one byte stream (32-bit states, byte-wise renormalisation,
  lower bound ``2**23``), decoded through a ``2**bits``-entry table per frame that gives each slot
  its byte, frequency and offset;
* sizes against the stored deflate frames (their Huffman tables included) and the frames'
  order-0 entropy; seconds against ISA-L's stateless inflate called from the decoder's own
  compiled loop (``kdnctl.kernels.ec.cpu``), both over every frame of the role in one call;
  every decoded frame must equal the inflated one.

Encoding is in the probe only (compiled, not timed).
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path

import numba
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_version import default_bundles  # noqa: E402
from inflate_floor import frames_of, isal_inflate_all, timed  # noqa: E402

from kdnctl.models.load import load_model  # noqa: E402

RANS_L = 1 << 23


def normalised(counts: np.ndarray, bits: int) -> np.ndarray:
    """Frequencies summing to ``2**bits``, every present byte at least 1 (largest remainders,
    then the largest frequency pays for the ones raised to 1)."""
    total = 1 << bits
    present = counts > 0
    f = np.zeros(256, np.int64)
    if not present.any():
        return f
    exact = counts[present] * total / counts.sum()
    q = np.maximum(np.floor(exact).astype(np.int64), 1)
    short = total - int(q.sum())
    order = np.argsort(-(exact - np.floor(exact)))
    i = 0
    while short > 0:
        q[order[i % q.size]] += 1
        short -= 1
        i += 1
    while short < 0:
        j = int(np.argmax(q))
        q[j] -= 1
        short += 1
    f[present] = q
    return f


def table_bytes(freq: np.ndarray) -> int:
    top = int(np.flatnonzero(freq).max()) if freq.any() else 0
    return 1 + sum(1 if v < 128 else 2 for v in freq[:top + 1])


@numba.njit(cache=True)
def encode(sym, freq, cum, bits, ways, out):
    """Bytes of ``sym`` coded with ``ways`` interleaved states, written backwards from the end of
    ``out``; returns the first byte's index (the stream is ``out[start:]``)."""
    x = np.full(ways, RANS_L, np.uint64)
    p = out.shape[0]
    n = sym.shape[0]
    for i in range(n - 1, -1, -1):
        k = i % ways
        s = sym[i]
        fs = np.uint64(freq[s])
        xs = x[k]
        x_max = np.uint64(((RANS_L >> bits) << 8)) * fs
        while xs >= x_max:
            p -= 1
            out[p] = np.uint8(xs & np.uint64(0xFF))
            xs >>= np.uint64(8)
        x[k] = ((xs // fs) << np.uint64(bits)) + (xs % fs) + np.uint64(cum[s])
    for k in range(ways - 1, -1, -1):  # the decoder reads state 0 first
        for b in range(4):
            p -= 1
            out[p] = np.uint8((x[k] >> np.uint64(8 * b)) & np.uint64(0xFF))
    return p


@numba.njit(cache=True, nogil=True)
def decode_frames(src, s_off, freqs, f_off, n_sym, d_off, dst, bits, ways, slots):
    """Every frame: its ``2**bits``-slot table from its frequencies (each slot: its byte, its
    byte's frequency less one, its offset in the byte's range), then its symbols."""
    mask = (1 << bits) - 1
    x = np.empty(ways, np.uint32)
    for f in range(s_off.shape[0]):
        fr = freqs[f_off[f]:f_off[f] + 256]
        c = 0
        for s in range(256):
            v = fr[s]
            for j in range(v):
                slots[c + j] = (np.uint32(s) << 24) | (np.uint32(v - 1) << 12) | np.uint32(j)
            c += v
        p = s_off[f]
        for k in range(ways):
            x[k] = (np.uint32(src[p]) << 24) | (np.uint32(src[p + 1]) << 16) | (np.uint32(src[p + 2]) << 8) | np.uint32(src[p + 3])
            p += 4
        out = d_off[f]
        n = n_sym[f]
        i = 0
        while i < n:
            for k in range(ways):
                if i >= n:
                    break
                xs = x[k]
                e = slots[xs & mask]
                dst[out + i] = np.uint8(e >> 24)
                xs = (((e >> 12) & 0xFFF) + 1) * (xs >> bits) + (e & 0xFFF)
                while xs < RANS_L:
                    xs = (xs << 8) | np.uint32(src[p])
                    p += 1
                x[k] = xs
                i += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ways", default="4,8")
    ap.add_argument("--bits", default="11,12")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bundles = default_bundles(load_model(dtype="float32"), args.tokens)
    print(f"{sum(b.n_tokens for b in bundles)} tokens, {len(bundles)} chunks; medians of {args.repeats}, one thread\n")
    print("| role | frames | inflated MB | deflate MB | order-0 MB | coder | MB (table MB) | / deflate | decode s | "
          "ns per byte | ISA-L s | ISA-L / coder |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for role in ("keys", "values"):
        frames = [(f, n) for f, n in frames_of(bundles, role) if n]
        plain = [zlib.decompress(f, -15, n) for f, n in frames]
        deflated = sum(len(f) for f, _ in frames)
        d_len = np.array([n for _, n in frames], np.int64)
        d_off = np.concatenate([[0], np.cumsum(d_len)[:-1]]).astype(np.int64)
        isal_s, dst = isal_inflate_all(frames, args.repeats)
        assert dst.tobytes() == b"".join(plain)
        entropy = 0.0
        hists = [np.bincount(np.frombuffer(p, np.uint8), minlength=256) for p in plain]
        for h in hists:
            q = h[h > 0] / h.sum()
            entropy += float(-(q * np.log2(q)).sum() * h.sum()) / 8
        for bits in (int(b) for b in args.bits.split(",")):
            freqs = [normalised(h, bits) for h in hists]
            cums = [np.concatenate([[0], np.cumsum(f)[:-1]]) for f in freqs]
            for ways in (int(w) for w in args.ways.split(",")):
                streams = []
                for p, f, c in zip(plain, freqs, cums):
                    sym = np.frombuffer(p, np.uint8)
                    out = np.empty(2 * sym.size + 4 * ways + 16, np.uint8)
                    start = encode(sym, f, c, bits, ways, out)
                    streams.append(out[start:].tobytes())
                r_src = np.frombuffer(b"".join(streams) + bytes(8), np.uint8)
                r_len = np.array([len(s) for s in streams], np.int64)
                r_off = np.concatenate([[0], np.cumsum(r_len)[:-1]]).astype(np.int64)
                fr = np.concatenate(freqs).astype(np.int32)
                f_off = np.arange(len(freqs), dtype=np.int64) * 256
                out = np.zeros_like(dst)
                slots = np.empty(1 << bits, np.uint32)
                s = timed(lambda: decode_frames(r_src, r_off, fr, f_off, d_len, d_off, out, bits, ways, slots), args.repeats)
                assert out.tobytes() == dst.tobytes(), (role, bits, ways)
                tables = sum(table_bytes(f) for f in freqs)
                total = int(r_len.sum()) + tables
                print(f"| {role} | {len(frames)} | {dst.size / 1e6:.1f} | {deflated / 1e6:.2f} | {entropy / 1e6:.2f} | "
                      f"rANS {ways}-way, {bits}-bit | {total / 1e6:.2f} ({tables / 1e6:.2f}) | {total / deflated:.3f} | "
                      f"{s:.4f} | {s / dst.size * 1e9:.2f} | {isal_s:.4f} | {isal_s / s:.2f} |")
    print("\n(deflate MB: the stored frames, Huffman tables included; every rANS frame decoded equal to its "
          "inflated frame)")


if __name__ == "__main__":
    main()
