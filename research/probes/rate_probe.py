"""What else could cut ``ec``'s rate at equal attention-weighted error, on real K/V, one run.

    python bench/rate_probe.py [--docs 10,11] [--basis-doc 70] [--alpha 0.32] [--layers 0,3,...]

The task contexts of ``examples/eval/realtext.jsonl`` (by index) run through the model once;
keys before RoPE (``k_proj``) and values (``v_proj``) per layer and KV head. Every variant is
quantized in the weighted space ``y = (x - mean) * sqrt(w)`` (``w``: ec's channel weights,
``kdnctl.quant.sensitivity``), where ec's per-channel steps are one step per head, ``alpha``
times the head's weighted RMS (what ``compress --quant ec`` does at scale ``alpha``; ~0.32 at
``--budget 0.25``), so the error column is the same metric for every row.

1. Transforms (whole document, the codes' order-0 entropy per component as the rate):
   ec's channels; the principal axes (KLT) of the document itself (a basis it would have to
   store: 64 x 64 per layer, role and head); the principal axes of *another* document (what a
   basis shared per model would give); closed-loop prediction from the previous token (DPCM).
2. Coders on ec's codes per 256-token chunk (what a bundle stores): the zstd frames ``ec``
   wrote before format 1.6 (codes; params apart) against the codes' order-0 entropy per channel (an ideal
   coder with free tables) and the cross-entropy under a discretized Gaussian or Laplace
   with the channel's spread quantized to 1/8 octave (what an arithmetic or rANS coder with
   one byte of model per channel and chunk would spend, plus that byte); and deflate with
   Huffman coding only (no string matching; zlib's ``Z_HUFFMAN_ONLY``) on the same frames.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.allocate.rate import relative_steps  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant.entropy import encode_role  # noqa: E402
from kdnctl.models import adapter_for  # noqa: E402
from kdnctl.quant.sensitivity import key_weights, value_weights  # noqa: E402

CHUNK = 256


def doc_kv(lm, text: str, n_layers: int, h: int, d: int, max_tokens: int):
    """Token ids, keys before RoPE and values ``[H, T, D]`` per layer (one forward pass)."""
    ids = lm.tokenizer(text)["input_ids"][:max_tokens]
    keys, values = [None] * n_layers, [None] * n_layers
    adapter = adapter_for(lm.model)

    def grab(i, role, x):
        (keys if role == "k" else values)[i] = x.float().transpose(0, 1)

    with adapter.capture(("k", "v"), on=grab), torch.no_grad():
        adapter.decoder(torch.tensor([ids]), use_cache=False)
    return ids, keys, values


def entropy_bits(codes: torch.Tensor) -> float:
    """Order-0 entropy of every column of ``codes [T, C]``, summed over symbols (bits)."""
    total = 0.0
    for c in range(codes.shape[1]):
        _, n = torch.unique(codes[:, c], return_counts=True)
        p = n.double() / n.sum()
        total += float(-(p * p.log2()).sum()) * codes.shape[0]
    return total


def xent_bits(codes: torch.Tensor, family: str) -> float:
    """Bits to code one channel's integer codes under a discretized Gaussian (std) or Laplace
    (mean |code|) whose spread is rounded to 1/8 octave; probabilities floored at 2^-16."""
    spread = float(codes.std()) if family == "gauss" else float(codes.abs().mean())
    s = 2 ** (round(math.log2(max(spread, 0.05)) * 8) / 8)
    if family == "gauss":
        dist = torch.distributions.Normal(0.0, s)
        p = dist.cdf(codes + 0.5) - dist.cdf(codes - 0.5)
    else:
        def cdf(x):
            return torch.where(x < 0, 0.5 * torch.exp(x / s), 1 - 0.5 * torch.exp(-x / s))
        p = cdf(codes + 0.5) - cdf(codes - 0.5)
    return float(-p.clamp_min(2 ** -16).log2().sum())


def probe_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The options every K/V probe here shares (``bench/basis_probe.py`` too), parsed."""
    ap.add_argument("--alpha", type=float, default=0.32)
    ap.add_argument("--layers", default=",".join(str(i) for i in range(0, 30, 3)))
    ap.add_argument("--max-tokens", type=int, default=1500)
    return ap.parse_args()


