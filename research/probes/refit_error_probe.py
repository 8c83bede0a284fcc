"""Where a stored 0.083 version's attention output goes wrong: the keys' rounding, the values'
rounding, or the fit itself (session 40, docs/compression.md "Values fitted to the decoded keys").

    python bench/refit_error_probe.py --store S DOC [DOC ...]

For each document (already ingested in the store S, e.g. one of bench/quality.py's stores) it
compresses the 0.083 recipe with the held refit three ways (plain, ``--refit-decoded``, and
``--refit-decoded --refit-feedback``; new labels ``probe-*``), and for the document's own queries
placed after it (the refit's) prints the attention output's squared error against the full
cache's, relative to the full output's energy, summed over the 30 layers, with:
  * the stored (loaded) keys and values;
  * the exact kept keys and the stored values (the values' rounding, and the fit);
  * the stored keys and the fitted values before rounding (the keys' rounding, and the fit);
  * the exact kept keys and the fitted values (the fit alone);
  * the exact kept keys and values, no refit (what eviction leaves).
"""

from __future__ import annotations

import argparse

import torch

BASE = dict(budget=0.083, quant="ec", keep=0.5, protect=32, scorer="sentences-gap", lift="literals", lift_share=0.3,
            lift_level=2, lift_role="keys", refit=0.01, refit_hold=True)
VARIANTS = {"held refit": {}, "decoded": {"refit_decoded": True}, "decoded + feedback": {"refit_decoded": True, "refit_feedback": True}}


def relative_error(full, queries, scales, i: int, keys: torch.Tensor, values: torch.Tensor) -> float:
    """Layer ``i``: sum over KV heads of ||out - full out||^2 / ||full out||^2 (the group's queries pooled)."""
    h = full.keys[i].shape[1]
    group = queries[i].shape[0] // h
    err = norm = 0.0
    for j in range(h):
        q = queries[i][j * group:(j + 1) * group].reshape(-1, full.keys[i].shape[-1])
        target = torch.softmax(q @ full.keys[i][0, j].float().T * scales[i], -1) @ full.values[i][0, j].float()
        got = torch.softmax(q @ keys[j].float().T * scales[i], -1) @ values[j].float()
        err += float((got - target).pow(2).sum())
        norm += float(target.pow(2).sum())
    return err / norm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("docs", nargs="+")
    ap.add_argument("--store", required=True)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    import kdnctl.compress.stages.refit as ce
    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.engine.hf import load_document
    from kdnctl.models.load import load_model
    from kdnctl.store import Store
    from kdnctl.compress.refit import QUESTION_OFFSET, document_queries

    if args.threads:
        torch.set_num_threads(args.threads)
    lm, st = load_model(), Store(args.store)
    seen: dict = {}
    plain_refitted = ce.refitted

    def spy(*a, **kw):  # the fitted values before rounding, and the kept rows
        seen["values"], seen["rows"] = plain_refitted(*a, **kw), a[5]
        return seen["values"]

    ce.refitted = spy
    print("| document | variant | stored K, stored V | exact K, stored V | stored K, fitted V | exact K, fitted V | exact kept K, V (no refit) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for doc in args.docs:
        full = load_document(lm, st, doc, "full")
        queries, scales = document_queries(lm, full.token_ids, len(full.keys), full.next_position + QUESTION_OFFSET)
        for name, extra in VARIANTS.items():
            with st.writer():
                label = compress_document(st, doc, CompressRecipe(**BASE, **extra), lm=lm,
                                          label="probe-" + name.replace(" + ", "-").replace(" ", "-")).label
            ctx = load_document(lm, st, doc, label)
            fitted, rows = seen["values"], seen["rows"]
            tot = torch.zeros(5, dtype=torch.float64)
            for i in range(len(full.keys)):
                ek, ev = full.keys[i][0][:, rows], full.values[i][0][:, rows]
                sk, sv = ctx.keys[i][0], ctx.values[i][0]
                tot += torch.tensor([relative_error(full, queries, scales, i, k, v)
                                     for k, v in ((sk, sv), (ek, sv), (sk, fitted[i]), (ek, fitted[i]), (ek, ev))])
            print(f"| {doc} | {name} | " + " | ".join(f"{x:.3f}" for x in tot.tolist()) + " |", flush=True)


if __name__ == "__main__":
    main()
