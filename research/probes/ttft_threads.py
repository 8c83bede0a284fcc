"""Time to first token of the 0.25 default against ``full``, with the question's forward on one or
two torch threads, its decode behind the forward or first.

    python research/probes/ttft_threads.py TOKENS REPEATS

One document of the example corpus ingested and compressed with the default (``--budget
0.25``), then ``bench/ttft.py``'s ``stored_ttft`` for each case, interleaved, medians of
``REPEATS``, each over ``full`` on two threads. Writes nothing outside a temporary store.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ttft  # noqa: E402

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def main() -> None:
    size, reps = int(sys.argv[1]), int(sys.argv[2])
    lm = load_model(None, dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    q = fmt.question_ids(lm.tokenizer, ttft.QUESTION)
    text = ttft.corpus_text(lm.tokenizer, size)
    doc = Document("d.txt", text, "bench", hashlib.sha256(text.encode()).hexdigest())
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "s")
        ingest_documents(store, lm, [doc], IngestOptions())
        with store.writer():
            compress_document(store, doc.doc_id, CompressRecipe(), lm=lm, label="default")

        def case(label: str, threads: int, overlap: bool = True):
            def f():
                old = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    return ttft.stored_ttft(lm, store, doc.doc_id, label, q, overlap=overlap)
                finally:
                    torch.set_num_threads(old)
            return f

        cases = {"full t2": case("full", 2), "full t1": case("full", 1), "default t2": case("default", 2),
                 "default t1": case("default", 1), "default first t2": case("default", 2, False)}
        for f in cases.values():
            f()
        res = {k: [] for k in cases}
        for _ in range(reps):
            for k, f in cases.items():
                res[k].append(f())
        store.close()
    base = statistics.median(res["full t2"])
    for k, v in res.items():
        print(f"{size} {k:18s} median {statistics.median(v):.4f}  / full t2 {statistics.median(v) / base:.3f}")


if __name__ == "__main__":
    main()
