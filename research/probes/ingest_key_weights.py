"""The key weights from ingest's own prefill (each chunk's squared queries, bundle tensor
``query_energy``) against a forward over the document at compress time: what ingest pays to
record them, what a first ``b0.25`` compress saves, and how far the stored codes move.

    python research/probes/ingest_key_weights.py [--docs examples/corpus] [--repeats 3]

One process, torch on 2 threads. Per document of ``--docs``, alternating which goes first, medians
of ``--repeats``:

1. a bare prefill (one forward, no cache kept, logits of the last token only);
2. ingest into a fresh store with the queries recorded and without (as before);
3. compress at 0.25 (the shipped default) reading the recorded weights, and with a forward over
   the document (as before), the key weights forgotten before each (what a first compress pays).

Then the codes of the two 0.25 versions: how many differ and by how much (below 0.25 the
refit's forward serves the key weights either way, so those versions do not move).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from counted_fit import bare_prefill  # noqa: E402

import kdnctl.compress.stages.precision as precision  # noqa: E402
import kdnctl.ingest.prefix as prefix  # noqa: E402
from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import read_corpus  # noqa: E402
from kdnctl.models import adapter_for  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant.entropy import decode_role_ints  # noqa: E402
from kdnctl.quant.sensitivity import forget_key_weights  # noqa: E402
from kdnctl.store import Store  # noqa: E402

PREFILL, RECORDED = prefix.prefill, precision.recorded_key_weights


def ingest(lm, doc, record: bool) -> tuple[float, Store]:
    prefix.prefill = PREFILL if record else (lambda *a, **k: PREFILL(*a, **{**k, "energy_chunk": None}))
    st = Store(tempfile.mkdtemp(prefix="ingest-kw-"))
    t0 = time.perf_counter()
    ingest_documents(st, lm, [doc], IngestOptions())
    prefix.prefill = PREFILL
    return time.perf_counter() - t0, st


def codes(st: Store, doc: str, label: str) -> list[torch.Tensor]:
    out = []
    for c in st.get_version(doc, label).chunks:
        b = decode_bundle(st.read_object(c.object))
        q = b.meta["quant"]
        for name in sorted(n for n in b.tensors if n.endswith(".codes")):
            layer = int(name.split(".")[1])
            pos = b.tensors.get(f"layers.{layer}.positions", b.tensors["positions"])
            out.append(decode_role_ints(b.tensors[name], b.tensors[name[:-5] + "params"], q["n_heads"], q["head_dim"],
                                        int(pos.shape[-1]), name, q["coding"])[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", default=str(ROOT / "examples" / "corpus"))
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model(None)
    corpus, _ = read_corpus([Path(args.docs)])
    passes = {"n": 0}
    adapter_for(lm.model).decoder.register_forward_pre_hook(lambda *_: passes.__setitem__("n", passes["n"] + 1))

    def compress(st, doc_id: str, budget: float, record: bool, tag: str) -> tuple[float, int]:
        precision.recorded_key_weights = RECORDED if record else (lambda *a, **k: None)
        forget_key_weights()
        passes["n"] = 0
        t0 = time.perf_counter()
        with st.writer():
            compress_document(st, doc_id, CompressRecipe(budget=budget), lm=lm, label=tag)
        precision.recorded_key_weights = RECORDED
        return time.perf_counter() - t0, passes["n"]

    _, warm = ingest(lm, corpus[0], True)
    compress(warm, corpus[0].doc_id, 0.25, True, "warm")  # the compiled kernels, before any timing
    print(f"model {lm.fingerprint[:12]}, torch threads {torch.get_num_threads()}, repeats {args.repeats}\n")
    print("| document | tokens | bare prefill s | ingest s, recorded | as before | ratio | b0.25 compress s, "
          "recorded | as before | ratio | decoder passes, recorded | before |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    tot = {k: 0.0 for k in ("tok", "pre", "ing1", "ing0", "c1", "c0")}
    moved = []
    for doc in corpus:
        ing = {True: [], False: []}
        comp = {True: [], False: []}
        stores = {}
        for r in range(args.repeats):
            for record in ((True, False) if r % 2 == 0 else (False, True)):
                s, st = ingest(lm, doc, record)
                ing[record].append(s)
                stores[record] = st
        st = stores[True]  # both compresses read the same ingest; one of them ignores its recorded weights
        for r in range(args.repeats):
            for record in ((True, False) if r % 2 == 0 else (False, True)):
                comp[record].append(compress(st, doc.doc_id, 0.25, record, f"b0.25-{int(record)}-{r}"))
        n_tok = st.get_version(doc.doc_id, "full").n_tokens
        pre = statistics.median(bare_prefill(lm, st, doc.doc_id) for _ in range(args.repeats))
        i1, i0 = (statistics.median(ing[k]) for k in (True, False))
        c1, c0 = (statistics.median(x[0] for x in comp[k]) for k in (True, False))
        for k, v in (("tok", n_tok), ("pre", pre), ("ing1", i1), ("ing0", i0), ("c1", c1), ("c0", c0)):
            tot[k] += v
        print(f"| {doc.doc_id} | {n_tok} | {pre:.2f} | {i1:.2f} | {i0:.2f} | {i1 / i0:.3f} | {c1:.2f} | {c0:.2f} | "
              f"{c1 / c0:.2f} | {comp[True][-1][1]} | {comp[False][-1][1]} |", flush=True)
        a, b = (codes(st, doc.doc_id, t) for t in ("b0.25-1-0", "b0.25-0-0"))
        moved.append((doc.doc_id, sum(x.numel() for x in a), sum(int((x != y).sum()) for x, y in zip(a, b)),
                      max(int((x.long() - y.long()).abs().max()) for x, y in zip(a, b))))
    k = tot["tok"] / 1000
    print(f"\nPer 1,000 tokens, all documents: bare prefill {tot['pre'] / k:.2f} s; ingest {tot['ing1'] / k:.2f} s "
          f"recorded, {tot['ing0'] / k:.2f} s before (tokens/s vs the bare prefill {tot['pre'] / tot['ing1']:.2f}x "
          f"and {tot['pre'] / tot['ing0']:.2f}x); b0.25 compress {tot['c1'] / k:.2f} s recorded "
          f"({tot['c1'] / tot['pre']:.2f}x the prefill), {tot['c0'] / k:.2f} s before ({tot['c0'] / tot['pre']:.2f}x); "
          f"ratio {tot['c1'] / tot['c0']:.2f}\n")
    print("| document | b0.25 codes | differing | largest difference (steps) |")
    print("|---|---:|---:|---:|")
    for doc_id, n, d, m in moved:
        print(f"| {doc_id} | {n} | {d} ({d / n:.1e}) | {m} |")


if __name__ == "__main__":
    main()
