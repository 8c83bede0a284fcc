"""What the inflate of an ec version's code frames costs on its own, by role and frame size, and
against other inflaters: the floor under the CPU decode.

    python research/probes/inflate_floor.py [--tokens 8000] [--repeats 5]

Builds one document of ``--tokens`` tokens (the example corpus, as ``bench/ttft.py`` does) and
stores the shipped default (``--budget 0.25``). Collects every code frame of each role (the
frames a load inflates; params frames aside), then times, as medians of ``--repeats``, one
thread:

* ISA-L's stateless inflate of every frame of the role, called from the decoder's own compiled
  loop (``kdnctl.kernels.ec.cpu``'s ``inflate_frames``): seconds, ns per output byte;
* per frame size bucket, ISA-L and zlib called from Python, one frame per call (the same
  Python cost on both sides), and libdeflate where the ``deflate`` package is installed
  (``pip install deflate``; not a dependency of kdnctl).

Every inflater must give the same bytes.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_version import default_bundles  # noqa: E402

from kdnctl.format.names import tensor_name  # noqa: E402
from kdnctl.kernels.ec import cpu, digits  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402

BUCKETS = ((0, 256), (256, 1024), (1024, 4096), (4096, 1 << 40))


def blobs_of(bundles, role: str) -> list[list[tuple[bytes, int, bool]]]:
    """Per (chunk, layer) codes blob of ``role``: each stored frame's (deflated bytes, inflated
    size, whether it holds one-byte codes: int8, not packed digits), frames of no bytes left out."""
    out = []
    for b in bundles:
        t = b.layer_len(0)
        h, d = b.meta["quant"]["n_heads"], b.meta["quant"]["head_dim"]
        for i in range(b.n_layers):
            raw = b.tensors[f"{tensor_name(i, role)}.codes"].numpy()
            params = zlib.decompress(b.tensors[f"{tensor_name(i, role)}.params"].numpy().tobytes(), -15)
            counts = np.bincount(np.frombuffer(params[4 * h * d:], np.uint8), minlength=256)
            counts = counts[counts > 0]
            width, n_frames = int(raw[0]), int(raw[1])
            sizes = raw[2:2 + 4 * n_frames].view(np.uint32)
            peaks = raw[2 + 4 * n_frames:2 + 6 * n_frames].view(np.int16)
            pos, frames = 2 + 6 * n_frames, []
            for f in range(n_frames):
                size, peak = int(sizes[f]), int(peaks[f])
                per, m = digits.codes_per_byte(peak), int(counts[f]) * t
                n = 0 if per == 0 else (m + per - 1) // per if per > 1 else digits.frame_width(width, peak) * m
                if size:
                    frames.append((raw[pos:pos + size].tobytes(), n, per == 1 and digits.frame_width(width, peak) == 1))
                pos += size
            out.append(frames)
    return out


def frames_of(bundles, role: str) -> list[tuple[bytes, int]]:
    """(deflated frame, its inflated size) of every stored code frame of ``role``."""
    return [(f, n) for blob in blobs_of(bundles, role) for f, n, _ in blob]


def isal_inflate_all(frames: list[tuple[bytes, int]], repeats: int) -> tuple[float, np.ndarray]:
    """(median seconds, the inflated bytes) of ISA-L's stateless inflate of every ``(deflated
    frame, inflated size)``, one call of the decoder's own compiled loop (``cpu.kernels``)."""
    inflate_frames = cpu.kernels()[0]
    src = np.frombuffer(b"".join(f for f, _ in frames), np.uint8)
    s_len = np.array([len(f) for f, _ in frames], np.int64)
    d_len = np.array([n for _, n in frames], np.int64)
    s_off = np.concatenate([[0], np.cumsum(s_len)[:-1]]).astype(np.int64)
    d_off = np.concatenate([[0], np.cumsum(d_len)[:-1]]).astype(np.int64)
    dst, ok, state = np.empty(int(d_len.sum()), np.uint8), np.zeros(len(frames), np.bool_), cpu.new_state()
    s = timed(lambda: inflate_frames(src, s_off, s_len, dst, d_off, d_len, state, ok), repeats)
    assert ok.all()
    return s, dst


def timed(fn, repeats: int) -> float:
    fn()
    xs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bundles = default_bundles(load_model(dtype="float32"), args.tokens)
    inflaters = {"zlib": lambda f, n: zlib.decompress(f, -15, n)}
    from isal import isal_zlib

    inflaters["isal"] = lambda f, n: isal_zlib.decompress(f, -15, n)
    try:
        import deflate

        inflaters["libdeflate"] = lambda f, n: deflate.deflate_decompress(f, n)
    except ImportError:
        pass
    print(f"{sum(b.n_tokens for b in bundles)} tokens, {len(bundles)} chunks; medians of {args.repeats}, one thread\n")
    print("| role | frames | deflated MB | inflated MB | ISA-L in the decoder's loop, s | ns per inflated byte |")
    print("|---|---:|---:|---:|---:|---:|")
    buckets = []
    for role in ("keys", "values"):
        frames = frames_of(bundles, role)
        s, dst = isal_inflate_all(frames, args.repeats)
        print(f"| {role} | {len(frames)} | {sum(len(f) for f, _ in frames) / 1e6:.1f} | {dst.size / 1e6:.1f} | {s:.4f} | {s / dst.size * 1e9:.2f} |")
        for lo, hi in BUCKETS:
            sel = [(f, n) for f, n in frames if lo <= len(f) < hi]
            if not sel:
                continue
            want = [zlib.decompress(f, -15) for f, _ in sel]
            row = [role, f"{lo}-{hi if hi < 1 << 40 else ''}", len(sel)]
            for name, fn in inflaters.items():
                assert all(fn(f, n) == w for (f, n), w in zip(sel, want)), name
                row.append(timed(lambda fn=fn: [fn(f, n) for f, n in sel], args.repeats) / len(sel) * 1e6)
            buckets.append(row)
    print("\nOne frame per call from Python, microseconds per frame:\n")
    print("| role | deflated bytes | frames | " + " | ".join(inflaters) + " |")
    print("|---|---|---:|" + "---:|" * len(inflaters))
    for row in buckets:
        print("| " + " | ".join(str(x) for x in row[:3]) + " | " + " | ".join(f"{x:.2f}" for x in row[3:]) + " |")


if __name__ == "__main__":
    main()
