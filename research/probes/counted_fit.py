"""Compress as it was (every probe of the scale fit encoded, rounding with feedback in torch)
against compress as it is (probes counted, the feedback loop compiled): the same version, in
less time.

    python research/probes/counted_fit.py [--docs examples/corpus] [--budgets 0.25,0.083] [--repeats 1]

Ingests every document of ``--docs`` into a temporary store, then compresses each at each budget
(the shipped defaults) twice per repeat, alternating which goes first: as it is, and as it was
(``PayloadSize.for_job`` turned off, ``round_with_feedback`` on its torch loop and the rounding
order by Python's ``sorted``, for that run). The two versions' tensors must be equal byte
for byte (their objects differ in the label). Prints per budget and document: tokens, the encode stage's probes, seconds of each
compress and of the encode stage alone, and their ratio; and the bare prefill's seconds for
scale (a forward over the document's tokens, in one call).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.quant.sensitivity import forget_key_weights  # noqa: E402
from kdnctl.compress.stages import encode as encode_stage  # noqa: E402
from kdnctl.compress import feedback  # noqa: E402
from kdnctl.compress.stages import payload_size as ps  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import read_corpus  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def version_tensors_digest(st: Store, doc: str, label: str) -> str:
    """Every tensor of every chunk, byte for byte (the objects themselves differ in their labels)."""
    h = hashlib.sha256()
    for c in st.get_version(doc, label).chunks:
        b = decode_bundle(st.read_object(c.object))
        for name in sorted(b.tensors):
            h.update(name.encode())
            h.update(b.tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", default=str(ROOT / "examples" / "corpus"))
    ap.add_argument("--budgets", default="0.25,0.083")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    lm = load_model(None)
    corpus, _ = read_corpus([Path(args.docs)])
    st = Store(tempfile.mkdtemp(prefix="counted-fit-"))
    ingest_documents(st, lm, corpus, IngestOptions())
    docs = [d.doc_id for d in st.list_documents()]

    probes = {"n": 0}
    real_for_job = ps.PayloadSize.for_job
    stage_run = encode_stage.Encode.run
    stage_s = {"s": 0.0}

    def timed_run(self, job):
        t0 = time.perf_counter()
        try:
            return stage_run(self, job)
        finally:
            stage_s["s"] = time.perf_counter() - t0

    encode_stage.Encode.run = timed_run
    counted_call = ps.PayloadSize.__call__

    def counting(self, alpha):
        probes["n"] += 1
        return counted_call(self, alpha)

    ps.PayloadSize.__call__ = counting

    now_round, now_order = feedback.round_with_feedback, feedback.rounding_order

    def torch_round(*a, **k):
        return now_round(*a, **k, compiled=False)

    def sorted_order(read, held):
        return torch.tensor(sorted(range(read.numel()), key=lambda t: (not bool(held[t]), -float(read[t]), t)),
                            dtype=torch.int64)

    def compress(doc: str, budget: float, counted: bool, tag: str):
        ps.PayloadSize.for_job = real_for_job if counted else classmethod(lambda cls, job: None)
        feedback.round_with_feedback = now_round if counted else torch_round
        feedback.rounding_order = now_order if counted else sorted_order
        probes["n"] = 0
        forget_key_weights()  # each compress pays its own forward
        t0 = time.perf_counter()
        with st.writer():
            compress_document(st, doc, CompressRecipe(budget=budget), lm=lm, label=tag)
        return time.perf_counter() - t0, stage_s["s"], probes["n"]

    print(f"model {lm.fingerprint[:12]}, torch threads {torch.get_num_threads()}, repeats {args.repeats}\n")
    print("| budget | document | tokens | bare prefill s | compress s, as it was | as it is | "
          "ratio | encode stage s, as it was | as it is | ratio | counted probes | same tensors |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    totals = {}
    for budget in [float(b) for b in args.budgets.split(",")]:
        for doc in docs:
            v = st.get_version(doc, "full")
            runs = {True: [], False: []}
            same = True
            for r in range(args.repeats):
                for counted in ((True, False) if r % 2 == 0 else (False, True)):
                    tag = f"p{int(counted)}r{r}b{budget:g}"
                    runs[counted].append((*compress(doc, budget, counted, tag), tag))
                same &= version_tensors_digest(st, doc, runs[True][-1][3]) == version_tensors_digest(st, doc, runs[False][-1][3])
            prefill = bare_prefill(lm, st, doc)
            e = [statistics.median(x[i] for x in runs[False]) for i in range(2)]
            c = [statistics.median(x[i] for x in runs[True]) for i in range(2)]
            n = runs[True][-1][2]
            totals.setdefault(budget, []).append((v.n_tokens, prefill, e, c))
            print(f"| {budget:g} | {doc} | {v.n_tokens} | {prefill:.2f} | {e[0]:.2f} | {c[0]:.2f} | {c[0] / e[0]:.2f} | "
                  f"{e[1]:.2f} | {c[1]:.2f} | {c[1] / e[1]:.2f} | {n} | {'yes' if same else 'NO'} |", flush=True)
    print("\nPer 1,000 tokens, all documents:\n")
    print("| budget | bare prefill s | compress s, as it was | as it is | ratio | compress / prefill, as it was | as it is |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for budget, rows in totals.items():
        tok = sum(r[0] for r in rows) / 1000
        p = sum(r[1] for r in rows) / tok
        e = sum(r[2][0] for r in rows) / tok
        c = sum(r[3][0] for r in rows) / tok
        print(f"| {budget:g} | {p:.2f} | {e:.2f} | {c:.2f} | {c / e:.2f} | {e / p:.2f}x | {c / p:.2f}x |")


def bare_prefill(lm, st: Store, doc: str) -> float:
    """Seconds of one forward over the document's tokens (no cache kept beyond the call)."""
    ids = torch.cat([decode_bundle(st.read_object(c.object)).tensors["token_ids"].long()
                     for c in st.get_version(doc, "full").chunks])
    with torch.inference_mode():
        t0 = time.perf_counter()
        lm.model(input_ids=ids[None].to(lm.device), use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0


if __name__ == "__main__":
    main()
