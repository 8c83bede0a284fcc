"""What the ec scale fit costs and what it chooses, against a bare prefill of the same tokens.

    python bench/ec_fit.py [--docs faq.md] [--budgets 0.25,0.083] [--fits near,search,before] [--qa] [--fresh]

One run: each document of ``examples/corpus`` is ingested (timed, and a bare forward pass over
the same tokens, ``bare_prefill_seconds``), then compressed at each budget with each way of
fitting the scale, timed:

* ``near``: ``--option fit=secant`` (``rate.fit_near``: secant steps on log size from the
  last scale, encodes on one torch thread, frames cut in numpy);
* ``search``: the bracketed search over the whole range (``rate.fit_scale``, ~14 encodings)
  with the same encoder: what the defaults do, hence the stored bytes and answers to compare
  with;
* ``before``: that search with the encoder as it was (the per-frame torch loop, torch's own
  thread count): the compress time before.

Every variant's stored bytes are the encoded objects; the cap holds on them. The key weights (a
forward pass over the document) are computed once per document and process, so a later budget
or fit of the same document reuses them; ``--fresh`` forgets them before every compress (each
row then costs what a first compress of that document costs). ``--qa`` answers
``examples/qa.jsonl``'s questions about the documents from every version (exact-match accuracy).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdnctl.compress.stages import encode as ec_encode, quantize as ec_quantize  # noqa: E402
from kdnctl.allocate import rate  # noqa: E402
from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.ingest.corpus import read_corpus  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.engine.prefill import bare_prefill_seconds  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.quant import entropy, sensitivity  # noqa: E402
from kdnctl.store import Store  # noqa: E402


@contextlib.contextmanager
def variant(name: str):
    """The scale fit (and encoder) of ``name`` inside the block."""
    saved = ec_encode.fit_near, ec_quantize.one_torch_thread, entropy.encode_codes
    if name in ("search", "before"):
        ec_encode.fit_near = lambda size_at, cap, guess=0.5: rate.fit_scale(size_at, cap)
    if name == "before":
        ec_quantize.one_torch_thread = contextlib.nullcontext
        enc = saved[2]
        entropy.encode_codes = lambda *a, **k: enc(*a, **{**k, "reference": True})
    try:
        yield
    finally:
        ec_encode.fit_near, ec_quantize.one_torch_thread, entropy.encode_codes = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", default="faq.md")
    ap.add_argument("--budgets", default="0.25,0.083")
    ap.add_argument("--fits", default="near,search,before")
    ap.add_argument("--qa", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="forget the key weights before every compress")
    args = ap.parse_args()
    lm = load_model()
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    docs, _ = read_corpus([ROOT / "examples" / "corpus" / d for d in args.docs.split(",")])
    import tempfile

    rows, labels = [], []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        for doc in docs:
            ids, _ = fmt.document_ids(lm.tokenizer, doc.text)
            bare = min(bare_prefill_seconds(lm.model, ids) for _ in range(2))
            t = time.perf_counter()
            ingest_documents(store, lm, [doc], IngestOptions())
            ingest_s = time.perf_counter() - t
            for budget in (float(b) for b in args.budgets.split(",")):
                for fit in args.fits.split(","):
                    label = f"b{budget:g}-{fit}"
                    if args.fresh:
                        sensitivity.forget_key_weights()
                    with variant(fit), store.writer():
                        t = time.perf_counter()
                        res = compress_document(store, doc.doc_id, CompressRecipe(budget=budget), lm=lm, label=label)
                        secs = time.perf_counter() - t
                    version = store.get_version(doc.doc_id, label)
                    nbytes = sum(c.nbytes for c in version.chunks)
                    from kdnctl.format.bundle import decode_bundle

                    alpha = decode_bundle(store.read_object(version.chunks[0].object)).meta["quant"]["alpha"]
                    rows.append((doc.doc_id, len(ids), bare, ingest_s, budget, fit, secs, nbytes, res.fraction_of_fp16, alpha))
                    labels.append(label)
                    print(f"# {rows[-1]}", file=sys.stderr, flush=True)
        acc = {}
        if args.qa:
            from kdnctl.evaluation.qa import evaluate, load_qa

            qa = [i for i in load_qa(ROOT / "examples" / "qa.jsonl") if i.doc in {d.doc_id for d in docs}]
            out = evaluate(lm, store, sorted(set(labels)), qa=qa, probes_per_doc=0)
            acc = {v["label"]: v for v in out["versions"]}
        store.close()
    print(f"torch threads {torch.get_num_threads()}; key weights {'computed for every row' if args.fresh else 'once per document'}\n")
    print("| document | tokens | budget | fit | compress s | s per 1k tokens | / bare prefill | / ingest | "
          "stored bytes | / search's bytes | fraction of fp16 | alpha |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ref = {(r[0], r[4]): r[7] for r in rows if r[5] == "search"}
    for doc, n, bare, ing, budget, fit, secs, nbytes, frac, alpha in rows:
        base = ref.get((doc, budget))
        print(f"| {doc} | {n} | {budget:g} | {fit} | {secs:.2f} | {1e3 * secs / n:.2f} | {secs / bare:.2f}x | "
              f"{secs / ing:.2f}x | {nbytes} | {nbytes / base if base else float('nan'):.4f} | {frac:.4f} | {alpha:.5f} |")
    print(f"\nbare prefill s: {', '.join(f'{r[0]} {r[2]:.2f}' for r in rows[:1])}; ingest s: {rows[0][3]:.2f}")
    if acc:
        print("\nQA (examples/qa.jsonl, these documents; answer NLL and KL against the full cache):\n")
        print("| version | correct | answer NLL | KL vs full |\n|---|---:|---:|---:|")
        for label, v in acc.items():
            print(f"| {label} | {v['accuracy']:.3f} | {v['answer_nll']:.3f} | {v['kl']:.4f} |")


if __name__ == "__main__":
    main()
