"""The ``ec`` coder on stored versions: the same codes framed as raw Huffman-only deflate (format
1.6) and as zstd (the coder before 1.6), bytes and decode time, one run.

    python bench/ec_coders.py --store DIR --versions LABEL[,LABEL...] [--docs a,b] [--repeat 5]

For every chunk of each version, each layer's and role's integer codes are recovered from the
bundle (``entropy.integer_codes``) and framed by the library's own coder under each coding (same
spread bins, same frames; the params frame too), the decoded K/V checked identical, and the
whole object re-encoded. Prints, per role and coding, bits per element of the codes and of the
params; whole-object bytes / fp16; and the time to decode every layer and role of a chunk
(``EntropyQuantizer.dequantize``, one thread, best of ``--repeat``), as ratios deflate / zstd.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kdnctl.format.bundle import KVBundle, decode_bundle, encode_bundle  # noqa: E402

from kdnctl.format.names import role_levels, tensor_name
from kdnctl.quant.entropy import (CODINGS, ROLES, EntropyQuantizer, decode_params,  # noqa: E402
                                  encode_codes, encode_params, integer_codes)
from kdnctl.compress.sizing import fp16_bytes  # noqa: E402
from ec_bits import ec_report_args  # noqa: E402


def recoded(b: KVBundle, coding: str) -> KVBundle:
    """``b`` with every ec codes/params blob framed again under ``coding``."""
    q = b.meta["quant"]
    h, d, stored = q["n_heads"], q["head_dim"], q.get("coding", "zstd")
    tensors = dict(b.tensors)
    for i in range(b.n_layers):
        for role in ROLES:
            p = tensor_name(i, role)
            codes, params = b.tensors[f"{p}.codes"], b.tensors[f"{p}.params"]
            c = integer_codes(codes, params, h, d, role_levels(b.tensors, f"layers.{i}", role), p, stored)
            step, mean, _ = decode_params(params, h, d, p, stored)
            tensors[f"{p}.codes"], bins = encode_codes(c, coding)
            tensors[f"{p}.params"] = encode_params(step, mean, bins, coding)
    return KVBundle(meta={**b.meta, "quant": {**q, "coding": coding}}, tensors=tensors)


def decode_all(b: KVBundle) -> list[torch.Tensor]:
    q = b.meta["quant"]
    return [EntropyQuantizer.dequantize(b.tensors, tensor_name(i, role), q)
            for i in range(b.n_layers) for role in ROLES]


def best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    args, st, docs = ec_report_args(__doc__, repeat=True)
    print(f"python bench/ec_coders.py --versions {args.versions} --docs {','.join(docs)} --repeat {args.repeat}")
    for label in args.versions.split(","):
        bits = {c: {r: [0.0, 0.0] for r in ROLES} for c in CODINGS}  # coding -> role -> [codes, params]
        obj = {c: 0 for c in CODINGS}
        secs = {c: 0.0 for c in CODINGS}
        elements, fp16, n_chunks = {r: 0 for r in ROLES}, 0, 0
        for doc in docs:
            v = st.get_version(doc, label)
            stored = [decode_bundle(st.read_object(c.object)) for c in v.chunks]
            q = stored[0].meta.get("quant", {})
            if q.get("scheme") != "ec":
                sys.exit(f"{label}: not an ec version (this report reads ec's codes)")
            fp16 += fp16_bytes(v.n_tokens, stored[0].n_layers, q["n_heads"], q["head_dim"])
            for b in stored:
                n_chunks += 1
                versions = {c: recoded(b, c) for c in CODINGS}
                decoded = {}
                for c, bc in versions.items():
                    obj[c] += len(encode_bundle(bc))
                    for i in range(bc.n_layers):
                        for role in ROLES:
                            p = tensor_name(i, role)
                            bits[c][role][0] += 8.0 * bc.tensors[f"{p}.codes"].numel()
                            bits[c][role][1] += 8.0 * bc.tensors[f"{p}.params"].numel()
                    secs[c] += best_time(lambda bc=bc: decoded.__setitem__(c, decode_all(bc)), args.repeat)
                a, z = decoded.values()
                if not all(torch.equal(x, y) for x, y in zip(a, z)):
                    sys.exit(f"{label}: {doc} decodes differently under the two codings")
                for i in range(b.n_layers):
                    for role in ROLES:
                        lv = role_levels(b.tensors, f"layers.{i}", role)
                        elements[role] += q["n_heads"] * lv.numel() * q["head_dim"]
        print(f"\n{label} ({len(docs)} documents, {n_chunks} chunks; decoded K/V identical under both codings)")
        print("| role | coding | codes bits/elem | params bits/elem | total | / zstd |")
        print("|---|---|---:|---:|---:|---:|")
        for role in ROLES:
            ref = sum(bits["zstd"][role]) / elements[role]
            for c in CODINGS:
                cb, pb = (x / elements[role] for x in bits[c][role])
                print(f"| {role} | {c} | {cb:.3f} | {pb:.3f} | {cb + pb:.3f} | {(cb + pb) / ref:.3f} |")
        print(f"whole objects / fp16: deflate {obj['deflate'] / fp16:.4f}, zstd {obj['zstd'] / fp16:.4f} "
              f"(ratio {obj['deflate'] / obj['zstd']:.3f})")
        print(f"decode, every layer and role, per chunk (best of {args.repeat}, one thread): "
              f"deflate {1e3 * secs['deflate'] / n_chunks:.1f} ms, zstd {1e3 * secs['zstd'] / n_chunks:.1f} ms "
              f"(ratio {secs['deflate'] / secs['zstd']:.2f})")


if __name__ == "__main__":
    main()
