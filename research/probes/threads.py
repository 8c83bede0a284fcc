"""Torch intra-op threads on this machine: one vs N for the two kinds of work the test suite is
made of, a prefill (700 tokens of examples/corpus/faq.md) and a greedy answer (16 new tokens after
a 300-token prompt), with the real default model. Interleaved repetitions in one process; prints
each timing, the ratio N-threads / 1-thread and the load average beside them.

    python bench/threads.py [--threads 2] [--repeats 2]

Why tests/conftest.py runs the suite on one thread (KDNCTL_TEST_THREADS): on a shared 2-core
machine a second thread that spins at every op's barrier waits for a core the other jobs hold.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="the N compared with 1")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import torch

    from kdnctl.engine.hf import forward_suffix, generate
    from kdnctl.models.load import load_model

    lm = load_model()
    text = (REPO / "examples" / "corpus" / "faq.md").read_text()
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids[:700]
    times: dict[int, dict[str, list[float]]] = {n: {"prefill": [], "answer": []} for n in (1, args.threads)}
    for rep in range(args.repeats):
        for n in (1, args.threads):
            torch.set_num_threads(n)
            t = time.perf_counter()
            forward_suffix(lm, None, ids, last_only=True)
            times[n]["prefill"].append(time.perf_counter() - t)
            t = time.perf_counter()
            generate(lm, None, ids[:300], max_new_tokens=16)
            times[n]["answer"].append(time.perf_counter() - t)
            print(f"rep {rep} threads {n}: prefill {times[n]['prefill'][-1]:.2f} s, "
                  f"answer {times[n]['answer'][-1]:.2f} s; load {os.getloadavg()[0]:.2f}", flush=True)
    for what in ("prefill", "answer"):
        one, many = statistics.median(times[1][what]), statistics.median(times[args.threads][what])
        print(f"{what}: 1 thread {one:.2f} s, {args.threads} threads {many:.2f} s, ratio {many / one:.2f} "
              f"(median of {args.repeats}); load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
