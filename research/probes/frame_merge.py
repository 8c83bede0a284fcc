"""What fewer, larger Huffman frames would cost in bytes and save in inflate time.

    python research/probes/frame_merge.py [--tokens 8000] [--repeats 5]

ISA-L's inflate of an ec frame pays a fixed cost per frame (its Huffman tables are built for
every stream) besides its cost per byte; the 0.25 default stores one frame per (chunk, layer,
role, spread bin), ~16,000 frames at 8k tokens. This probe takes the frames a real load
inflates (the default stored by ``default_version``, read per blob as ``inflate_floor.frames_of``
reads them), and within
each (chunk, layer, role) blob merges the frames of one-byte codes (int8: the frames whose codes
are not packed as digits), then deflates each layout as the coder does (zlib, Huffman only) and
times ISA-L's stateless inflate of all of a role's frames in the decoder's own compiled loop,
one thread:

* ``stored``: the frames as stored;
* ``pairs``: each int8 frame merged with the next int8 frame of its blob (bins adjacent in spread);
* ``one``: every int8 frame of a blob merged into one; packed-digit frames as stored.
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_version import default_bundles  # noqa: E402
from inflate_floor import blobs_of, isal_inflate_all  # noqa: E402

from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant.coders.deflate import deflate_compress  # noqa: E402


def blob_frames(bundles, role: str) -> list[list[tuple[bytes, bool]]]:
    """Per (chunk, layer) blob of ``role``: each stored frame's inflated bytes and whether it
    holds one-byte codes (int8, not packed)."""
    return [[(zlib.decompress(f, -15, n), one) for f, n, one in blob] for blob in blobs_of(bundles, role)]


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bundles = default_bundles(load_model(dtype="float32"), args.tokens)
    print(f"{sum(b.n_tokens for b in bundles)} tokens, {len(bundles)} chunks; medians of {args.repeats}, one thread\n")
    print("| role | layout | frames | inflated MB | deflated MB | / stored | ISA-L s | / stored | us per frame saved |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for role in ("keys", "values"):
        blobs = blob_frames(bundles, role)
        base = None
        for how in ("stored", "pairs", "one"):
            plain = layout(blobs, how)
            packed = [deflate_compress(p) for p in plain]
            deflated = sum(len(f) for f in packed)
            s, dst = isal_inflate_all([(f, len(x)) for f, x in zip(packed, plain)], args.repeats)
            assert dst.tobytes() == b"".join(plain)
            if base is None:
                base = (len(packed), deflated, s)
            saved = (base[2] - s) / (base[0] - len(packed)) * 1e6 if base[0] > len(packed) else float("nan")
            print(f"| {role} | {how} | {len(packed)} | {dst.size / 1e6:.1f} | {deflated / 1e6:.2f} | {deflated / base[1]:.3f} | "
                  f"{s:.4f} | {s / base[2]:.2f} | {saved:.1f} |")


if __name__ == "__main__":
    main()
