"""llama.cpp time to first token from a kdnctl export vs llama.cpp's own prefill, and the
quality cost of the shared (one token set for all heads and layers) press llama.cpp needs.

    python bench/engines.py [--sizes 1024,2048,4096] [--repeats 3]      # TTFT table
    python bench/engines.py --quality [--keeps 0.5,0.25] [--method kvcrush] [--scorer window]

TTFT: each context size is ingested once, exported (f16, no flash attention: llama-cpp-python's
defaults), then, in the same llama.cpp context and the same run, timed ``repeats`` times both
ways: load the state file + decode the question, vs prefill context + question from an empty
cache (interleaved, after a warm-up). Medians; the speedup is their ratio; the load average is
printed with the table (the machine is shared). Quality, one run: ``kdnctl eval``'s QA metrics
(HF engine, examples/qa.jsonl) for METHOD (per head) and shared:METHOD (one token set) at the
same keep fractions and scorer, and llama.cpp's answers from the shared exports (and the dense
one) against its own full prefill of the same tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kdnctl.ingest.corpus import Document, read_corpus  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.models.load import default_gguf_path, load_model  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def corpus_text(tokenizer, n_tokens: int) -> str:
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "examples" / "corpus").iterdir()))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < n_tokens:
        ids = ids + ids
    return tokenizer.decode(ids[: n_tokens - 30])


def ttft(args) -> list[dict]:
    from kdnctl.export.base import read_document_kv
    from kdnctl.export.llamacpp import export_llamacpp
    from kdnctl.export.llamacpp_engine import LlamaCppRunner

    lm = load_model()
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    question = fmt.question_ids(lm.tokenizer, "How long does it take to charge the battery to 80 %?")
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    load_before = os.getloadavg()
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
                ctx_ids = read_document_kv(store, res.info["doc_id"]).token_ids
                runner.prefill(ctx_ids[:64])  # warm-up
                stored, own = [], []

                def from_state():
                    t0 = time.perf_counter()
                    n_past = runner.load_state(path)
                    int(np.argmax(runner.decode(question, n_past)))  # the first token
                    stored.append(time.perf_counter() - t0)

                def from_prefill():
                    t0 = time.perf_counter()
                    int(np.argmax(runner.prefill(ctx_ids + question)))
                    own.append(time.perf_counter() - t0)

                for rep in range(args.repeats):  # interleaved, alternating which goes first
                    for step in ((from_state, from_prefill) if rep % 2 == 0 else (from_prefill, from_state)):
                        step()
                s, o = statistics.median(stored), statistics.median(own)
                rows.append({"tokens": len(ctx_ids), "ttft_state_s": round(s, 4), "ttft_prefill_s": round(o, 4),
                             "speedup": round(o / s, 2), "state_mb": round(res.n_bytes / 1e6, 2),
                             "export_s": round(export_s, 3)})
    load_after = os.getloadavg()
    print(f"# python bench/engines.py --sizes {args.sizes} --repeats {args.repeats} --threads {args.threads}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPU cores, load average "
          f"(1 min) {load_before[0]:.1f} at start, {load_after[0]:.1f} at end")
    print(f"llama.cpp {runner.n_threads} thread(s), f16 KV, question {len(question)} tokens, median of {args.repeats}")
    print("| context tokens | TTFT exported state (s) | TTFT llama.cpp prefill (s) | speedup | state file (MB) | export (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['ttft_state_s']:.3f} | {r['ttft_prefill_s']:.3f} | {r['speedup']:.1f}x "
              f"| {r['state_mb']:.1f} | {r['export_s']:.2f} |")
    for r in rows:
        r["load_avg_start"], r["load_avg_end"] = round(load_before[0], 2), round(load_after[0], 2)
    return rows


def llamacpp_answers(runner, store, lm, qa, label: str, tmp: Path, *, own: bool) -> list[tuple[list[int], bool]]:
    """Per question (answer ids, correct) from llama.cpp: after loading kdnctl's export of
    ``label`` (own=False) or after llama.cpp's own full prefill of the same context (own=True)."""
    from kdnctl.evaluation.qa import is_correct
    from kdnctl.export.base import read_document_kv
    from kdnctl.export.llamacpp import export_llamacpp

    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    tok = lm.tokenizer
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    out = []
    for doc_id in sorted({i.doc for i in qa}):
        ctx_ids = read_document_kv(store, doc_id, "full").token_ids
        path = tmp / f"{doc_id.replace('/', '_')}.{label}.{'own' if own else 'kdn'}.state"
        if own:
            runner.prefill(ctx_ids)
            runner.save_state(path, ctx_ids)
        else:
            export_llamacpp(store, doc_id, path, label=label, gguf=default_gguf_path(), fingerprint=lm.fingerprint)
        for item in (i for i in qa if i.doc == doc_id):
            n_past = runner.load_state(path)
            ans = runner.generate(fmt.question_ids(tok, item.question), n_past, stop_ids=stops, max_new_tokens=40)
            out.append((ans.token_ids, is_correct(tok.decode(ans.token_ids, skip_special_tokens=True).strip(), item)))
    return out


