"""Compare compression variants (method options, scorers, spans) on the example corpus, in one run.

    python bench/variants.py [--store DIR] [--max-new-tokens 24]

This is how the defaults of ``kdnctl compress`` were chosen (docs/compression.md, "Choosing the
defaults"): every variant compresses the same ingested documents at budget 0.25 and is scored by
``kdnctl eval`` (QA accuracy, answer NLL, KL vs the full cache) against the same full cache.
Reconstruction scores are computed once per document and shared by the variants that use them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kdnctl.compress.document as compress_mod  # noqa: E402
from kdnctl.scorers import reconstruct as scoring  # noqa: E402
from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.ingest.corpus import read_corpus  # noqa: E402
from kdnctl.evaluation.qa import evaluate, load_qa  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.store import Store  # noqa: E402

NO_HEADER = {"header": False}  # marks a variant that prunes the prompt header like any text
VARIANTS: dict[str, dict] = {
    "kvcrush (defaults)": {},
    "kvcrush, header not protected": {**NO_HEADER},
    "kvcrush, scorer reconstruct": {"scorer": "reconstruct"},
    "kvcrush, scorer window": {"scorer": "window"},
    "kvcrush, scorer surprisal": {"scorer": "surprisal"},
    "kvcrush, ratio 0 (importance only)": {"options": {"ratio": 0.0}},
    "pyramid:kvcrush": {"allocator": "pyramid"},
    "adaptive:kvcrush": {"allocator": "adaptive"},
    "spans 16": {"method": "spans"},
    "snapkv": {"method": "snapkv"},
    "streaming": {"method": "streaming"},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=str(ROOT / ".bench-store"))
    ap.add_argument("--qa", default=str(ROOT / "examples" / "qa.jsonl"))
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--only", help="comma-separated variant names to run (default: all)")
    args = ap.parse_args()
    lm = load_model()
    store = Store(args.store)
    docs, _ = read_corpus([ROOT / "examples" / "corpus"])
    ingest_documents(store, lm, docs, IngestOptions())
    recon_cache: dict[tuple, object] = {}
    real_recon = scoring.reconstruct_scores

    def cached_recon(lm_, keys, values, token_ids, **kw):
        key = tuple(token_ids)
        if key not in recon_cache:
            recon_cache[key] = real_recon(lm_, keys, values, token_ids, **kw)
        return recon_cache[key]

    scoring.reconstruct_scores = cached_recon
    labels = {}
    chosen = [n.strip() for n in args.only.split(",")] if args.only else list(VARIANTS)
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    for i, (name, v) in enumerate((n, VARIANTS[n]) for n in chosen):
        label = f"variant-{i}"
        recipe = CompressRecipe(budget=None, keep=args.budget, method=v.get("method", "kvcrush"),
                                scorer=v.get("scorer", "hybrid"), method_options=v.get("options", {}),
                                allocator=v.get("allocator", "uniform"))
        t = time.perf_counter()
        with store.writer():
            for d in docs:
                if v.get("header", True):
                    compress_document(store, d.doc_id, recipe, lm=lm, fingerprint=lm.fingerprint, label=label)
                else:  # hide the header length from compress: only the press's own 4 sinks stay
                    real_get = compress_mod.decode_bundle

                    def no_header(data, **kw):
                        b = real_get(data, **kw)
                        b.meta.pop("header_tokens", None)
                        return b

                    compress_mod.decode_bundle = no_header
                    try:
                        compress_document(store, d.doc_id, recipe, lm=lm, fingerprint=lm.fingerprint, label=label)
                    finally:
                        compress_mod.decode_bundle = real_get
        print(f"{name}: compressed in {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
        labels[label] = name
    result = evaluate(lm, store, list(labels), qa=load_qa(args.qa), probes_per_doc=0, max_new_tokens=args.max_new_tokens)
    print(f"\n| variant (budget {args.budget:g}) | accuracy | answer NLL | KL vs full |\n|---|---:|---:|---:|")
    for v in result["versions"]:
        name = labels.get(v["label"], v["label"])
        print(f"| {name} | {v['accuracy']:.3f} | {v['answer_nll']:.3f} | {v['kl']:.3f} |")


if __name__ == "__main__":
    main()
