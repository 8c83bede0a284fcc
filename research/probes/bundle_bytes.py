"""Where a version's stored bytes go, by tensor kind: bytes per document token of every tensor
name (layer indices folded: ``layers.*.keys.codes``) and of the rest of each object (the
safetensors header with the bundle's meta, the store's stamp), over the documents that hold it.

    python bench/bundle_bytes.py --store DIR --versions LABEL[,LABEL...]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kdnctl.format.bundle import decode_bundle, parse_head  # noqa: E402
from kdnctl.store import Store  # noqa: E402

LAYER = re.compile(r"^layers\.\d+\.")


def version_bytes(st: Store, label: str) -> tuple[collections.Counter, int, int]:
    """(bytes per tensor kind, document tokens, stored bytes) of ``label`` over the store."""
    kinds, tokens, stored = collections.Counter(), 0, 0
    for doc in st.list_documents():
        got = [v for v in st.list_versions(doc.doc_id) if v.label == label]
        if not got:
            continue
        tokens, stored = tokens + got[0].n_tokens, stored + got[0].nbytes
        for ref in got[0].chunks:
            raw = st.read_object(ref.object)
            decode_bundle(raw)  # the whole check; the bytes counted are the file's tensors (1.9 rebuilds some in memory)
            index = parse_head(raw, len(raw))[4]
            for begin, end, name, dtype, _shape, _numel in index:
                kinds[f"{LAYER.sub('layers.*.', name)} ({str(dtype).removeprefix('torch.')})"] += end - begin
            kinds["(header, meta, stamp)"] += ref.nbytes - sum(end - begin for begin, end, *_ in index)
    return kinds, tokens, stored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--versions", required=True, help="comma-separated version labels")
    args = ap.parse_args()
    st = Store(args.store, create=False)
    for label in args.versions.split(","):
        kinds, tokens, stored = version_bytes(st, label)
        if not tokens:
            sys.exit(f"{label}: no document in {args.store} holds it")
        print(f"\n{label}: {stored / tokens:.1f} stored bytes per token over {tokens} tokens\n")
        print("| tensor | bytes per token | share |")
        print("|---|---:|---:|")
        for kind, n in kinds.most_common():
            print(f"| `{kind}` | {n / tokens:.1f} | {100 * n / stored:.1f}% |")
    st.close()


if __name__ == "__main__":
    main()
