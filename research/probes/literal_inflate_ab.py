"""The literal-only inflate (``literal_inflate.py`` beside it) against ISA-L's on the code
frames a real load inflates: seconds, ns per inflated byte, frames it leaves to ISA-L.

    python research/probes/huffman_inflate_ab.py [--tokens 8000] [--repeats 5]

Stores the shipped default (``--budget 0.25``) of one ``--tokens`` document (as
``inflate_floor.py`` does), collects every code frame per role, and times both inflaters over
all of them in one compiled loop each, one thread, taking turns; both must give the same bytes.
Then the same per bucket of deflated bits per inflated byte (how skewed a frame's codes are).
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_version import default_bundles  # noqa: E402
from inflate_floor import frames_of, isal_inflate_all, timed  # noqa: E402

import literal_inflate as hi  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402


BUCKETS = ((0, 1.5), (1.5, 2.0), (2.0, 2.5), (2.5, 3.0), (3.0, 4.0), (4.0, 9.0))


def literal_inflate_all(frames, repeats: int):
    src = np.frombuffer(b"".join(f for f, _ in frames), np.uint8)
    s_len = np.array([len(f) for f, _ in frames], np.int64)
    d_len = np.array([n for _, n in frames], np.int64)
    s_off = np.concatenate([[0], np.cumsum(s_len)[:-1]]).astype(np.int64)
    d_off = np.concatenate([[0], np.cumsum(d_len)[:-1]]).astype(np.int64)
    dst, ok = np.zeros(int(d_len.sum()) + 8, np.uint8), np.zeros(len(frames), np.bool_)
    table, work = hi.new_tables()
    s = timed(lambda: hi.inflate_frames(src, s_off, s_len, dst, d_off, d_len, table, work, ok), repeats)
    return s, dst[: int(d_len.sum())], ok


def check_against_zlib(seed: int = 0) -> str:
    """Huffman-only streams of many shapes must all decode, equal to zlib's; mutated streams
    (flips, overwrites, truncations, a byte appended, a wrong output size) may be left to a
    general inflater, but any it accepts must be exactly what zlib accepts and decodes."""
    rng = np.random.default_rng(seed)
    table, work = hi.new_tables()

    def frame(data: bytes, strategy=zlib.Z_HUFFMAN_ONLY) -> bytes:
        z = zlib.compressobj(6, zlib.DEFLATED, -15, 9, strategy)
        return z.compress(data) + z.flush()

    def ours(f: bytes, n: int):
        dst = np.zeros(n + 8, np.uint8)
        ok = hi.inflate_literals(np.frombuffer(f, np.uint8), 0, len(f), dst, 0, n, table, work)
        return ok, dst[:n].tobytes()

    shapes = (lambda n: np.clip(np.round(rng.normal(0, rng.uniform(0.3, 20), n)), -127, 127).astype(np.int8),
              lambda n: rng.integers(0, 256, n, dtype=np.uint8),  # stored blocks
              lambda n: rng.integers(0, int(rng.integers(1, 5)), n, dtype=np.uint8),
              lambda n: np.zeros(n, np.uint8))
    for trial in range(200):
        data = shapes[trial % 4](int(rng.integers(0, 70000))).tobytes()
        ok, got = ours(frame(data), len(data))
        assert ok and got == data, trial
        ok, got = ours(frame(data, zlib.Z_DEFAULT_STRATEGY), len(data))  # matches: left to a general inflater
        assert not ok or got == data
    for n in range(40):  # small inputs: fixed-code blocks
        data = rng.integers(0, 3, n, dtype=np.uint8).tobytes()
        assert ours(frame(data), n) == (True, data)
    accepted = 0
    for trial in range(3000):
        data = np.clip(np.round(rng.normal(0, 2, int(rng.integers(1, 3000)))), -127, 127).astype(np.int8).tobytes()
        f = bytearray(frame(data))
        i = int(rng.integers(0, len(f)))
        if trial % 4 == 0:
            f[i] ^= 1 << int(rng.integers(0, 8))
        elif trial % 4 == 1:
            f = f[:i]
        elif trial % 4 == 2:
            f.append(int(rng.integers(0, 256)))
        else:
            f[i] = int(rng.integers(0, 256))
        n = max(0, len(data) + (int(rng.integers(-2, 3)) if trial % 3 == 0 else 0))
        ok, got = ours(bytes(f), n)
        d = zlib.decompressobj(-15)
        try:
            want = d.decompress(bytes(f))
            z_ok = d.eof and not d.unused_data and len(want) == n
        except zlib.error:
            z_ok = False
        assert not ok or (z_ok and got == want), trial
        accepted += ok
    return f"checked against zlib: 280 streams decoded equal; 3000 mutated, {accepted} accepted, each as zlib does"


def synthetic(repeats: int, seed: int = 0) -> None:
    """Per-frame set-up against per-byte speed: many frames of rounded normal int8 codes of one
    size and spread, both inflaters, microseconds per frame and ns per byte."""
    rng = np.random.default_rng(seed)
    print("\n| frames of | spread (sigma) | frames | deflated bits per byte | ISA-L us per frame | literal-only us per frame | ISA-L ns per byte | literal-only ns per byte |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, count, sigma in ((64, 5000, 2.0), (7000, 1000, 2.0), (7000, 1000, 0.7), (1 << 20, 4, 2.0)):
        frames = []
        for _ in range(count):
            data = np.clip(np.round(rng.normal(0, sigma, n)), -127, 127).astype(np.int8).tobytes()
            z = zlib.compressobj(6, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
            frames.append((z.compress(data) + z.flush(), n))
        a, _ = isal_inflate_all(frames, repeats)
        b, _, ok = literal_inflate_all(frames, repeats)
        assert ok.all()
        bits = sum(len(f) for f, _ in frames) * 8 / (n * count)
        print(f"| {n} | {sigma} | {count} | {bits:.2f} | {a / count * 1e6:.2f} | {b / count * 1e6:.2f} | "
              f"{a / (n * count) * 1e9:.2f} | {b / (n * count) * 1e9:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(check_against_zlib())
    synthetic(args.repeats)
    bundles = default_bundles(load_model(dtype="float32"), args.tokens)
    print(f"{sum(b.n_tokens for b in bundles)} tokens, {len(bundles)} chunks; medians of {args.repeats}, one thread\n")
    print("| role | frames | inflated MB | ISA-L s | literal-only s | literal / ISA-L | ns per byte (ISA-L, literal) | frames left to ISA-L |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for role in ("keys", "values"):
        frames = frames_of(bundles, role)
        a, want = isal_inflate_all(frames, args.repeats)
        b, got, ok = literal_inflate_all(frames, args.repeats)
        a2, _ = isal_inflate_all(frames, args.repeats)  # (turns: the ISA-L side timed before and after)
        a = min(a, a2)
        assert np.array_equal(got[ok.repeat([n for _, n in frames])], want[ok.repeat([n for _, n in frames])])
        print(f"| {role} | {len(frames)} | {want.size / 1e6:.1f} | {a:.4f} | {b:.4f} | {b / a:.2f} | "
              f"{a / want.size * 1e9:.2f}, {b / want.size * 1e9:.2f} | {int((~ok).sum())} |")
    print("\n| role | deflated bits per byte | frames | inflated MB | mean frame bytes | ISA-L s | literal-only s | literal / ISA-L |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for role in ("keys", "values"):
        frames = frames_of(bundles, role)
        bpb = [len(f) * 8 / n for f, n in frames]
        for lo, hi_ in BUCKETS:
            sel = [fr for fr, x in zip(frames, bpb) if lo <= x < hi_]
            if not sel:
                continue
            a, _ = isal_inflate_all(sel, args.repeats)
            b, _, _ = literal_inflate_all(sel, args.repeats)
            n = sum(m for _, m in sel)
            print(f"| {role} | {lo}-{hi_} | {len(sel)} | {n / 1e6:.1f} | {n / len(sel):.0f} | {a:.4f} | {b:.4f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
