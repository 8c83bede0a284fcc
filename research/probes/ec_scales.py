"""The fitted scale (``alpha``: steps relative to each head's weighted spread) of ec versions, per
document, in stores a quality run left behind: how much finer the same byte cap quantizes.

    python bench/ec_scales.py --stores /tmp/qstore0,/tmp/qstore1 --labels A,B

Prints, for each label, the median alpha and stored fraction of fp16 over the documents that
hold every label, and the per-document ratio of each label's alpha to the first label's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kdnctl.format.bundle import read_meta  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stores", required=True, help="comma-separated store directories")
    ap.add_argument("--labels", required=True, help="comma-separated version labels; ratios are to the first")
    args = ap.parse_args()
    labels = args.labels.split(",")
    rows = []  # per document: {label: (alpha, stored / fp16)}
    for root in args.stores.split(","):
        st = Store(root, create=False)
        for d in st.list_documents():
            got = {}
            for v in st.list_versions(d.doc_id):
                if v.label in labels:
                    q = read_meta(st.read_object(v.chunks[0].object)).get("quant") or {}
                    fp16 = 4 * d.n_tokens * _kv_elements_per_token(st, v)
                    got[v.label] = (float(q["alpha"]), v.nbytes / fp16)
            if len(got) == len(labels):
                rows.append(got)
        st.close()
    if not rows:
        raise SystemExit("no document holds every label")
    print(f"{len(rows)} documents holding {', '.join(labels)}\n")
    print("| version | median alpha | median stored / fp16 | alpha / first label's, median (min-max) |")
    print("|---|---:|---:|---:|")
    for lab in labels:
        ratios = [r[lab][0] / r[labels[0]][0] for r in rows]
        print(f"| {lab} | {statistics.median(r[lab][0] for r in rows):.4f} | "
              f"{statistics.median(r[lab][1] for r in rows):.4f} | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")


def _kv_elements_per_token(st, v) -> int:
    """K or V elements per token over all layers and KV heads / 2 (x 2 bytes x 2 roles = 4 x this)."""
    m = read_meta(st.read_object(v.chunks[0].object))["model"]
    return m["n_layers"] * m["n_kv_heads"] * m["head_dim"]


if __name__ == "__main__":
    main()
