"""When each layer group of the 0.25 default's decode is written and where the question's forward
waits, in one load behind the forward (what ``kdnctl ask`` does), beside the stored ``full`` on
two and on one torch thread: the numbers behind the bound on its time to first token.

    python research/probes/overlap_timeline.py --tokens 8000 --repeats 5

One document of the example corpus at the default in a store (``default_version.default_store``).
For each of ``full`` (2 threads, 1 thread) and the default (behind the forward on 2 threads, and
decoded first on 1): medians of ``--repeats``; for the last load behind the forward, the seconds
from its start at which each group was written (``done``) and at which the forward reached
every fifth layer, with how long it waited there (``wait``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "research" / "probes")]

import torch  # noqa: E402

import ttft  # noqa: E402
from default_version import default_store  # noqa: E402
from kdnctl.engine import overlap  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    lm = load_model(dtype="float32")
    q = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, ttft.QUESTION)
    events: list[tuple] = []
    t0 = [0.0]
    done, wait = overlap.LayersReady.done, overlap.LayersReady.wait

    def timed_done(self, g):
        events.append(("done", g, time.perf_counter() - t0[0]))
        done(self, g)

    def timed_wait(self, layer):
        t = time.perf_counter()
        wait(self, layer)
        if layer % 5 == 0:
            events.append(("wait", layer, t - t0[0], time.perf_counter() - t))

    overlap.LayersReady.done, overlap.LayersReady.wait = timed_done, timed_wait
    with tempfile.TemporaryDirectory() as tmp:
        st, doc = default_store(lm, args.tokens, Path(tmp))
        print(f"{st.get_version(doc, 'full').n_tokens} tokens, medians of {args.repeats}, {overlap.usable_cores()} cores\n")
        for label, threads, behind in (("full", 2, True), ("full", 1, True), ("default", 2, True), ("default", 1, False)):
            torch.set_num_threads(threads)
            xs = []
            for _ in range(args.repeats):
                t0[0] = time.perf_counter()
                events.clear()
                xs.append(ttft.stored_ttft(lm, st, doc, label, q, overlap=behind))
            how = "behind the forward" if label == "default" and behind else "decoded first" if label == "default" else ""
            print(f"{label} {how}, torch threads {threads}: median {statistics.median(xs):.4f} s "
                  f"({', '.join(f'{x:.3f}' for x in xs)})")
            if label == "default" and behind:
                for e in events:
                    print("   ", e[0], e[1], *(f"{x:.4f}" for x in e[2:]))
        torch.set_num_threads(2)


if __name__ == "__main__":
    main()
