"""Stored ec versions re-framed with each code frame at its own width (format 1.11): bytes, and
that the codes are the same.

    python research/probes/own_widths.py --store DIR [--store DIR ...] --versions b0.25,b0.083

For every chunk of each version in each store, every codes blob is rewritten by
``own_width_frames``, decoded by the
reference decoder before and after (the integer codes must be equal), and the whole object
encoded again (``encode_bundle``). Prints, per version: documents, chunks, blobs of two-byte
codes, the objects' bytes before and after, and their ratio. With ``--time N``, the first N
documents of each version are also loaded both ways by the CPU batch decoder
(``ec_batch.decode_into``, two threads, best of 5, alternating), whose K/V must be equal: the
decode seconds before and after, and GB/s of the fp32 cache.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.format.bundle import KVBundle, decode_bundle, encode_bundle  # noqa: E402
from kdnctl.quant import ec_batch  # noqa: E402
from kdnctl.quant.entropy import (DEFAULT_CODING, OWN_WIDTHS, as_u8, codes_per_byte, compress_frame,  # noqa: E402
                                  decode_role_ints, frame_width)
from kdnctl.store import Store  # noqa: E402


def own_width_frames(blob: torch.Tensor, coding: str = DEFAULT_CODING) -> torch.Tensor:
    """A codes blob of two-byte codes (width 2) rewritten with each frame at its own width
    (``OWN_WIDTHS``): the frames of one code per byte-group whose peak fits a byte re-coded a byte
    per code, the others as they are. The same codes, what :func:`encode_codes` writes with
    ``own_widths``; other blobs (and other codings) are returned as they are."""
    raw = blob.numpy().tobytes()
    if coding != "deflate" or len(raw) < 2 or raw[0] != 2:
        return blob
    n = raw[1]
    sizes = np.frombuffer(raw, dtype="<i4", count=n, offset=2)
    peaks = np.frombuffer(raw, dtype="<i2", count=n, offset=2 + 4 * n)
    pos, frames = 2 + 6 * n, []
    for size, peak in zip(sizes.tolist(), peaks.tolist()):
        frame = raw[pos:pos + size]
        pos += size
        if size and codes_per_byte(peak) == 1 and frame_width(OWN_WIDTHS, peak) == 1:
            codes = np.frombuffer(zlib.decompressobj(-15).decompress(frame), dtype="<i2")  # this process's own frame
            frame = compress_frame(codes.astype(np.int8).tobytes(), coding)
        frames.append(frame)
    return as_u8(bytes([OWN_WIDTHS, n]) + np.array([len(f) for f in frames], "<i4").tobytes() + peaks.tobytes()
               + b"".join(frames))


def layer_tokens(tensors: dict, layer: int) -> int:
    pos = tensors.get(f"layers.{layer}.positions")
    return int((pos if pos is not None else tensors["positions"]).shape[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", action="append", required=True)
    ap.add_argument("--versions", default="b0.25,b0.083")
    ap.add_argument("--time", type=int, default=0, help="time the decode of the first N documents of each version")
    args = ap.parse_args()
    rows = {v: [0, 0, 0, 0, 0] for v in args.versions.split(",")}  # docs, chunks, two-byte blobs, before, after
    timed = {v: [0.0, 0.0, 0] for v in rows}  # seconds before, after, fp32 bytes
    for root in args.store:
        store = Store(root, create=False)
        for doc in store.list_documents():
            versions = {v.label: v for v in store.list_versions(doc.doc_id)}
            for label, row in rows.items():
                version = versions.get(label)
                if version is None:
                    continue
                row[0] += 1
                pairs = []
                for c in version.chunks:
                    raw = store.read_object(c.object)
                    b = decode_bundle(raw)
                    q = b.meta["quant"]
                    tensors = dict(b.tensors)
                    for name, blob in b.tensors.items():
                        if not name.endswith(".codes") or int(blob[0]) != 2:
                            continue
                        row[2] += 1
                        new = own_width_frames(blob, q["coding"])
                        params = b.tensors[name[:-len("codes")] + "params"]
                        t = layer_tokens(b.tensors, int(name.split(".")[1]))
                        ints = [decode_role_ints(x, params, q["n_heads"], q["head_dim"], t, name, q["coding"])[0]
                                for x in (blob, new)]
                        assert torch.equal(*ints), f"{root} {doc.doc_id} {label} {name}: the codes differ"
                        tensors[name] = new
                    row[1] += 1
                    row[3] += len(raw)
                    row[4] += len(encode_bundle(KVBundle(meta=b.meta, tensors=tensors)))
                    pairs.append((b, KVBundle(meta=b.meta, tensors=tensors)))
                if row[0] <= args.time:
                    before, after, nbytes = time_decodes(pairs)
                    timed[label][0] += before
                    timed[label][1] += after
                    timed[label][2] += nbytes
        store.close()
    print("| version | documents | chunks | blobs of two-byte codes | bytes before | bytes after | after / before |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, (docs, chunks, blobs, before, after) in rows.items():
        if docs:
            print(f"| {label} | {docs} | {chunks} | {blobs} | {before} | {after} | {after / before:.4f} |")
    if args.time:
        print("\n| version | documents | fp32 MB | decode s before | after | after / before | GB/s before | after |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for label, (before, after, nbytes) in timed.items():
            if nbytes:
                print(f"| {label} | {min(args.time, rows[label][0])} | {nbytes / 1e6:.0f} | {before:.3f} | {after:.3f} | "
                      f"{after / before:.3f} | {nbytes / before / 1e9:.2f} | {nbytes / after / 1e9:.2f} |")


def time_decodes(pairs) -> tuple[float, float, int]:
    """Best-of-5 seconds of the batch decoder over a version's chunks, as stored and re-framed
    (alternating), and the fp32 bytes it fills; the two caches must be equal."""
    q = pairs[0][0].meta["quant"]
    n_layers = sum(1 for k in pairs[0][0].tensors if k.endswith(".keys.codes"))
    lens = [b.layer_len(0) for b, _ in pairs]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    outs = [tuple(torch.zeros(n_layers, q["n_heads"], sum(lens), q["head_dim"]) for _ in range(2)) for _ in range(2)]
    best = [float("inf"), float("inf")]
    for _ in range(5):
        for j in range(2):
            chunks = [p[j] for p in pairs]
            assert ec_batch.eligible(chunks, n_layers, q, outs[j])
            t = time.perf_counter()
            ec_batch.decode_into(outs[j], chunks, starts, q)
            best[j] = min(best[j], time.perf_counter() - t)
    assert all(torch.equal(a, b) for a, b in zip(*outs)), "the re-framed chunks decode to other K/V"
    return best[0], best[1], 2 * outs[0][0].numel() * 4


if __name__ == "__main__":
    main()
