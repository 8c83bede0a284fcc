"""Time to first token of the 0.25 default with its decode behind the question's forward, the
forward's torch threads leaving the decode thread its core while the decode runs
(``LayersReady.sharing_cores``, the product) or not (every torch thread beside the decode
thread), and decoded first (on every core, then the forward), against ``full`` in the same
repetitions, the modes' order rotating from one repetition to the next.

    python research/probes/overlap_threads.py --sizes 1024,2048,4096,8000 --repeats 7 --threads 2
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "research" / "probes"))

import torch  # noqa: E402

import ttft  # noqa: E402
from default_version import default_store  # noqa: E402
from kdnctl.engine import overlap  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402

MODES = ("full", "shared", "plain", "first")


def timed(lm, st, doc_id: str, q, mode: str) -> float:
    overlap.SHARE_CORES = mode != "plain"
    label = "full" if mode == "full" else "default"
    return ttft.stored_ttft(lm, st, doc_id, label, q, overlap=mode != "first")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096,8000")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    q = fmt.question_ids(lm.tokenizer, ttft.QUESTION)
    print(f"torch threads {args.threads}, cores {overlap.usable_cores()}, medians of {args.repeats}; "
          "shared: the product (the forward leaves the decode a core while it runs); plain: the forward on "
          "every thread beside the decode; first: decoded on every core, then the forward\n")
    print("| context tokens | full s | shared s | plain s | first s | shared / full | plain / full | first / full | "
          "shared / plain (paired median) | shared / first (paired median) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            st, doc_id = default_store(lm, size, Path(tmp))
            n_tok = st.get_version(doc_id, "full").n_tokens
            for mode in MODES:  # warm
                timed(lm, st, doc_id, q, mode)
            res = {m: [] for m in MODES}
            for rep in range(args.repeats):
                k = rep % len(MODES)
                for mode in MODES[k:] + MODES[:k]:
                    res[mode].append(timed(lm, st, doc_id, q, mode))
            overlap.SHARE_CORES = True
            m = {k: statistics.median(v) for k, v in res.items()}
            sp = statistics.median(a / b for a, b in zip(res["shared"], res["plain"]))
            sf = statistics.median(a / b for a, b in zip(res["shared"], res["first"]))
            print(f"| {n_tok} | {m['full']:.3f} | {m['shared']:.3f} | {m['plain']:.3f} | {m['first']:.3f} | "
                  f"{m['shared'] / m['full']:.2f} | {m['plain'] / m['full']:.2f} | {m['first'] / m['full']:.2f} | "
                  f"{sp:.3f} | {sf:.3f} |", flush=True)
            st.close()


if __name__ == "__main__":
    main()
