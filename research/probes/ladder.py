"""Size-budgeted compression (precision ladder + forced eviction) vs eviction alone vs uniform
quantization at equal stored bytes, on the example QA set, all in one run.

    python bench/ladder.py --store DIR [--budgets 0.25,0.083] [--qa examples/qa.jsonl]
                           [--recon-cache DIR] [--only LABEL,...]

The store must hold the ingested example corpus (``kdnctl ingest examples/corpus``). Every
version is compressed from ``full`` with ``compress_document`` and evaluated by
``kdnctl.evaluation.qa.evaluate`` against the same full cache: accuracy, answer NLL,
KL(full || version), stored bytes per token and the fraction of the fp16 K/V size. The
reconstruction scorer's model pass is deterministic per document; ``--recon-cache`` keeps it on
disk so a re-run (or another recipe) does not pay it again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.scorers import reconstruct as scoring  # noqa: E402


def install_recon_cache(directory: Path) -> None:
    """Memoise ``scoring.reconstruct_scores`` on disk, keyed by the token ids."""
    directory.mkdir(parents=True, exist_ok=True)
    real = scoring.reconstruct_scores

    def cached(lm_, keys, values, token_ids, **kw):
        key = hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:24]
        path = directory / f"{key}.pt"
        if path.exists():
            return torch.load(path)
        out = real(lm_, keys, values, token_ids, **kw)
        tmp = path.with_suffix(".tmp")
        torch.save(out, tmp)
        tmp.rename(path)
        return out

    scoring.reconstruct_scores = cached


def plan(budgets: list[float]):
    from kdnctl.compress.document import CompressRecipe

    out = []
    for b in budgets:
        out.append(CompressRecipe(budget=b))  # the default: full ladder, kvcrush for forced eviction
        for q in ("int4", "int3", "int2"):
            out.append(CompressRecipe(budget=b, quant=q))  # uniform tier (+ eviction if forced)
        for m in ("kvcrush", "snapkv", "streaming"):
            out.append(CompressRecipe(budget=b, method=m, quant="fp16"))  # eviction alone, fp16
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--qa", default=str(ROOT / "examples" / "qa.jsonl"))
    ap.add_argument("--budgets", default="0.25,0.083")
    ap.add_argument("--recon-cache", default=None)
    ap.add_argument("--only", default=None, help="comma-separated labels to run")
    ap.add_argument("--docs", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--precompute", action="store_true", help="only fill --recon-cache")
    ap.add_argument("--no-probes", action="store_true")
    ap.add_argument("--out", default=None, help="write the raw results JSON here")
    args = ap.parse_args()
    if args.recon_cache:
        install_recon_cache(Path(args.recon_cache))
    from kdnctl.compress.document import compress_document
    from kdnctl.models.load import load_model
    from kdnctl.store import Store

    lm = load_model()
    store = Store(args.store, create=False)
    docs = args.docs.split(",") if args.docs else [d.doc_id for d in store.list_documents()]
    if args.precompute:
        from kdnctl.compress.document import CompressRecipe

        with store.writer():
            for d in docs:
                compress_document(store, d, CompressRecipe(), lm=lm, fingerprint=lm.fingerprint, label="recon-precompute")
                print("scored", d, flush=True)
        return
    from kdnctl.evaluation.qa import evaluate, load_qa

    recipes = plan([float(b) for b in args.budgets.split(",")])
    only = set(args.only.split(",")) if args.only else None
    labels = ["full"]
    with store.writer():
        for r in recipes:
            label = r.default_label()
            if only and label not in only:
                continue
            t = time.perf_counter()
            for d in docs:
                compress_document(store, d, r, lm=lm, fingerprint=lm.fingerprint)
            print(f"compressed {label} in {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
            labels.append(label)
    qa = [q for q in load_qa(args.qa) if q.doc in docs]
    res = evaluate(lm, store, labels, qa=qa, docs=docs, max_new_tokens=args.max_new_tokens,
                   probes_per_doc=0 if args.no_probes else 4)
    fp16 = {}
    for d in docs:
        v = store.get_version(d, "full")
        from kdnctl.format.bundle import read_meta

        m = read_meta(store.read_object(v.chunks[0].object))["model"]
        fp16[d] = 4 * m["n_layers"] * m["n_kv_heads"] * m["head_dim"] * v.n_tokens
    total16 = sum(fp16.values())
    rows = {v["label"]: v for v in res["versions"]}
    full = rows["full"]
    print("| version | accuracy | rel. to full | answer NLL | NLL vs full | KL vs full | probe NLL | stored / fp16 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label in labels:
        v = rows.get(label)
        if v is None:
            continue
        nbytes = sum(store.get_version(d, label).nbytes for d in docs)
        rel = v["accuracy"] / full["accuracy"] if full["accuracy"] else float("nan")
        print(f"| {label} | {v['accuracy']:.3f} | {rel:.0%} | {v['answer_nll']:.3f} | "
              f"{v['answer_nll'] / full['answer_nll'] - 1:+.1%} | {v['kl']:.3f} | {v.get('probe_nll') or float('nan'):.3f} | "
              f"{nbytes / total16:.3f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))

if __name__ == "__main__":
    main()
