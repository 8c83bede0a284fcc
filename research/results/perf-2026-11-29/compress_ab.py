"""A first compress of one document with the default 0.25 recipe, timed against a bare prefill of
the same tokens in the same process, and the digest of every stored tensor (checkouts that
store the same bytes print the same digest). Run it with two checkouts alternately:

    PYTHONPATH=<checkout> python research/results/perf-2026-11-29/compress_ab.py NAME [BUDGET]
"""
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import torch

from kdnctl.bundle import decode_bundle
from kdnctl.compress import CompressRecipe, compress_document
from kdnctl.corpus import read_corpus
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.model import load_model
from kdnctl.prefill import bare_prefill_seconds
from kdnctl.prompting import PromptFormat
from kdnctl.store import Store

ROOT = Path(__file__).resolve().parents[3]
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
lm = load_model()
fmt = PromptFormat.for_tokenizer(lm.tokenizer)
docs, _ = read_corpus([ROOT / "examples" / "corpus" / "faq.md"])
doc = docs[0]
ids, _ = fmt.document_ids(lm.tokenizer, doc.text)
with tempfile.TemporaryDirectory() as tmp:
    store = Store(Path(tmp) / "store")
    bare = min(bare_prefill_seconds(lm.model, ids) for _ in range(2))
    ingest_documents(store, lm, [doc], IngestOptions())
    with store.writer():
        c, t = time.process_time(), time.perf_counter()
        compress_document(store, doc.doc_id, CompressRecipe(budget=budget), lm=lm, label="x")
        secs, cpu = time.perf_counter() - t, time.process_time() - c
    h = hashlib.sha256()
    for ch in store.get_version(doc.doc_id, "x").chunks:
        b = decode_bundle(store.read_object(ch.object))
        for name in sorted(b.tensors):
            h.update(name.encode() + b.tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    store.close()
print(f"| {sys.argv[1]} | {budget:g} | {len(ids)} | {bare:.2f} | {secs:.2f} | {secs / bare:.2f}x | {cpu:.1f} | {h.hexdigest()[:16]} |",
      flush=True)
