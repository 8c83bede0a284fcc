"""Would two codes to a byte inflate faster? The one-byte code frames of the 0.25 default, as
stored, against the same codes laid out as nibbles (codes in [-7, 7] two to a byte, 15 an escape
whose code follows in a side stream of int8 after the nibbles), both Huffman-only deflated by
zlib as the encoder does, both inflated by ISA-L in the decoder's own compiled loop.

    python research/probes/nibble_frames.py [--tokens 8000] [--repeats 7]

Most of a version's codes lie in frames whose peak is 8 or more (so stored a byte per code),
yet most of those codes are small. The inflate is ~40% of the CPU decode
(``inflate_floor.py``); its cost grows with the symbols it decodes, and a nibble byte is two
codes. Prints, per role: codes, the share within [-7, 7], deflated bytes and inflate seconds of
both layouts (medians, one thread). A layout only: nothing here is a decoder.

A second table asks the same of another coder: the frames of 4 KB or more deflated, their codes
compressed by zstd at level 1 (its literals Huffman-coded in four interleaved streams, which
decode without one chain of bits), each frame inflated / decompressed by one Python call on
either side (``isal_zlib``, ``zstandard``): ns per output byte, bytes against deflate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_version import default_bundles  # noqa: E402
from inflate_floor import blobs_of, isal_inflate_all  # noqa: E402

from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant.coders.deflate import deflate_compress  # noqa: E402


def nibbles(codes: np.ndarray) -> bytes:
    """``codes`` (int8) as nibbles, low first (``code + 7``; 15: escaped), then the escaped codes."""
    c = codes.astype(np.int16)
    d = np.where(np.abs(c) <= 7, c + 7, 15).astype(np.uint8)
    if d.size % 2:
        d = np.append(d, np.uint8(7))
    return (d[0::2] | (d[1::2] << 4)).tobytes() + codes[np.abs(c) > 7].tobytes()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bundles = default_bundles(load_model(dtype="float32"), args.tokens)
    print(f"{sum(b.n_tokens for b in bundles)} tokens; one-byte code frames only; medians of {args.repeats}, one thread\n")
    print("| role | codes | within [-7, 7] | stored: deflated MB | inflate s | nibbles: deflated MB | inflate s | "
          "nibbles / stored: bytes | inflate |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for role in ("keys", "values"):
        stored, nib, n_codes, small = [], [], 0, 0
        for blob in blobs_of(bundles, role):
            for frame, n, one_byte in blob:
                if not one_byte:
                    continue
                codes = np.frombuffer(zlib.decompress(frame, -15, n), np.int8)
                n_codes += codes.size
                small += int((np.abs(codes.astype(np.int16)) <= 7).sum())
                stored.append((frame, n))
                raw = nibbles(codes)
                nib.append((deflate_compress(raw), len(raw)))
        s_stored, _ = isal_inflate_all(stored, args.repeats)
        s_nib, _ = isal_inflate_all(nib, args.repeats)
        b_stored, b_nib = sum(len(f) for f, _ in stored), sum(len(f) for f, _ in nib)
        print(f"| {role} | {n_codes:,} | {small / n_codes:.1%} | {b_stored / 1e6:.1f} | {s_stored:.4f} | "
              f"{b_nib / 1e6:.1f} | {s_nib:.4f} | {b_nib / b_stored:.3f} | {s_nib / s_stored:.3f} |")
    print("\n| role | frames (>= 4 KB) | output MB | zstd / deflate bytes | ISA-L ns per byte | zstd ns per byte |")
    print("|---|---:|---:|---:|---:|---:|")
    for role in ("keys", "values"):
        print(zstd_row(role, [(f, n) for blob in blobs_of(bundles, role) for f, n, one in blob if one and len(f) >= 4096],
                       args.repeats))


def zstd_row(role: str, frames: list[tuple[bytes, int]], repeats: int) -> str:
    import zstandard
    from isal import isal_zlib

    raws = [zlib.decompress(f, -15, n) for f, n in frames]
    packed = [zstandard.ZstdCompressor(level=1).compress(r) for r in raws]
    dz = zstandard.ZstdDecompressor()
    sides = {"isal": lambda: [isal_zlib.decompress(f, -15, n) for f, n in frames],
             "zstd": lambda: [dz.decompress(z, max_output_size=len(r)) for z, r in zip(packed, raws)]}
    secs = {k: [] for k in sides}
    for fn in sides.values():
        fn()
    for _ in range(repeats):  # alternating, so load from other jobs falls on both
        for k, fn in sides.items():
            t = time.perf_counter()
            fn()
            secs[k].append(time.perf_counter() - t)
    out = sum(len(r) for r in raws)
    ratio = sum(map(len, packed)) / sum(len(f) for f, _ in frames)
    return (f"| {role} | {len(frames)} | {out / 1e6:.1f} | {ratio:.3f} | {statistics.median(secs['isal']) / out * 1e9:.2f} | "
            f"{statistics.median(secs['zstd']) / out * 1e9:.2f} |")


if __name__ == "__main__":
    main()
