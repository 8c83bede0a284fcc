"""Where an ``ec`` version's bytes go, layer by layer: stored bits per element of keys and values,
and in ``--backfill`` layers the kept and the backfilled (evicted) rows coded apart.

    python bench/ec_bits.py --store DIR --versions LABEL[,LABEL...] [--docs a,b]

Per layer and role: ``stored`` = 8 x (codes + params bytes) / (rows x head_dim), rows = tokens x
KV heads the layer holds; the fraction of the document's tokens the layer holds. In a layer with
its own token levels (``--backfill``), the integer codes are recovered from the bundle and the
rows whose value level is 0 (the backfilled ones: the kept ones sit ``backfill_shift`` levels up; of the
wide heads only where ``--backfill L.H`` named heads) and the rest
are framed apart by the library's own coder (``entropy.encode_codes``, the version's coding) - what each would cost
stored alone, without params - plus the backfilled rows' order-0 entropy per channel (what
``bench/merge_probe.py`` charges its coarse copies). The last line of each version: stored bytes
of whole objects / fp16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.format.bundle import decode_bundle  # noqa: E402

from kdnctl.format.names import role_levels, stored_rows, tensor_name
from kdnctl.compress.sizing import fp16_bytes  # noqa: E402
from kdnctl.quant.entropy import ROLES, encode_codes, integer_codes  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def order0_bits(codes: torch.Tensor) -> float:
    """Sum over channels of ``T`` x the order-0 entropy of the channel's codes (``[H, T, D]``)."""
    h, t, d = codes.shape
    total = 0.0
    for row in codes.permute(0, 2, 1).reshape(h * d, t):
        _, n = torch.unique(row, return_counts=True)
        p = n.double() / t
        total += float(-(p * p.log2()).sum()) * t
    return total


def layer_rows(versions: dict, n_layers: int) -> list[dict]:
    """Per layer: sums of rows, stored bits and the split (see the module doc) over ``versions``."""
    acc = [dict(rows=0, doc_tokens=0, bits={r: 0.0 for r in ROLES}, kept_rows=0, fill_rows=0,
                kept_bits={r: 0.0 for r in ROLES}, fill_bits={r: 0.0 for r in ROLES},
                fill_ideal={r: 0.0 for r in ROLES}) for _ in range(n_layers)]
    for bundles in versions.values():
        for b in bundles:
            h, d = b.meta["quant"]["n_heads"], b.meta["quant"]["head_dim"]
            coding = b.meta["quant"].get("coding", "zstd")
            n_doc = int(b.tensors["token_ids"].numel())
            for i in range(n_layers):
                a = acc[i]
                # the layer's own levels (the values': their shift is >= 1, the keys' may be 0)
                own = b.tensors.get(tensor_name(i, "values.levels"), b.tensors.get(tensor_name(i, "levels")))
                levels = own if own is not None else b.tensors["token_levels"]
                held = stored_rows(b.tensors, f"layers.{i}")  # 1.8: narrow heads hold the kept rows only
                held = torch.ones(h, levels.numel(), dtype=torch.bool) if held is None else held
                a["rows"] += int(held.sum())
                a["doc_tokens"] += n_doc
                for role in ROLES:
                    p = tensor_name(i, role)
                    a["bits"][role] += 8.0 * (b.tensors[f"{p}.codes"].numel() + b.tensors[f"{p}.params"].numel())
                # a backfilled layer holds every token (no positions of its own); the others, with
                # their own levels too, hold the kept set, where level 0 is an ordinary kept token
                if own is None or tensor_name(i, "positions") in b.tensors:
                    continue
                fill = own == 0
                wide = held[:, fill].all(1)  # the heads that hold the backfilled rows
                a["fill_rows"] += int(held[:, fill].sum())
                a["kept_rows"] += int(held[:, ~fill].sum())
                for role in ROLES:
                    p = tensor_name(i, role)
                    c = integer_codes(b.tensors[f"{p}.codes"], b.tensors[f"{p}.params"], h, d,
                                      role_levels(b.tensors, f"layers.{i}", role), p, coding, stored=held)
                    for key, sel in (("fill_bits", fill), ("kept_bits", ~fill)):
                        if sel.any():
                            a[key][role] += 8.0 * encode_codes(c[:, sel], coding, stored=held[:, sel])[0].numel()
                    if fill.any():
                        a["fill_ideal"][role] += order0_bits(c[wide][:, fill])
    return acc


def ec_report_args(doc: str, repeat: bool = False):
    """``(args, store, documents)`` of an ec report (this one, ``bench/ec_coders.py``): --store,
    --versions, --docs (default: every document), and --repeat where timed."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--versions", required=True, help="comma-separated ec version labels")
    ap.add_argument("--docs", default=None, help="comma-separated documents (default: all)")
    if repeat:
        ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    st = Store(args.store, create=False)
    return args, st, args.docs.split(",") if args.docs else [r.doc_id for r in st.list_documents()]


def main() -> None:
    args, st, docs = ec_report_args(__doc__)
    for label in args.versions.split(","):
        per_doc, stored, fp16 = {}, 0, 0
        for doc in docs:
            v = st.get_version(doc, label)
            per_doc[doc] = [decode_bundle(st.read_object(c.object)) for c in v.chunks]
            stored += v.nbytes
            b = per_doc[doc][0]
            fp16 += fp16_bytes(v.n_tokens, b.n_layers, b.meta["quant"]["n_heads"], b.meta["quant"]["head_dim"])
        bundle0 = next(iter(per_doc.values()))[0]
        if bundle0.meta.get("quant", {}).get("scheme") != "ec":
            sys.exit(f"{label}: not an ec version (this report reads ec's codes)")
        d = bundle0.meta["quant"]["head_dim"]
        acc = layer_rows(per_doc, bundle0.n_layers)
        heads = bundle0.meta["quant"]["n_heads"]
        print(f"\n{label} ({len(docs)} documents): stored bits per element (codes + params)")
        print("| layer | tokens held | keys | values | kept rows K / V (coded apart) "
              "| backfilled rows K / V (coded apart) | backfilled K / V order-0 |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for i, a in enumerate(acc):
            el = a["rows"] * d
            cells = [f"{i}", f"{a['rows'] / heads / max(1, a['doc_tokens']):.2f}"]
            cells += [f"{a['bits'][r] / el:.2f}" for r in ROLES]
            if a["fill_rows"]:
                ke, fe = a["kept_rows"] * d, a["fill_rows"] * d
                cells += [" / ".join(f"{a['kept_bits'][r] / ke:.2f}" for r in ROLES),
                          " / ".join(f"{a['fill_bits'][r] / fe:.2f}" for r in ROLES),
                          " / ".join(f"{a['fill_ideal'][r] / fe:.2f}" for r in ROLES)]
            else:
                cells += ["-", "-", "-"]
            print("| " + " | ".join(cells) + " |")
        print(f"stored / fp16 over whole objects: {stored / fp16:.4f} ({stored} of {fp16} bytes)")


if __name__ == "__main__":
    main()
