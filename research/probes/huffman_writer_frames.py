"""The compiled Huffman-only writer against zlib on the code frames a real compress deflates.

    python research/probes/huffman_writer_frames.py [--tokens 1024] [--repeats 5]

Compresses ``--tokens`` tokens of the example corpus with the 0.25 default and keeps every codes
blob's uncompressed frames as the encoder cuts them (``frame_bytes``). Then, one thread, medians
of ``--repeats``: ``huffman_only.deflate_frames`` of every blob (one call per blob) against
``deflate_compress`` (zlib) of every frame (one call per frame), each checked equal; ns per
uncompressed byte and the frames' count and bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compress_ab import bench_document  # noqa: E402

import kdnctl.kernels.ec.frame_bytes as frame_bytes_module  # noqa: E402
from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.kernels.ec.huffman_only import deflate_frames  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant.coders.deflate import deflate_compress  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model(dtype="float32")
    blobs = []
    cut = frame_bytes_module.frame_bytes

    def keep(*a):
        buf, offsets, peaks = cut(*a)
        blobs.append((buf.copy(), offsets.copy()))
        return buf, offsets, peaks

    with tempfile.TemporaryDirectory() as tmp:
        store, doc, ids, _ = bench_document(lm, args.tokens, Path(tmp))
        frame_bytes_module.frame_bytes = keep
        with store.writer():
            compress_document(store, doc.doc_id, CompressRecipe(), lm=lm, label="default")
        frame_bytes_module.frame_bytes = cut
        store.close()

    def writer():
        return [deflate_frames(buf, offsets) for buf, offsets in blobs]

    def zlib_frames():
        return [[deflate_compress(memoryview(buf)[a:b]) if b > a else b"" for a, b in zip(offsets[:-1], offsets[1:])]
                for buf, offsets in blobs]

    for (out, ends), frames in zip(writer(), zlib_frames()):
        assert out.tobytes() == b"".join(frames) and [len(f) for f in frames] == (ends - [0, *ends[:-1]]).tolist()
    secs = {"writer": [], "zlib": []}
    for rep in range(args.repeats):
        for name, fn in ((("writer", writer), ("zlib", zlib_frames)) if rep % 2 else (("zlib", zlib_frames), ("writer", writer))):
            t = time.perf_counter()
            fn()
            secs[name].append(time.perf_counter() - t)
    n_bytes = sum(int(offsets[-1]) for _, offsets in blobs)
    n_frames = sum(len(offsets) - 1 for _, offsets in blobs)
    print(f"{len(ids)} tokens: {len(blobs)} blobs, {n_frames} frames, {n_bytes / 1e6:.1f} MB uncompressed; "
          f"one thread, medians of {args.repeats}; the same bytes\n")
    print("| coder | seconds | ns per byte |")
    print("|---|---:|---:|")
    for name, xs in secs.items():
        s = statistics.median(xs)
        print(f"| {name} | {s:.4f} | {s / n_bytes * 1e9:.2f} |")


if __name__ == "__main__":
    main()
