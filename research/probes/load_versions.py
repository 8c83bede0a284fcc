"""Load time and time to first token of stored versions of one document, interleaved, one run.

    python bench/load_versions.py --store DIR --doc ID --labels full,ec-b0.25-p64,... [--repeats 5]

For each label: the median over ``--repeats`` of ``load_document`` alone (read, check, decode,
dequantize, place) and of load + the question's forward pass + the first token; the labels take
turns within every repetition, so a busy machine slows them alike. A full prefill of the same
document and question (once) is the baseline of the last column.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.engine.hf import forward_suffix, load_document  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.store import Store  # noqa: E402

QUESTION = "What does the document above say about its main subject?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--doc", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model()
    st = Store(args.store, create=False)
    labels = args.labels.split(",")
    q = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, QUESTION)
    load: dict[str, list[float]] = {lb: [] for lb in labels}
    ttft: dict[str, list[float]] = {lb: [] for lb in labels}
    for _ in range(args.repeats):
        for lb in labels:
            t0 = time.perf_counter()
            ctx = load_document(lm, st, args.doc, lb)
            t1 = time.perf_counter()
            forward_suffix(lm, ctx, q)
            t2 = time.perf_counter()
            load[lb].append(t1 - t0)
            ttft[lb].append(t2 - t0)
    full = load_document(lm, st, args.doc, "full")
    ids = torch.tensor([list(full.token_ids) + list(q)])
    t0 = time.perf_counter()
    with torch.no_grad():
        lm.model(ids, use_cache=True)
    prefill = time.perf_counter() - t0
    print(f"{args.doc}: {len(full.token_ids)} context tokens, {len(q)} question tokens, medians of {args.repeats}, "
          f"torch threads {args.threads}; full prefill {prefill:.3f} s")
    print("| version | stored MB | load s | TTFT s | TTFT speedup vs prefill |")
    print("|---|---:|---:|---:|---:|")
    for lb in labels:
        mb = st.get_version(args.doc, lb).nbytes / 1e6
        med_t = statistics.median(ttft[lb])
        print(f"| {lb} | {mb:.1f} | {statistics.median(load[lb]):.3f} | {med_t:.3f} | {prefill / med_t:.1f}x |")


if __name__ == "__main__":
    main()
