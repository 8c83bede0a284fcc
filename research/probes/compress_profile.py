"""Where a first compress of one document spends its time, beside a bare prefill of it.

    python research/probes/compress_profile.py [--doc examples/corpus/faq.md] [--budgets 0.25,0.083]

Ingests ``--doc`` into a temporary store, times a bare prefill of its tokens (the second of two,
``bare_prefill_seconds``), then compresses it at each budget (the shipped defaults; the key
weights forgotten before each, so each pays what a first compress pays) under cProfile and
prints the cumulative seconds of the compress's model passes and stages: the parts the
compress line of the performance docs is made of. Rows can nest: the codes at a scale include
the rounding with feedback where a recipe rounds that way (0.083).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.engine.prefill import bare_prefill_seconds  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.kernels.ec import deflate_size  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant.sensitivity import forget_key_weights  # noqa: E402
from kdnctl.store import Store  # noqa: E402

# (what it is, the function whose cumulative time it is)
PARTS = [
    ("key weights: a forward over the document", "sensitivity.py", "_key_weights"),
    ("Fisher estimate: probe forward + backward", "layer_fisher.py", "channel_fisher"),
    ("local sentence surprisal: a forward over its rows", "sentences.py", "local_sentence_surprisal"),
    ("document queries for the refit: a forward", "refit.py", "document_queries"),
    ("value refit", "refit.py", "refit_values"),
    ("values rounded with feedback", "feedback.py", "feedback_values"),
    ("scale fit's counted probes", "payload_size.py", "blob_sizes"),
    ("codes at a scale (quantize, encode)", "quantize.py", "codes_at"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc", default=str(ROOT / "examples" / "corpus" / "faq.md"))
    ap.add_argument("--budgets", default="0.25,0.083")
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    deflate_size.warm()
    text = Path(args.doc).read_text()
    doc = Document(Path(args.doc).name, text, "probe", hashlib.sha256(text.encode()).hexdigest())
    ids = PromptFormat.for_tokenizer(lm.tokenizer).document_ids(lm.tokenizer, text)[0]
    bare_prefill_seconds(lm.model, ids)
    bare = bare_prefill_seconds(lm.model, ids)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        ingest_documents(store, lm, [doc], IngestOptions())
        print(f"{doc.doc_id}: {len(ids)} tokens; bare prefill {bare:.2f} s; torch threads 2\n")
        for budget in (float(b) for b in args.budgets.split(",")):
            forget_key_weights()
            prof = cProfile.Profile()
            with store.writer():
                t = time.perf_counter()
                prof.enable()
                compress_document(store, doc.doc_id, CompressRecipe(budget=budget), lm=lm, label=f"b{budget:g}")
                prof.disable()
                total = time.perf_counter() - t
            stats = pstats.Stats(prof).stats
            print(f"### --budget {budget:g}: {total:.1f} s under the profiler, {total / bare:.1f}x the bare prefill\n")
            print("| part | seconds (cumulative) | / bare prefill |")
            print("|---|---:|---:|")
            for what, file, func in PARTS:
                s = sum(v[3] for (f, _, fn), v in stats.items() if f.endswith(file) and fn == func)
                if s:
                    print(f"| {what} | {s:.2f} | {s / bare:.2f}x |")
            print()
        store.close()


if __name__ == "__main__":
    main()