def quality(args) -> list[dict]:
    """Same run, same scorer, same keep fractions: kdnctl's HF engine on METHOD (per head) and
    shared:METHOD (one token set), and llama.cpp on the shared exports vs its own full prefill."""
    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.evaluation.qa import evaluate, load_qa
    from kdnctl.export.llamacpp_engine import LlamaCppRunner

    lm = load_model()
    qa = load_qa(REPO / "examples" / "qa.jsonl")
    if args.limit:  # the first LIMIT questions of every document
        qa = [q for i, q in enumerate(qa) if sum(o.doc == q.doc for o in qa[:i]) < args.limit]
    docs, _ = read_corpus([REPO / "examples" / "corpus"])
    keeps = [float(x) for x in args.keeps.split(",")]
    labels = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        ingest_documents(store, lm, docs, IngestOptions())
        with store.writer():
            for k in keeps:
                for shared in (False, True):
                    method = "shared" if shared else args.method
                    opts = {"press": args.method} if shared else {}
                    label = f"{'shared-' if shared else ''}{args.method}-k{k:g}"
                    for d in docs:
                        compress_document(store, d.doc_id, CompressRecipe(budget=None, keep=k, method=method,
                                                                          scorer=args.scorer, method_options=opts),
                                          lm=lm, label=label)
                    labels.append(label)
        hf = {r["label"]: r for r in evaluate(lm, store, labels, qa=qa)["versions"]}
        with LlamaCppRunner(default_gguf_path(), n_ctx=4096, n_threads=args.threads) as runner:
            own = llamacpp_answers(runner, store, lm, qa, "full", Path(tmp), own=True)
            lcpp = {label: llamacpp_answers(runner, store, lm, qa, label, Path(tmp), own=False)
                    for label in (["full"] if args.dense else []) + [l for l in labels if l.startswith("shared-")]}
        store.close()
    n = len(qa)
    rows = []
    for label in ["full"] + labels:
        r = hf[label]
        row = {"label": label, "hf_correct": round(r["accuracy"] * r["n_questions"]), "n": r["n_questions"],
               "answer_nll": r["answer_nll"], "kl": r["kl"], "probe_nll": r["probe_nll"]}
        if label in lcpp:
            ans = lcpp[label]
            row["llamacpp_correct"] = sum(c for _, c in ans)
            row["llamacpp_same_as_own"] = sum(a == b for (a, _), (b, _) in zip(ans, own))
            row["llamacpp_same_first_token"] = sum(a[:1] == b[:1] for (a, _), (b, _) in zip(ans, own))
        rows.append(row)
    rows.append({"label": "llama.cpp own prefill", "llamacpp_correct": sum(c for _, c in own), "n": n})
    print(f"# python bench/engines.py --quality --keeps {args.keeps} --method {args.method} --scorer {args.scorer}"
          f" --threads {args.threads} --limit {args.limit}{' --dense' if args.dense else ''}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {n} questions")
    print("| version | HF engine correct | answer NLL | KL vs full | probe NLL | llama.cpp export correct "
          "| same answer as llama.cpp prefill | same first token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows[:-1]:
        lc = (f"{r['llamacpp_correct']}/{n} | {r['llamacpp_same_as_own']}/{n} | {r['llamacpp_same_first_token']}/{n}"
              if "llamacpp_correct" in r else "- | - | -")
        print(f"| {r['label']} | {r['hf_correct']}/{r['n']} | {r['answer_nll']:.3f} | "
              f"{(r['kl'] or 0):.3f} | {r['probe_nll']:.3f} | {lc} |")
    print(f"| llama.cpp's own full prefill | - | - | - | - | {rows[-1]['llamacpp_correct']}/{n} | - | - |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--keeps", default="0.5,0.25", help="token keep fractions (--quality)")
    ap.add_argument("--method", default="kvcrush")
    ap.add_argument("--scorer", default="window")
    ap.add_argument("--limit", type=int, default=0, help="--quality: questions per document (0 = all)")
    ap.add_argument("--dense", action="store_true", help="--quality: also the dense export in llama.cpp")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    rows = quality(args) if args.quality else ttft(args)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
