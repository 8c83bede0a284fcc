"""Bits per element that general-purpose coders reach on transform-coded K/V codes, against the
codes' order-0 entropy (what an arithmetic or rANS coder with per-channel models would reach).

    python bench/klt_coders.py --store S --basis-doc realtext/needle-000 --doc realtext/needle-001

Codes: keys before RoPE and values, centred, rotated into the principal axes of *another*
document's K/V (what a shared per-model basis gives), one uniform mid-tread step per layer,
role and head chosen by bisection so the order-0 entropy is ``--bits`` per element (layers
0, 3, ..., 27). Each coder compresses each head's int8 codes channel-major (cm) or token-major (tm).
"""

from __future__ import annotations

import argparse
import bz2
import lzma
import math
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from research.probes.tiers import load_full  # noqa: E402
from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.quant import transforms as tf  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def doc_kv(store: Store, doc_id: str):
    """Keys before RoPE and values of the document's full version, per layer."""
    keys, values, pos = load_full(store, doc_id)
    theta = float(decode_bundle(store.read_object(store.get_version(doc_id, "full").chunks[0].object))
                  .meta["model"]["rope"]["rope_theta"])
    pos = pos.expand(keys[0].shape[0], -1) if pos.dim() == 1 else pos
    return [tf.unrope(k, pos, theta) for k in keys], values


def principal_axes(x: torch.Tensor) -> torch.Tensor:
    c = x - x.mean(0)
    return torch.linalg.eigh(c.T @ c / len(x))[1].flip(1)


def entropy_bits(q: torch.Tensor) -> float:
    """Order-0 entropy of each channel (column) of int codes, summed, in bits."""
    counts = torch.stack([torch.bincount(q[:, c].long() + 127, minlength=255) for c in range(q.shape[1])]).double()
    p = counts / q.shape[0]
    return float(-(p * torch.log2(p.clamp_min(1e-300))).sum()) * q.shape[0]


def codes_at(y: torch.Tensor, bits: float) -> torch.Tensor:
    lo, hi = -12.0, 3.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        q = torch.round(y / math.exp(mid)).clamp(-127, 127)
        if entropy_bits(q) > bits * y.numel():
            lo = mid
        else:
            hi = mid
    return torch.round(y / math.exp(hi)).clamp(-127, 127).to(torch.int8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--basis-doc", default="realtext/needle-000")
    ap.add_argument("--doc", default="realtext/needle-001")
    ap.add_argument("--bits", default="0.7,1.3")
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = Store(Path(args.store))
    ka, va = doc_kv(store, args.basis_doc)
    kb, vb = doc_kv(store, args.doc)
    coders = {
        "zlib-9 cm": lambda q: len(zlib.compress(q.T.contiguous().numpy().tobytes(), 9)),
        "zlib-9 tm": lambda q: len(zlib.compress(q.contiguous().numpy().tobytes(), 9)),
        "lzma-9e cm": lambda q: len(lzma.compress(q.T.contiguous().numpy().tobytes(), preset=9 | lzma.PRESET_EXTREME)),
        "bz2-9 cm": lambda q: len(bz2.compress(q.T.contiguous().numpy().tobytes(), 9)),
    }
    for bits in (float(b) for b in args.bits.split(",")):
        total = {"order-0 entropy": 0.0, **{name: 0.0 for name in coders}}
        n = 0
        for i in range(0, len(kb), 3):
            for xa, xb in ((ka[i], kb[i]), (va[i], vb[i])):
                for h in range(xb.shape[0]):
                    y = (xb[h].double() - xb[h].double().mean(0)) @ principal_axes(xa[h].double())
                    q = codes_at(y, bits)
                    total["order-0 entropy"] += entropy_bits(q) / 8
                    for name, code in coders.items():
                        total[name] += code(q)
                    n += q.numel()
        print(f"target {bits:g} bits/element: " + ", ".join(f"{k} {v * 8 / n:.3f}" for k, v in total.items()))


if __name__ == "__main__":
    main()
