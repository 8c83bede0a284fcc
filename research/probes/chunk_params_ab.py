"""Time to first token of the 0.25 default behind the question's forward with each chunk's params
inflated once for all its layer groups (the product) or again for every group (as before),
against ``full``, the three in rotating order in each repetition, one process.

    python research/probes/chunk_params_ab.py --sizes 4096,8000 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "research" / "probes")]

import torch  # noqa: E402

import ttft  # noqa: E402
from default_version import default_store, rotating  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import ec_batch  # noqa: E402

ONCE = ec_batch._decode_chunk_role


def per_group(*args):
    """The job as before: its layers' params inflated here (``chunk_params_all`` dropped)."""
    return ONCE(*args[:14], None, args[15])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,8000")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    q = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, ttft.QUESTION)
    modes = ("full", "once", "per group")
    print(f"medians of {args.repeats}; once: the product; per group: params inflated for every layer group\n")
    print("| tokens | full s | once s | per group s | once / full | per group / full | once / per group (paired median) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            st, doc = default_store(lm, size, Path(tmp))

            def timed(mode: str) -> float:
                ec_batch._decode_chunk_role = per_group if mode == "per group" else ONCE
                try:
                    return ttft.stored_ttft(lm, st, doc, "full" if mode == "full" else "default", q)
                finally:
                    ec_batch._decode_chunk_role = ONCE

            res = rotating(timed, modes, args.repeats)
            med = {m: statistics.median(v) for m, v in res.items()}
            paired = statistics.median(a / b for a, b in zip(res["once"], res["per group"]))
            print(f"| {st.get_version(doc, 'full').n_tokens} | {med['full']:.3f} | {med['once']:.3f} | {med['per group']:.3f} | "
                  f"{med['once'] / med['full']:.2f} | {med['per group'] / med['full']:.2f} | {paired:.3f} |", flush=True)


if __name__ == "__main__":
    main()
