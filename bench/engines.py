"""llama.cpp time to first token from a kdnctl export vs llama.cpp's own prefill, and the
quality cost of the shared (one token set for all heads and layers) press llama.cpp needs.

    python bench/engines.py [--sizes 1024,2048,4096] [--repeats 3]      # TTFT table
    python bench/engines.py --quality [--budgets 0.5,0.25] [--scorer window]

TTFT: each context size is ingested once, exported (f16, no flash attention: llama-cpp-python's
defaults), then, in the same llama.cpp context and the same run, timed ``repeats`` times both
ways: load the state file + decode the question, vs prefill context + question from an empty
cache. Medians; the speedup is their ratio. Quality: ``kdnctl eval``'s QA metrics (HF engine,
examples/qa.jsonl) for METHOD and shared:METHOD at the same budgets, same scorer, same run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kdnctl.corpus import Document, read_corpus  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.model import default_gguf_path, load_model  # noqa: E402
from kdnctl.prompting import PromptFormat  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def corpus_text(tokenizer, n_tokens: int) -> str:
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "examples" / "corpus").iterdir()))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < n_tokens:
        ids = ids + ids
    return tokenizer.decode(ids[: n_tokens - 30])


def ttft(args) -> list[dict]:
    from kdnctl.export.llamacpp import export_llamacpp
    from kdnctl.export.llamacpp_engine import LlamaCppRunner

    lm = load_model()
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    question = fmt.question_ids(lm.tokenizer, "How long does it take to charge the battery to 80 %?")
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        states = []
        for size in sizes:
            text = corpus_text(lm.tokenizer, size)
            doc = Document(f"bench-{size}.txt", text, "bench", hashlib.sha256(text.encode()).hexdigest())
            ingest_documents(store, lm, [doc], IngestOptions(stats=False))  # TTFT needs no statistics
            path = Path(tmp) / f"{size}.state"
            t = time.perf_counter()
            res = export_llamacpp(store, doc.doc_id, path, gguf=default_gguf_path(), fingerprint=lm.fingerprint)
            states.append((path, res, time.perf_counter() - t))
        n_ctx = max(r.info["n_past"] for _, r, _ in states) + len(question) + 8
        with LlamaCppRunner(default_gguf_path(), n_ctx=n_ctx, n_threads=args.threads) as runner:
            for path, res, export_s in states:
                from kdnctl.export.base import read_document_kv

                ctx_ids = read_document_kv(store, res.info["doc_id"]).token_ids
                runner.prefill(ctx_ids[:64])  # warm-up
                stored, own = [], []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    n_past = runner.load_state(path)
                    runner.decode(question, n_past)
                    stored.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    runner.prefill(ctx_ids + question)
                    own.append(time.perf_counter() - t0)
                s, o = statistics.median(stored), statistics.median(own)
                rows.append({"tokens": len(ctx_ids), "ttft_state_s": round(s, 4), "ttft_prefill_s": round(o, 4),
                             "speedup": round(o / s, 2), "state_mb": round(res.n_bytes / 1e6, 2),
                             "export_s": round(export_s, 3)})
    print(f"llama.cpp {runner.n_threads} threads, f16 KV, median of {args.repeats}")
    print("| context tokens | TTFT exported state (s) | TTFT llama.cpp prefill (s) | speedup | state file (MB) | export (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['ttft_state_s']:.3f} | {r['ttft_prefill_s']:.3f} | {r['speedup']:.1f}x "
              f"| {r['state_mb']:.1f} | {r['export_s']:.2f} |")
    return rows


def quality(args) -> list[dict]:
    from kdnctl.compress import CompressRecipe, compress_document
    from kdnctl.evaluation.qa import evaluate, load_qa

    lm = load_model()
    qa = load_qa(REPO / "examples" / "qa.jsonl")
    docs, _ = read_corpus([REPO / "examples" / "corpus"])
    labels = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        ingest_documents(store, lm, docs, IngestOptions())
        with store.writer():
            for b in [float(x) for x in args.budgets.split(",")]:
                for shared in (False, True):
                    method = "shared" if shared else args.method
                    opts = {"press": args.method} if shared else {}
                    label = f"{'shared-' if shared else ''}{args.method}-b{b:g}"
                    for d in docs:
                        compress_document(store, d.doc_id, CompressRecipe(budget=b, method=method, scorer=args.scorer,
                                                                          method_options=opts), lm=lm, label=label)
                    labels.append(label)
        res = evaluate(lm, store, labels, qa=qa)
    rows = [r for r in res["versions"]] if "versions" in res else res
    print(f"scorer {args.scorer}, {len(qa)} questions")
    print("| version | accuracy | answer NLL | KL vs full | probe NLL |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['label']} | {r['accuracy']:.3f} | {r['answer_nll']:.3f} | {r['kl']:.3f} | {r['probe_nll']:.3f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--budgets", default="0.5,0.25")
    ap.add_argument("--method", default="kvcrush")
    ap.add_argument("--scorer", default="window")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    rows = quality(args) if args.quality else ttft(args)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
