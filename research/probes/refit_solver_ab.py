"""The value refit's two solvers on one real compress: the full Gram product and an LU solve
against the Gram's lower blocks and a Cholesky solve (``kdnctl.compress.refit.ridge_solve``),
on the same inputs, layer by layer, judged on queries the fit never saw.

    python research/probes/refit_solver_ab.py [--tokens 8000]

Ingests ``--tokens`` tokens of the example corpus (as ``bench/ttft.py`` builds them) into a
temporary store, then compresses them with the 0.083 default. Every call of the refit
(``refit_values``, once per layer) is solved both ways. Each solution is judged by the attention
error it leaves (``softmax(q K_S^T) V' - softmax(q K^T) V``, squared, over the full output's
energy) for two query sets, both placed where a question would be:

- the fit's own queries (the ``1,024`` evenly spaced rows the refit reads);
- held-out queries: ``1,024`` other rows, half a spacing later, read the same way
  (``cached_queries``).

The kept values before any refit are the baseline. The table also gives how far the two
solutions are apart (``|V'_a - V'_b|`` over ``|V'_a - V_S|``: the share of the refit's move on
which they differ).
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


def attention_error(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor,
                    kept_keys: torch.Tensor | None, fitted: torch.Tensor, scale: float) -> float:
    """Squared attention error of ``fitted`` kept values over the full output's energy, summed
    over the KV heads (``q [Hq, N, D]``, ``keys``/``values [H, T, D]``)."""
    h = keys.shape[0]
    group = q.shape[0] // h
    err = energy = 0.0
    for j in range(h):
        qj = q[j * group:(j + 1) * group].reshape(-1, q.shape[-1]).float()
        full = torch.softmax(qj @ keys[j].float().T * scale, -1) @ values[j].float()
        kk = keys[j, kept].float() if kept_keys is None else kept_keys[j].float()
        got = torch.softmax(qj @ kk.T * scale, -1) @ fitted[j].float()
        err += float((got - full).pow(2).sum())
        energy += float(full.pow(2).sum())
    return err / energy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        store, doc_id, ids, keys, values = ingested(lm, args.tokens, Path(tmp))
        n_layers = len(keys)
        n = len(ids)
        pick = rf.query_rows(n)
        spacing = (n - 1) / max(len(pick) - 1, 1)
        held = (pick.float() + spacing / 2).round().long().clamp_max(n - 1).unique()
        position = n + rf.QUESTION_OFFSET
        held_q, _ = rf.document_queries(lm, ids, n_layers, position,
                                        raw=rf.cached_queries(lm, ids, keys, values, held))
        real = stage.refit_values
        layer = [0]

        def both(q, k, v, kept, scale, rho, hold=None, kept_keys=None, check=None):
            i = layer[0]
            layer[0] += 1
            new = real(q, k, v, kept, scale, rho, hold, kept_keys, check)
            saved = rf.SPD_MIN
            rf.SPD_MIN = 1 << 30  # every system the full product and LU
            try:
                old = real(q, k, v, kept, scale, rho, hold, kept_keys, check)
            finally:
                rf.SPD_MIN = saved
            plain = v[:, kept].float()
            system = min(int(kept.numel() if hold is None else (~hold).sum()), q.shape[0] // k.shape[0] * q.shape[1])
            row = {"layer": i, "system": system,
                   "apart": float((new - old).norm() / (old - plain).norm().clamp_min(1e-30))}
            for name, qs in (("fit", q), ("held", held_q[i])):
                for sol, vals in (("none", plain), ("lu", old), ("chol", new)):
                    row[f"{name}_{sol}"] = attention_error(qs, k, v, kept, kept_keys, vals, scale)
            rows.append(row)
            print_row(row)
            return new

        compress_watching_refit(store, doc_id, lm, both)
    print(f"\n{n} tokens, {len(rows)} layers; the 0.083 default's refit solved both ways on the same inputs\n")
    print("| query set | no refit | full product + LU | lower blocks + Cholesky | Cholesky / LU (median over layers) |")
    print("|---|---:|---:|---:|---:|")
    for name in ("fit", "held"):
        med = {s: statistics.median(r[f"{name}_{s}"] for r in rows) for s in ("none", "lu", "chol")}
        ratio = statistics.median(r[f"{name}_chol"] / r[f"{name}_lu"] for r in rows)
        print(f"| {name} | {med['none']:.4g} | {med['lu']:.4g} | {med['chol']:.4g} | {ratio:.4f} |")
    worst = max(rows, key=lambda r: r["held_chol"] / r["held_lu"])
    best = min(rows, key=lambda r: r["held_chol"] / r["held_lu"])
    print(f"\nheld-out error Cholesky / LU per layer: {best['held_chol'] / best['held_lu']:.4f} (layer {best['layer']}) "
          f"to {worst['held_chol'] / worst['held_lu']:.4f} (layer {worst['layer']}); the solutions apart by "
          f"{statistics.median(r['apart'] for r in rows):.3g} of the refit's move (median), "
          f"{max(r['apart'] for r in rows):.3g} at most; systems of {min(r['system'] for r in rows)}-"
          f"{max(r['system'] for r in rows)} unknowns")


if __name__ == "__main__":
    main()
