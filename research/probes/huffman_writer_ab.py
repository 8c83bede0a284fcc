"""The code frames deflated by the compiled Huffman-only writer (``kdnctl.kernels.ec.huffman_only``,
every frame of a blob in one call) against zlib, one frame per call (the encode before it), in
one process: compress seconds, and the stored tensors equal.

    python research/probes/huffman_writer_ab.py [--sizes 1024,2048,4096,8000] [--budgets 0.25] [--repeats 5]

Per size: the example corpus (as ``bench/ttft.py`` builds it) ingested once, its bare prefill
timed (the best of two), then ``kdnctl compress --budget B`` run ``--repeats`` times per side,
alternating which goes first (the Fisher profile and the compiled kernels paid before, off the
clock). Prints medians, the paired median writer / zlib, each against the bare prefill, and
whether both sides stored the same tensors.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "research" / "probes")]

import torch  # noqa: E402

from compress_ab import alternating, bench_document  # noqa: E402

from kdnctl.compress.document import CompressRecipe  # noqa: E402
from kdnctl.compress.stages import payload_size  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import entropy, frames  # noqa: E402
from kdnctl.quant.coders.deflate import deflate_compress  # noqa: E402


def zlib_frame_blob(codes, bins, width, compress=None):
    """``frames.frame_blob`` with every frame deflated by zlib, one call per frame (as before)."""
    return frames.frame_blob(codes, bins, width, compress or deflate_compress)


SIDES = {"writer": frames.frame_blob, "zlib": zlib_frame_blob}


def use(name: str) -> None:
    payload_size.frame_blob = entropy.frame_blob = SIDES[name]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096,8000")
    ap.add_argument("--budgets", default="0.25")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in [int(s) for s in args.sizes.split(",")]:
            store, doc, ids, bare = bench_document(lm, size, Path(tmp))
            for budget in (float(b) for b in args.budgets.split(",")):
                secs, same = alternating(store, doc, CompressRecipe(budget=budget), lm,
                                         {name: functools.partial(use, name) for name in SIDES}, args.repeats)
                med = {k: statistics.median(v) for k, v in secs.items()}
                paired = statistics.median(a / b for a, b in zip(secs["writer"], secs["zlib"]))
                rows.append((len(ids), budget, bare, med["writer"], med["zlib"], paired, same))
                print(f"# done {size} {budget:g}", file=sys.stderr, flush=True)
            store.close()
    print(f"medians of {args.repeats}; torch on two threads\n")
    print("| tokens | budget | bare prefill s | compress, writer s | zlib s | writer / zlib (paired) | "
          "writer / bare | zlib / bare | same tensors |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, budget, bare, a, b, p, same in rows:
        print(f"| {n} | {budget:g} | {bare:.3f} | {a:.3f} | {b:.3f} | {p:.3f} | {a / bare:.2f} | {b / bare:.2f} | {same} |")


if __name__ == "__main__":
    main()
