"""How the value refit of a long document does on queries it never saw, per layer and KV head,
at its ridge weight and at heavier ones.

    python research/probes/refit_ridge_heldout.py [--tokens 8000] [--weights 1,10,100]

Ingests ``--tokens`` tokens of the example corpus (as ``bench/ttft.py`` builds them) and
compresses them with the 0.083 default. Every refit call (one per layer, with the inputs the
default gives it: the kept tokens, the held ones, the keys as decoded) is repeated per KV head at
the default ridge weight times each of ``--weights``, and each solution is judged by the attention
error it leaves for held-out queries: the ``1,024`` rows half a spacing after the fitted ones,
placed where a question would be (``cached_queries``), squared, over the full output's energy.
The kept values without a refit are the baseline. A rule that picks, per (layer, head), the
weight whose held-out error is least (no refit among the choices), and the default as built (each
head's fit checked on the same held-out rows, ``refit_values(check=...)``), are scored on a third
query set (rows a quarter of a spacing after the fitted ones), so that no choice is judged on the
queries that made it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "research" / "probes"))

from long_document import compress_watching_refit, ingested, print_row  # noqa: E402

import kdnctl.compress.refit as rf  # noqa: E402
import kdnctl.compress.stages.refit as stage  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402


def head_error(q, k, v, kept, kept_keys, fitted, scale) -> float:
    """One KV head: squared attention error over the full output's energy (``q [N, D]``)."""
    full = torch.softmax(q @ k.T * scale, -1) @ v
    kk = k[kept] if kept_keys is None else kept_keys
    got = torch.softmax(q @ kk.T * scale, -1) @ fitted
    return float((got - full).pow(2).sum() / full.pow(2).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--weights", default="1,10,100")
    args = ap.parse_args()
    weights = [float(w) for w in args.weights.split(",")]
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        store, doc_id, ids, keys, values = ingested(lm, args.tokens, Path(tmp))
        n_layers = len(keys)
        n = len(ids)
        pick = rf.query_rows(n)
        spacing = (n - 1) / max(len(pick) - 1, 1)

        def queries_after(shift: float):
            rows_ = (pick.float() + shift * spacing).round().long().clamp_max(n - 1).unique()
            return rf.document_queries(lm, ids, n_layers, n + rf.QUESTION_OFFSET,
                                       raw=rf.cached_queries(lm, ids, keys, values, rows_))[0]

        choose_q, judge_q = queries_after(0.5), queries_after(0.25)
        real = stage.refit_values
        layer = [0]

        def probe(q, k, v, kept, scale, rho, hold=None, kept_keys=None, check=None):
            i = layer[0]
            layer[0] += 1
            h = k.shape[0]
            group = q.shape[0] // h
            product = real(q, k, v, kept, scale, rho, hold, kept_keys, check)  # the default as it is built
            for j in range(h):
                sl = slice(j * group, (j + 1) * group)
                kk = None if kept_keys is None else kept_keys[j:j + 1]
                fits = {"none": v[j:j + 1, kept].float()[0], "product": product[j]}
                for w in weights:
                    fits[f"x{w:g}"] = real(q[sl], k[j:j + 1], v[j:j + 1], kept, scale, rho * w, hold, kk)[0]
                d = q.shape[-1]
                row = {"layer": i, "head": j}
                for name, f in fits.items():
                    row[f"choose_{name}"] = head_error(choose_q[i][sl].reshape(-1, d), k[j], v[j], kept,
                                                       None if kk is None else kk[0], f, scale)
                    row[f"judge_{name}"] = head_error(judge_q[i][sl].reshape(-1, d), k[j], v[j], kept,
                                                      None if kk is None else kk[0], f, scale)
                best = min((f for f in fits if f != "product"), key=lambda name: row[f"choose_{name}"])
                row["picked"] = best
                row["judge_picked"] = row[f"judge_{best}"]
                rows.append(row)
                print_row(row)
            return product

        compress_watching_refit(store, doc_id, lm, probe)
    names = ["none"] + [f"x{w:g}" for w in weights] + ["picked", "product"]
    print(f"\n{n} tokens; {len(rows)} (layer, KV head) fits of the 0.083 default; held-out attention error "
          "(squared, over the full output's energy) on the judging queries\n")
    print("| ridge | median | mean | worst | (layer, head) fits worse than no refit |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        vals = [r[f"judge_{name}"] for r in rows]
        worse = sum(r[f"judge_{name}"] > r["judge_none"] for r in rows)
        label = {"none": "no refit", "picked": "picked per (layer, head) on the choosing queries",
                 "product": "the default as built (its fit checked on the choosing queries)"}.get(name, f"default x {name[1:]}")
        print(f"| {label} | {statistics.median(vals):.4g} | {statistics.mean(vals):.4g} | {max(vals):.4g} | {worse} |")
    picks = {name: sum(r["picked"] == name for r in rows) for name in names[:-2]}
    print(f"\npicked: {picks}")


if __name__ == "__main__":
    main()
