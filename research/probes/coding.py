"""Lossless coding of quantized K/V codes and scales/zeros on real stored K/V, one run.

    python bench/coding.py --store DIR [--doc realtext/needle-000] [--layers 0,10,20,29] [--group 32]

Per tier (int8, int4, int3, int2; keys before RoPE per channel, values Hadamard-rotated per
token, the ladder's layout) it prints bits per element of: the raw packed codes, zlib on them
(what the ladder stores), deflate with Huffman coding only on them (what ``ec`` frames use since
format 1.6), the order-0 entropy of the codes, zlib and lzma on the unpacked codes (one byte per
code), zlib on bit planes, and the fp16 scales + zeros raw and zlib-coded. This is the
measurement behind ``coding = "zlib+params"`` (docs/compression.md).
"""

from __future__ import annotations

import argparse
import lzma
import sys
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kdnctl.kernels.quant import reference as ref  # noqa: E402
from kdnctl.quant import transforms as tf  # noqa: E402
from kdnctl.quant.coders.deflate import deflate_compress  # noqa: E402
from kdnctl.store import Store  # noqa: E402
from tiers import THETA, load_full  # noqa: E402


def entropy_bits(codes: torch.Tensor) -> float:
    c = codes.reshape(-1).long()
    p = torch.bincount(c).double()
    p = p[p > 0] / c.numel()
    return float(-(p * p.log2()).sum()) * c.numel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--doc", default="realtext/needle-000")
    ap.add_argument("--layers", default="0,10,20,29")
    ap.add_argument("--group", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    keys, values, pos = load_full(Store(args.store, create=False), args.doc)
    cols = ["raw", "zlib", "Huffman-only", "H0", "unpacked zlib", "unpacked lzma", "bit planes zlib", "params raw", "params zlib"]
    print("| tier | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for fmt in ("int8", "int4", "int3", "int2"):
        acc = dict.fromkeys(cols, 0.0)
        n = 0
        for i in (int(x) for x in args.layers.split(",")):
            k, v = tf.unrope(keys[i], pos, THETA), tf.rotate(values[i])
            for x, lay in ((k, "channel"), (v, "token")):
                q, s, z = ref.quantize(x, fmt, args.group, lay)
                codes = ref.unpack_codes(ref._grouped_last(q, lay), ref.grouped_len(x.shape, lay), fmt).contiguous()
                packed, unpacked = q.numpy().tobytes(), codes.numpy().tobytes()
                params = torch.cat([s.reshape(-1), z.reshape(-1)]).numpy().tobytes()
                acc["raw"] += 8 * len(packed)
                acc["zlib"] += 8 * len(zlib.compress(packed, 9))
                acc["Huffman-only"] += 8 * len(deflate_compress(packed))
                acc["H0"] += entropy_bits(codes)
                acc["unpacked zlib"] += 8 * len(zlib.compress(unpacked, 9))
                acc["unpacked lzma"] += 8 * len(lzma.compress(unpacked, preset=6))
                bits = int(fmt[3:])
                acc["bit planes zlib"] += 8 * sum(len(zlib.compress(ref.pack_bits(((codes >> b) & 1).to(torch.uint8)).numpy().tobytes(), 9))
                                                  for b in range(bits))
                acc["params raw"] += 8 * len(params)
                acc["params zlib"] += 8 * len(zlib.compress(params, 9))
                n += x.numel()
        print(f"| {fmt} | " + " | ".join(f"{acc[c] / n:.3f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
