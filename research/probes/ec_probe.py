"""Rate vs attention-weighted error of the ``ec`` layout against int4, on real stored K/V, one run.

    python bench/ec_probe.py --store DIR [--docs a,b] [--alphas 0.25,0.35,0.5,1.0]

Keys (before RoPE): error measured as the query-weighted logit error ``sum_c E[q_c^2] e_c^2``
relative to the keys' weighted variance, with the document's own queries (pair-averaged for
RoPE). Values: the output error ``sum_c |W_o[:, c]|^2 e_c^2`` relative to the weighted variance.
Rows: int4 in the KIVI layout (groups of 32, fp16 scale+zero: what the ladder stores), the ec
quantizer with steps ``alpha * sigma_c`` (equal relative error per channel, no weights), and
with the attention-weighted steps ``alpha * s_h / sqrt(w_c)`` that ``compress --quant ec`` uses.
Bits per element: the codes' order-0 entropy per channel (ideal) and the zstd frames as stored
(codes + float16 step/mean params, per 256-token chunk).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.allocate.rate import relative_steps  # noqa: E402
from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.kernels.quant import reference as ref  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import transforms as tf  # noqa: E402
from kdnctl.quant.entropy import encode_role  # noqa: E402
from kdnctl.quant.sensitivity import key_weights, value_weights  # noqa: E402
from kdnctl.store import Store  # noqa: E402
from kdnctl.quant import layer_kv

CHUNK = 256


def entropy_bits(codes: torch.Tensor) -> float:
    """Sum over channels of the order-0 entropy of that channel's codes ([H, T, D])."""
    total = 0.0
    for h in range(codes.shape[0]):
        for c in range(codes.shape[2]):
            _, n = torch.unique(codes[h, :, c], return_counts=True)
            p = n.double() / n.sum()
            total += float(-(p * p.log2()).sum()) * codes.shape[1]
    return total


def weighted_err(y, x, w):
    xc = x - x.mean(1, keepdim=True)
    return float((w[:, None] * (y - x) ** 2).sum() / (w[:, None] * xc ** 2).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--docs", default=None)
    ap.add_argument("--alphas", default="0.25,0.35,0.5,1.0")
    args = ap.parse_args()
    torch.set_num_threads(1)
    st = Store(args.store, create=False)
    lm = load_model()
    alphas = [float(a) for a in args.alphas.split(",")]
    docs = args.docs.split(",") if args.docs else [d.doc_id for d in st.list_documents()]
    print("| document | role | quantizer | rel. weighted error | ideal bits/elem | stored bits/elem |")
    print("|---|---|---|---:|---:|---:|")
    for doc in docs:
        v = st.get_version(doc, "full")
        bundles = [decode_bundle(st.read_object(c.object)) for c in v.chunks]
        n_layers = bundles[0].n_layers
        ids = [int(t) for b in bundles for t in b.token_ids.tolist()]
        pos = torch.cat([b.layer_positions(0)[0] for b in bundles])
        theta = bundles[0].meta["model"]["rope"]["rope_theta"]
        h, _, d = layer_kv(bundles[0], 0)[0].shape
        kw, vw = key_weights(lm, ids, n_layers, h, d), value_weights(lm, n_layers, h, d)
        rows: dict[tuple[str, str], list[float]] = {}
        n_el = n_layers * h * len(ids) * d
        for i in range(n_layers):
            k = torch.cat([layer_kv(b, i)[0] for b in bundles], 1).float()
            vv = torch.cat([layer_kv(b, i)[1] for b in bundles], 1).float()
            for role, x, w in (("keys", tf.unrope(k, pos.expand(h, -1), theta), kw[i]), ("values", vv, vw[i])):
                layout = "channel" if role == "keys" else "token"
                xin = x if role == "keys" else tf.rotate(x)  # int4 as the ladder stores it (values Hadamard-rotated)
                q, s, z = ref.quantize(xin, "int4", 32, layout)
                y = ref.dequantize(q, s, z, "int4", 32, layout, x.shape)
                y = y if role == "keys" else tf.rotate(y)
                r = rows.setdefault((role, "int4, groups of 32"), [0.0, 0.0, 0.0])
                bits = 8 * (q.numel() + 4 * s.numel())
                r[0] += weighted_err(y, x, w) / n_layers
                r[1] += bits
                r[2] += bits
                for name, base in (("ec, steps alpha x sigma", x.std(1, unbiased=False)),
                                   ("ec, attention-weighted steps", relative_steps(x, w))):
                    for a in alphas:
                        step = (a * base).clamp_min(1e-4).half().float()
                        mean = x.mean(1, keepdim=True)
                        codes = torch.round((x - mean) / step[:, None])
                        r = rows.setdefault((role, f"{name}, alpha {a:g}"), [0.0, 0.0, 0.0])
                        r[0] += weighted_err(codes * step[:, None] + mean, x, w) / n_layers
                        r[1] += entropy_bits(codes)
                        for s0 in range(0, x.shape[1], CHUNK):
                            cb, pb = encode_role(x[:, s0:s0 + CHUNK], step, torch.zeros(min(CHUNK, x.shape[1] - s0),
                                                                                           dtype=torch.uint8))
                            r[2] += 8 * (cb.numel() + pb.numel())
        for (role, name), (err, ideal, stored) in rows.items():
            print(f"| {doc} | {role} | {name} | {err:.5f} | {ideal / n_el:.3f} | {stored / n_el:.3f} |")


if __name__ == "__main__":
    main()
