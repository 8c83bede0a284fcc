"""Reconstruction error of each precision tier and transform on real stored K/V, one run.

    python bench/tiers.py --store DIR [--docs a.md,b.md] [--layers 0,7,15,29]

For every tier (int8/int4/int3/int2, groups of 32 or 64) and transform (plain KIVI layout;
keys quantized before RoPE; Hadamard rotation of K and/or V; per-token keys after rotation) it
prints the relative Frobenius error of K and V (mean over the chosen layers), the stored bits
per element with scale/zero, and what lossless coding of the codes saves (zlib, lzma, applied
to the packed codes, also after delta coding along the token axis). This is the offline
measurement behind the ladder's choices (docs/compression.md).
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

from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.kernels.quant import reference as ref  # noqa: E402
from kdnctl.quant import transforms as tf  # noqa: E402
from kdnctl.store import Store  # noqa: E402
from kdnctl.quant import layer_kv

THETA = 100000.0  # SmolLM2-135M rope_theta


def load_full(store: Store, doc: str):
    v = store.get_version(doc, "full")
    bundles = [decode_bundle(store.read_object(c.object)) for c in v.chunks]
    n = bundles[0].n_layers
    keys = [torch.cat([layer_kv(b, i)[0] for b in bundles], 1).float() for i in range(n)]
    values = [torch.cat([layer_kv(b, i)[1] for b in bundles], 1).float() for i in range(n)]
    pos = torch.cat([b.layer_positions(0)[0] for b in bundles])
    return keys, values, pos


def roundtrip(x, fmt, g, layout):
    q, s, z = ref.quantize(x, fmt, g, layout)
    y = ref.dequantize(q, s, z, fmt, g, layout, x.shape)
    nbytes = q.numel() + 2 * s.numel() * s.element_size()
    return y, q, nbytes


def rel(a, b):
    return float((a - b).norm() / b.norm())


def variants():
    # name -> (key transform, key layout, value transform)
    return {
        "kivi": ("none", "channel", "none"),
        "K pre-rope": ("unrope", "channel", "none"),
        "V hadamard": ("none", "channel", "had"),
        "K pre-rope + V had": ("unrope", "channel", "had"),
        "K had/channel + V had": ("had", "channel", "had"),
        "K pre-rope+had/token + V had": ("unrope+had", "token", "had"),
    }


def apply_k(k, how, pos):
    if "unrope" in how:
        k = tf.unrope(k, pos, THETA)
    if "had" in how:
        k = tf.rotate(k)
    return k


def undo_k(k, how, pos):
    if "had" in how:
        k = tf.rotate(k)
    if "unrope" in how:
        k = tf.rope(k, pos, THETA)
    return k


def code_bytes(q: torch.Tensor) -> dict[str, int]:
    raw = q.contiguous().numpy().tobytes()
    return {"raw": len(raw), "zlib": len(zlib.compress(raw, 9)), "lzma": len(lzma.compress(raw, preset=9))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--docs", default="zephyr-x200-manual.md")
    ap.add_argument("--layers", default="0,5,10,15,20,25,29")
    ap.add_argument("--tiers", default="int8:32,int4:32,int3:32,int2:32,int2:64")
    args = ap.parse_args()
    store = Store(args.store, create=False)
    layers = [int(x) for x in args.layers.split(",")]
    tiers = [(t.split(":")[0], int(t.split(":")[1])) for t in args.tiers.split(",")]
    data = [load_full(store, d) for d in args.docs.split(",")]
    print("| variant | tier | group | K rel err | V rel err | bits/elem | codes lzma/raw | codes zlib/raw |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for vname, (kt, klay, vt) in variants().items():
        for fmt, g in tiers:
            ek, ev, nb, ne, cz, cl, cr = [], [], 0, 0, 0, 0, 0
            for keys, values, pos in data:
                for i in layers:
                    k, v = keys[i], values[i]
                    kk = apply_k(k, kt, pos)
                    yk, qk, bk = roundtrip(kk, fmt, g, klay)
                    vv = tf.rotate(v) if vt == "had" else v
                    yv, qv, bv = roundtrip(vv, fmt, g, "token")
                    yk = undo_k(yk, kt, pos)
                    yv = tf.rotate(yv) if vt == "had" else yv
                    ek.append(rel(yk, k))
                    ev.append(rel(yv, v))
                    nb += bk + bv
                    ne += 2 * k.numel()
                    for q in (qk, qv):
                        c = code_bytes(q)
                        cr += c["raw"]
                        cz += c["zlib"]
                        cl += c["lzma"]
            print(f"| {vname} | {fmt} | {g} | {sum(ek) / len(ek):.4f} | {sum(ev) / len(ev):.4f} | "
                  f"{8 * nb / ne:.3f} | {cl / cr:.3f} | {cz / cr:.3f} |", flush=True)


if __name__ == "__main__":
    main()
