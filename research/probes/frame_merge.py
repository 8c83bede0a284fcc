"""What fewer, larger Huffman frames would cost in bytes and save in inflate time.

    python research/probes/frame_merge.py [--tokens 8000] [--repeats 5]

ISA-L's inflate of an ec frame pays a fixed cost per frame (its Huffman tables are built for
every stream) besides its cost per byte; the 0.25 default stores one frame per (chunk, layer,
role, spread bin), ~16,000 frames at 8k tokens. This probe takes the frames a real load
inflates (``inflate_floor.frames_of``, the default stored by ``default_version``), and within
each (chunk, layer, role) blob merges the frames of one-byte codes (int8: the frames whose codes
are not packed as digits), then deflates each layout as the coder does (zlib, Huffman only) and
times ISA-L's stateless inflate of all of a role's frames in the decoder's own compiled loop,
one thread:

* ``stored``: the frames as stored;
* ``pairs``: each int8 frame merged with the next int8 frame of its blob (bins adjacent in spread);
* ``one``: every int8 frame of a blob merged into one; packed-digit frames as stored.

It also fits ISA-L's time on the stored frames as ``a * frames + b * deflated bytes`` (both
roles, least squares over the frame-size buckets of ``inflate_floor.py`` would need Python
calls: here, from the role totals of the three layouts).
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
from kdnctl.quant.coders.deflate import deflate_compress  # noqa: E402


def blob_frames(bundles, role: str) -> list[list[tuple[bytes, bool]]]:
    """Per (chunk, layer) blob of ``role``: each stored frame's inflated bytes and whether it
    holds one-byte codes (int8, not packed)."""
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
                    frames.append((zlib.decompress(raw[pos:pos + size].tobytes(), -15, n),
                                   per == 1 and digits.frame_width(width, peak) == 1))
                pos += size
            out.append(frames)
    return out


def layout(blobs, how: str) -> list[bytes]:
    """Every frame's inflated bytes under layout ``how``."""
    out = []
    for frames in blobs:
        if how == "stored":
            out += [f for f, _ in frames]
            continue
        int8 = [f for f, one in frames if one]
        out += [f for f, one in frames if not one]
        if how == "one":
            out += [b"".join(int8)] if int8 else []
        else:
            out += [b"".join(int8[k:k + 2]) for k in range(0, len(int8), 2)]
    return out


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
    inflate_frames = cpu.kernels()[0]
    print(f"{sum(b.n_tokens for b in bundles)} tokens, {len(bundles)} chunks; medians of {args.repeats}, one thread\n")
    print("| role | layout | frames | inflated MB | deflated MB | / stored | ISA-L s | / stored | us per frame saved |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for role in ("keys", "values"):
        blobs = blob_frames(bundles, role)
        base = None
        for how in ("stored", "pairs", "one"):
            plain = layout(blobs, how)
            packed = [deflate_compress(p) for p in plain]
            src = np.frombuffer(b"".join(packed), np.uint8)
            s_len = np.array([len(f) for f in packed], np.int64)
            d_len = np.array([len(p) for p in plain], np.int64)
            s_off = np.concatenate([[0], np.cumsum(s_len)[:-1]]).astype(np.int64)
            d_off = np.concatenate([[0], np.cumsum(d_len)[:-1]]).astype(np.int64)
            dst, ok, state = np.empty(int(d_len.sum()), np.uint8), np.zeros(len(packed), np.bool_), cpu.new_state()
            s = timed(lambda: inflate_frames(src, s_off, s_len, dst, d_off, d_len, state, ok), args.repeats)
            assert ok.all() and dst.tobytes() == b"".join(plain)
            if base is None:
                base = (len(packed), src.size, s)
            saved = (base[2] - s) / (base[0] - len(packed)) * 1e6 if base[0] > len(packed) else float("nan")
            print(f"| {role} | {how} | {len(packed)} | {dst.size / 1e6:.1f} | {src.size / 1e6:.2f} | {src.size / base[1]:.3f} | "
                  f"{s:.4f} | {s / base[2]:.2f} | {saved:.1f} |")


if __name__ == "__main__":
    main()
