"""Would rotating ec's keys into principal axes pay in *stored* bytes, basis included? One run.

    python bench/basis_probe.py [--docs 10,11,12] [--basis-docs 70,71] [--alpha 0.32] [--layers 0,3,...]

``bench/rate_probe.py`` measured the order-0 entropy of keys in principal axes (a basis from
another document: -16%). This probe asks what a bundle would store: the keys of each 256-token
chunk are put in ec's step-normalised space ``u = (x - mean) / step`` (every channel one step
wide: an orthonormal rotation of ``u`` keeps ec's attention-weighted error), rotated, rounded
and framed by the library's own coder (``encode_codes``, Huffman-only deflate by spread bin),
and every basis byte a bundle would have to carry is charged:

- ``channels``: ec as stored today (no rotation);
- ``chunk KLT``: the chunk's own axes, a float16 64 x 64 basis per layer and head in each chunk;
- ``chunk top-k``: the chunk's top ``k`` axes as ``k`` float16 Householder vectors per head (the
  other axes an arbitrary orthonormal complement);
- ``document KLT``: the document's own axes, one basis per document (charged once);
- ``model KLT``: axes of other documents' keys (``--basis-docs``), a basis shared per model
  (charged nothing: stored once per store).

The error column (mean squared error in ``u``, i.e. in steps^2; 1/12 for a uniform quantizer)
checks every row quantizes equally finely.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from research.probes.rate_probe import doc_kv, probe_args, probe_setup  # noqa: E402
from kdnctl.allocate.rate import relative_steps  # noqa: E402
from kdnctl.quant.entropy import encode_codes  # noqa: E402
from kdnctl.quant.sensitivity import key_weights  # noqa: E402

CHUNK = 256


def axes(u: torch.Tensor) -> torch.Tensor:
    """``[H, D, D]`` principal axes (columns, largest variance first) of ``u [H, T, D]``."""
    cov = u.transpose(1, 2) @ u
    return torch.linalg.eigh(cov.double())[1].flip(-1).float()


def top_k_basis(u: torch.Tensor, k: int) -> torch.Tensor:
    """An orthonormal ``[H, D, D]`` whose first ``k`` columns are ``u``'s top-``k`` axes, built
    from ``k`` Householder reflections (what a bundle would store: ``k`` vectors per head)."""
    v = axes(u)[:, :, :k]
    a, tau = torch.geqrf(v.half().float())  # the stored vectors are float16
    return torch.linalg.householder_product(
        torch.cat([a, torch.zeros(a.shape[0], a.shape[1], a.shape[1] - k)], -1),
        torch.cat([tau, torch.zeros(tau.shape[0], a.shape[1] - k)], -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", default="10,11,12")
    ap.add_argument("--basis-docs", default="70,71")
    args = probe_args(ap)
    lm, n_layers, h, d, rows = probe_setup()
    layers = [int(i) for i in args.layers.split(",")]

    def normalised(i):
        """Per layer: ``u [H, T, D]`` of the whole document in its own ec steps (and the steps)."""
        ids, keys, _ = doc_kv(lm, rows[i]["text"], n_layers, h, d, args.max_tokens)
        w = key_weights(lm, ids, n_layers, h, d)
        out = {}
        for li in layers:
            x = keys[li]
            step = (args.alpha * relative_steps(x, w[li])).clamp_min(1e-4).half().float()
            out[li] = (x, step)
        return out

    model_cov = {li: torch.zeros(h, d, d, dtype=torch.float64) for li in layers}
    for i in args.basis_docs.split(","):
        for li, (x, step) in normalised(int(i)).items():
            u = (x - x.mean(1, keepdim=True)) / step[:, None]
            model_cov[li] += (u.transpose(1, 2) @ u).double()
    model_basis = {li: torch.linalg.eigh(c)[1].flip(-1).float() for li, c in model_cov.items()}

    acc: dict[str, list[float]] = {}
    n_el = 0

    def add(name, codes, z, extra_bytes):
        blob, _ = encode_codes(codes)
        a = acc.setdefault(name, [0.0, 0.0, 0.0])
        a[0] += 8 * blob.numel()
        a[1] += 8 * extra_bytes
        a[2] += float((codes - z).pow(2).sum())

    for i in args.docs.split(","):
        doc = normalised(int(i))
        for li, (x, step) in doc.items():
            whole = (x - x.mean(1, keepdim=True)) / step[:, None]
            doc_basis = axes(whole)
            first = True
            for s0 in range(0, x.shape[1], CHUNK):
                xc = x[:, s0:s0 + CHUNK]
                mean = xc.mean(1).half().float()
                u = (xc - mean[:, None]) / step[:, None]
                n_el += u.numel()
                variants = [("channels", None, 0), ("chunk KLT (64 x 64 fp16 per head)", axes(u), h * d * d * 2)]
                for k in (4, 8, 16):
                    variants.append((f"chunk top-{k} (Householder, fp16)", top_k_basis(u, k), h * k * d * 2))
                variants.append(("document KLT (one basis per document)", doc_basis, h * d * d * 2 if first else 0))
                variants.append(("model KLT (other documents' axes)", model_basis[li], 0))
                for name, basis, extra in variants:
                    z = u if basis is None else u @ basis
                    add(name, torch.round(z), z, extra)
                first = False
    print(f"python bench/basis_probe.py --docs {args.docs} --basis-docs {args.basis_docs} --alpha {args.alpha} "
          f"--layers {args.layers}  (one run, CPU)\n")
    print("| keys in | codes bits/elem | basis bits/elem | total | vs channels | error (steps^2) |")
    print("|---|---:|---:|---:|---:|---:|")
    base = sum(acc["channels"][:2]) / n_el
    for name, (bits, extra, err) in acc.items():
        tot = (bits + extra) / n_el
        print(f"| {name} | {bits / n_el:.3f} | {extra / n_el:.3f} | {tot:.3f} | {tot / base:.3f} | {err / n_el:.4f} |")


if __name__ == "__main__":
    main()
