"""Compression quality and overhead on the example corpus, all measured in one run.

    python bench/compress.py [--store DIR] [--qa examples/qa.jsonl] [--out research/results]

1. ingest examples/corpus (timed: the prefill cost the overhead is compared with);
2. compress with every method at budget 0.25 (with and without int8/int4), every scorer for
   KVCrush, quantization alone, and a budget sweep for the plot; each compression is timed
   (selection + gather + quantize + write; model-based scoring reported separately);
3. ``kdnctl eval`` on the QA file and cloze probes for every version;
4. prints markdown tables, writes results JSON and the quality-vs-budget plot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdnctl.scorers import reconstruct as scoring  # noqa: E402
from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.ingest.corpus import read_corpus  # noqa: E402
from kdnctl.evaluation.plot import plot_quality  # noqa: E402
from kdnctl.evaluation.qa import evaluate, load_qa  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.store import Store  # noqa: E402

METHODS = ["kvcrush", "snapkv", "h2o", "streaming", "knorm", "random", "pyramid:snapkv", "spans"]
SCORERS = ["window", "accum", "surprisal", "reconstruct", "hybrid"]


def plan(quick: bool) -> list[CompressRecipe]:
    recipes = [CompressRecipe(budget=None, keep=0.25, method=m) for m in METHODS]
    recipes += [CompressRecipe(budget=None, keep=0.25, method=m, quant=q) for m in ("kvcrush", "snapkv", "streaming") for q in ("int8", "int4")]
    recipes += [CompressRecipe(budget=None, keep=1.0, quant=q) for q in ("int8", "int4", "mixed")]
    recipes += [CompressRecipe(budget=None, keep=0.25, method="kvcrush", scorer=s) for s in SCORERS if s != "hybrid"]
    if not quick:
        recipes += [CompressRecipe(budget=None, keep=b, method=m) for b in (0.1, 0.5) for m in ("kvcrush", "snapkv", "streaming")]
    return recipes


def table(rows: list[dict], full: dict, title: str) -> str:
    out = [f"\n### {title}\n", "| version | accuracy | rel. to full | answer NLL | KL vs full | probe NLL | probe KL | bytes/token | ratio |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v in rows:
        rel = v["accuracy"] / full["accuracy"] if full["accuracy"] else float("nan")
        out.append(f"| {v['label']} | {v['accuracy']:.3f} | {rel:.1%} | {v['answer_nll']:.3f} | {v['kl']:.3f} | "
                   f"{v['probe_nll']:.3f} | {v['probe_kl']:.3f} | {v['bytes_per_token']:.0f} | {v['compression_ratio']:.1f}x |")
    return "\n".join(out)


def print_timings(timings: list[dict], ingest_s: float) -> None:
    print("\n### Compression time vs ingest (prefill) time of the same documents\n")
    print(f"ingest: {ingest_s:.1f}s\n\n| version | compress s | fraction of ingest | offline model scoring s | scoring / ingest |\n|---|---:|---:|---:|---:|")
    for t in timings:
        print(f"| {t['label']} | {t['seconds']:.2f} | {100 * t['fraction_of_ingest']:.2f}% | "
              f"{t['model_scoring_seconds']:.2f} | {100 * t['model_scoring_fraction']:.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=str(ROOT / ".bench-store"))
    ap.add_argument("--qa", default=str(ROOT / "examples" / "qa.jsonl"))
    ap.add_argument("--out", default=str(ROOT / "research" / "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--timing-only", action="store_true", help="time ingest and compression only (no eval)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lm = load_model()
    store = Store(args.store)
    docs, _ = read_corpus([ROOT / "examples" / "corpus"])
    t = time.perf_counter()
    report = ingest_documents(store, lm, docs, IngestOptions())
    ingest_s = time.perf_counter() - t
    if report.unchanged:
        # Reused store: time a fresh prefill of the same documents for the overhead ratio.
        from kdnctl.engine.prefill import prefill
        from kdnctl.ingest.prompting import PromptFormat

        fmt = PromptFormat.for_tokenizer(lm.tokenizer)
        t = time.perf_counter()
        for d in docs:
            prefill(lm.model, fmt.document_ids(lm.tokenizer, d.text)[0])
        ingest_s = time.perf_counter() - t
    # The reconstruction pass is deterministic per document: run it once per document and charge
    # its measured cost to every recipe that needs it (reported apart as offline model scoring).
    recon_cache: dict[tuple, object] = {}
    recon_seconds: dict[tuple, float] = {}
    real_recon = scoring.reconstruct_scores

    def cached_recon(lm_, keys, values, token_ids, **kw):
        key = tuple(token_ids)
        if key not in recon_cache:
            t0 = time.perf_counter()
            recon_cache[key] = real_recon(lm_, keys, values, token_ids, **kw)
            recon_seconds[key] = time.perf_counter() - t0
        return recon_cache[key]

    scoring.reconstruct_scores = cached_recon
    timings = []
    for recipe in plan(args.quick):
        total = score = model_s = 0.0
        label = recipe.default_label()
        with store.writer():
            for d in docs:
                r = compress_document(store, d.doc_id, recipe, lm=lm, fingerprint=lm.fingerprint)
                total += r.seconds
                score += r.score_seconds
                if recipe.needs_model:
                    ids = tuple(int(t) for t in lm.tokenizer(d.text, add_special_tokens=False).input_ids)
                    model_s += next(s for k, s in recon_seconds.items() if k[-len(ids):] == ids)
        total -= score  # selection + gather + quantize + write; model scoring is reported apart
        timings.append({"label": label, "seconds": round(total, 3), "model_scoring_seconds": round(model_s, 3),
                        "fraction_of_ingest": round(total / ingest_s, 4),
                        "model_scoring_fraction": round(model_s / ingest_s, 4)})
        print(f"compressed {label}: {total:.2f}s", file=sys.stderr, flush=True)
    if args.timing_only:
        print_timings(timings, ingest_s)
        return
    labels = [t["label"] for t in timings]
    qa = load_qa(args.qa)
    result = evaluate(lm, store, labels, qa=qa, probes_per_doc=args.probes)
    result["timings"] = timings
    result["ingest_seconds"] = round(ingest_s, 3)
    (out_dir / "compress.json").write_text(json.dumps(result, indent=2))
    by = {v["label"]: v for v in result["versions"]}
    full = by["full"]
    print(table([full] + [by[l] for l in labels if l.endswith("-k0.25") and l in by], full, "Methods at budget 0.25 (default scorer)"))
    print(table([by[l] for l in labels if "-k0.25-int" in l and l in by] + [by[l] for l in labels if l.startswith("k1") and l in by], full, "With quantization"))
    print(table([by[l] for l in labels if l.startswith("kvcrush-k0.25") and "int" not in l and l in by], full, "KVCrush scorers at 0.25"))
    print_timings(timings, ingest_s)
    plot = plot_quality(result, ROOT / "docs" / "img" / "quality_vs_budget.png") if not args.quick else None
    if plot:
        print(f"\nplot: {plot.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
