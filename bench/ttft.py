"""Time to first token from stored KV vs a full prefill, and ingest vs bare prefill throughput.

    python bench/ttft.py [--sizes 1024,2048,4096] [--repeats 3] [--model PATH]

Everything is measured in the same run on the same machine and printed as a markdown table;
ratios are what the README quotes. The stored path counts reading the objects from the store,
decoding and validating the bundles, building the cache and running the question.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdnctl.corpus import Document  # noqa: E402
from kdnctl.engine.hf import full_prefill_generate, generate, load_document  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.model import load_model  # noqa: E402
from kdnctl.prefill import bare_prefill_seconds  # noqa: E402
from kdnctl.prompting import PromptFormat  # noqa: E402
from kdnctl.store import Store  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "corpus"


def corpus_text(tokenizer, n_tokens: int) -> str:
    text = "\n\n".join(p.read_text() for p in sorted(EXAMPLES.iterdir()))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < n_tokens:
        ids = ids + ids
    return tokenizer.decode(ids[: n_tokens - 30])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    lm = load_model(args.model)
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    question = fmt.question_ids(lm.tokenizer, "How long does it take to charge the battery to 80 %?")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        for size in [int(s) for s in args.sizes.split(",")]:
            text = corpus_text(lm.tokenizer, size)
            doc = Document(f"bench-{size}.txt", text, "bench", str(size))
            ids, _ = fmt.document_ids(lm.tokenizer, text)
            bare = min(bare_prefill_seconds(lm.model, ids) for _ in range(2))
            t = time.perf_counter()
            ingest_documents(store, lm, [doc], IngestOptions())
            ingest_s = time.perf_counter() - t
            stored, full = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                ctx = load_document(lm, store, doc.doc_id)
                stored.append(generate(lm, ctx, question, max_new_tokens=1, t0=t0).ttft_s)
                full.append(full_prefill_generate(lm, ctx.token_ids, question, max_new_tokens=1).ttft_s)
            s, f = statistics.median(stored), statistics.median(full)
            rows.append((len(ids), s, f, f / s, len(ids) / ingest_s, len(ids) / bare))
    print("| context tokens | TTFT stored KV (s) | TTFT full prefill (s) | speedup | ingest tok/s | bare prefill tok/s | ingest/bare |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, s, f, r, ing, bare in rows:
        print(f"| {n} | {s:.3f} | {f:.3f} | {r:.1f}x | {ing:.0f} | {bare:.0f} | {ing / bare:.2f} |")


if __name__ == "__main__":
    main()
