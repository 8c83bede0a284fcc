"""Stored ec versions re-framed with each code frame at its own width (format 1.11): bytes, and
that the codes are the same.

    python research/probes/own_widths.py --store DIR [--store DIR ...] --versions b0.25,b0.083

For every chunk of each version in each store, every codes blob is rewritten by
``entropy.own_width_frames`` (what a compress now does after fitting its scale), decoded by the
reference decoder before and after (the integer codes must be equal), and the whole object
encoded again (``encode_bundle``). Prints, per version: documents, chunks, blobs of two-byte
codes, the objects' bytes before and after, and their ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.format.bundle import KVBundle, decode_bundle, encode_bundle  # noqa: E402
from kdnctl.quant.entropy import decode_role_ints, own_width_frames  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def layer_tokens(tensors: dict, layer: int) -> int:
    pos = tensors.get(f"layers.{layer}.positions")
    return int((pos if pos is not None else tensors["positions"]).shape[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", action="append", required=True)
    ap.add_argument("--versions", default="b0.25,b0.083")
    args = ap.parse_args()
    rows = {v: [0, 0, 0, 0, 0] for v in args.versions.split(",")}  # docs, chunks, two-byte blobs, before, after
    for root in args.store:
        store = Store(root, create=False)
        for doc in store.list_documents():
            versions = {v.label: v for v in store.list_versions(doc.doc_id)}
            for label, row in rows.items():
                version = versions.get(label)
                if version is None:
                    continue
                row[0] += 1
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
        store.close()
    print("| version | documents | chunks | blobs of two-byte codes | bytes before | bytes after | after / before |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, (docs, chunks, blobs, before, after) in rows.items():
        if docs:
            print(f"| {label} | {docs} | {chunks} | {blobs} | {before} | {after} | {after / before:.4f} |")


if __name__ == "__main__":
    main()
