"""A first compress with a value refit as it was (the key weights and the refit's queries from two
decoder passes, the values' rounding with feedback one layer after another) against as it is (one
pass serves both, the rounding's layers on both cores): the same version, in less time.

    python research/probes/shared_pass.py [--docs examples/corpus] [--budget 0.083] [--repeats 1]

Ingests every document of ``--docs`` into a temporary store, then compresses each at the budget
(the shipped default; a refit is below 0.25) twice per repeat, alternating which goes first, the
key weights forgotten before each (each pays what a first compress pays). The two versions'
tensors must be equal byte for byte. Prints per document: tokens, a bare prefill's seconds, each
compress's seconds and their ratio, and the decoder passes each ran.
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

from counted_fit import bare_prefill, version_tensors_digest  # noqa: E402

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.compress.stages import quantize as qz  # noqa: E402
from kdnctl.compress.stages import refit as refit_stage  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import read_corpus  # noqa: E402
from kdnctl.models import adapter_for  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant.sensitivity import forget_key_weights  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", default=str(ROOT / "examples" / "corpus"))
    ap.add_argument("--budget", type=float, default=0.083)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    lm = load_model(None)
    corpus, _ = read_corpus([Path(args.docs)])
    st = Store(tempfile.mkdtemp(prefix="shared-pass-"))
    ingest_documents(st, lm, corpus, IngestOptions())
    docs = [d.doc_id for d in st.list_documents()]
    passes = {"n": 0}
    adapter_for(lm.model).decoder.register_forward_pre_hook(lambda *_: passes.__setitem__("n", passes["n"] + 1))
    shared = refit_stage.first_pass_queries

    def compress(doc: str, now: bool, tag: str):
        refit_stage.first_pass_queries = shared if now else (lambda job: None)
        qz.FEEDBACK_WORKERS = 2 if now else 1
        forget_key_weights()
        passes["n"] = 0
        t0 = time.perf_counter()
        with st.writer():
            compress_document(st, doc, CompressRecipe(budget=args.budget), lm=lm, label=tag)
        return time.perf_counter() - t0, passes["n"]

    compress(docs[0], True, "warm")  # the store's key basis and the compiled kernels, before any timing
    print(f"model {lm.fingerprint[:12]}, torch threads {torch.get_num_threads()}, budget {args.budget:g}, "
          f"repeats {args.repeats}\n")
    print("| document | tokens | bare prefill s | compress s, as it was | as it is | ratio | decoder passes, was | is | same tensors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    tot = {"tok": 0, "pre": 0.0, "was": 0.0, "is": 0.0}
    for doc in docs:
        runs = {True: [], False: []}
        same = True
        for r in range(args.repeats):
            for now in ((True, False) if r % 2 == 0 else (False, True)):
                tag = f"s{int(now)}r{r}"
                runs[now].append((*compress(doc, now, tag), tag))
            same &= version_tensors_digest(st, doc, runs[True][-1][2]) == version_tensors_digest(st, doc, runs[False][-1][2])
        n_tok = st.get_version(doc, "full").n_tokens
        prefill = bare_prefill(lm, st, doc)
        was, now_s = (statistics.median(x[0] for x in runs[k]) for k in (False, True))
        for k, v in (("tok", n_tok), ("pre", prefill), ("was", was), ("is", now_s)):
            tot[k] += v
        print(f"| {doc} | {n_tok} | {prefill:.2f} | {was:.2f} | {now_s:.2f} | {now_s / was:.2f} | "
              f"{runs[False][-1][1]} | {runs[True][-1][1]} | {'yes' if same else 'NO'} |", flush=True)
    k = tot["tok"] / 1000
    print(f"\nPer 1,000 tokens, all documents: bare prefill {tot['pre'] / k:.2f} s; compress as it was "
          f"{tot['was'] / k:.2f} s ({tot['was'] / tot['pre']:.1f}x the prefill), as it is {tot['is'] / k:.2f} s "
          f"({tot['is'] / tot['pre']:.1f}x); ratio {tot['is'] / tot['was']:.2f}")


if __name__ == "__main__":
    main()