def probe_setup():
    """``(lm, n_layers, kv heads, head dim, the realtext task rows)`` on one CPU thread."""
    torch.set_num_threads(1)
    lm = load_model()
    cfg = lm.model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    rows = [json.loads(line) for line in open(ROOT / "examples/eval/realtext.jsonl")]
    return lm, cfg.num_hidden_layers, cfg.num_key_value_heads, d, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", default="10,11")
    ap.add_argument("--basis-doc", type=int, default=70)
    args = probe_args(ap)
    lm, n_layers, h, d, rows = probe_setup()
    layers = [int(i) for i in args.layers.split(",")]
    vw = value_weights(lm, n_layers, h, d)

    def load(i):
        ids, k, v = doc_kv(lm, rows[i]["text"], n_layers, h, d, args.max_tokens)
        return {"keys": k, "values": v, "w": {"keys": key_weights(lm, ids, n_layers, h, d), "values": vw}}

    basis = load(args.basis_doc)
    docs = [load(int(i)) for i in args.docs.split(",")]
    print(f"docs {args.docs} (basis from {args.basis_doc}), layers {args.layers}, alpha {args.alpha}")
    print("\n| role | transform | bits/elem (order-0) | rel. weighted error |\n|---|---|---:|---:|")
    for role in ("keys", "values"):
        acc: dict[str, list[float]] = {}
        n_el = 0
        for doc in docs:
            for li in layers:
                for hh in range(h):
                    x, w = doc[role][li][hh], doc["w"][role][li][hh]
                    y = (x - x.mean(0)) * w.clamp_min(1e-12).sqrt()
                    step = args.alpha * float(y.pow(2).mean().sqrt())
                    xb, wb = basis[role][li][hh], basis["w"][role][li][hh]
                    yb = (xb - xb.mean(0)) * wb.clamp_min(1e-12).sqrt()
                    n_el += y.numel()

                    def add(name, codes, err):
                        a = acc.setdefault(name, [0.0, 0.0, 0.0])
                        a[0] += entropy_bits(codes)
                        a[1] += err
                        a[2] += float(y.pow(2).sum())

                    for name, z in (("ec's channels", y),
                                    ("KLT, the document's own axes", y @ torch.linalg.eigh(y.T @ y)[1]),
                                    ("KLT, another document's axes", y @ torch.linalg.eigh(yb.T @ yb)[1])):
                        c = torch.round(z / step)
                        add(name, c, float((c * step - z).pow(2).sum()))
                    codes, prev = torch.zeros_like(y), torch.zeros(y.shape[1])
                    for t in range(y.shape[0]):  # closed loop: predict from the decoded previous token
                        codes[t] = torch.round((y[t] - prev) / step)
                        prev = prev + codes[t] * step
                    rec = torch.cumsum(codes, 0) * step
                    add("DPCM from the previous token", codes, float((rec - y).pow(2).sum()))
        for name, (bits, err, var) in acc.items():
            print(f"| {role} | {name} | {bits / n_el:.3f} | {err / var:.5f} |")

    print("\n| role | zstd frames (ec as stored before format 1.6) | Huffman-only frames | params | order-0 per channel "
          "| Gaussian model | Laplace model | model byte |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for role in ("keys", "values"):
        tot = [0.0] * 6
        n_el = 0
        for doc in docs:
            for li in layers:
                x, w = doc[role][li], doc["w"][role][li]
                step = (args.alpha * relative_steps(x, w)).clamp_min(1e-4).half().float()
                for s0 in range(0, x.shape[1], CHUNK):
                    xc = x[:, s0:s0 + CHUNK]
                    cb, pb = encode_role(xc, step, torch.zeros(xc.shape[1], dtype=torch.uint8), "zstd")
                    tot[0] += 8 * cb.numel()
                    tot[1] += 8 * pb.numel()
                    tot[5] += 8 * encode_role(xc, step, torch.zeros(xc.shape[1], dtype=torch.uint8),
                                              "deflate")[0].numel()
                    codes = torch.round((xc - xc.mean(1, keepdim=True).half().float()) / step[:, None])
                    for hh in range(h):
                        for c in range(d):
                            col = codes[hh, :, c]
                            tot[2] += entropy_bits(col[:, None])
                            tot[3] += xent_bits(col, "gauss")
                            tot[4] += xent_bits(col, "laplace")
                    n_el += xc.numel()
        print(f"| {role} | {tot[0] / n_el:.3f} | {tot[5] / n_el:.3f} | {tot[1] / n_el:.3f} | {tot[2] / n_el:.3f} "
              f"| {tot[3] / n_el:.3f} "
              f"| {tot[4] / n_el:.3f} | {8 / CHUNK:.3f} |")


if __name__ == "__main__":
    main()
