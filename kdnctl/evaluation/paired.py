"""Paired comparison of one version against the full cache on the same tasks.

Every version answers the same tasks as the full cache, so the honest question is paired: on how
many tasks did the compressed version lose an answer the full cache got ("lost") and gain one it
missed ("gained")? Whether a difference of a few answers is more than chance is the exact
McNemar test on those discordant pairs (a two-sided binomial test at 1/2); how far a ratio such
as "multi-fact accuracy / full" can be trusted is a paired bootstrap interval (tasks resampled
together for both versions). With 40 tasks a ratio of 90% can sit in an interval as wide as
70-110%: the interval is printed so nobody reads a 2-answer gap as a verdict.

Each statistic has a naive reference beside it (enumeration, a plain loop) that the tests
compare against.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 14  # fixed: the same results file always prints the same interval


def mcnemar_p(lost: int, gained: int) -> float:
    """Exact two-sided McNemar p-value: P(a split of the ``lost + gained`` discordant tasks at
    least this uneven | either version is equally likely to win each one)."""
    n = lost + gained
    if n == 0:
        return 1.0
    k = min(lost, gained)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def naive_mcnemar_p(lost: int, gained: int) -> float:
    """Reference: enumerate every win/lose assignment of the discordant tasks and count those
    whose split is at least as far from even as the observed one."""
    n = lost + gained
    observed = abs(lost - n / 2)
    extreme = sum(1 for signs in itertools.product((0, 1), repeat=n) if abs(sum(signs) - n / 2) >= observed)
    return extreme / 2**n


def _resample_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_ratio_ci(mine: list[float], ref: list[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> tuple[float, float] | None:
    """Percentile interval of mean(mine) / mean(ref) with tasks resampled in pairs; resamples
    whose reference mean is 0 (no full-cache answer drawn) have no ratio and are left out."""
    if len(mine) != len(ref):
        raise ValueError("paired samples differ in length")
    if not mine:
        return None
    a, b = np.asarray(mine, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    idx = _resample_indices(len(a), resamples, seed)
    num, den = a[idx].mean(axis=1), b[idx].mean(axis=1)
    ok = den != 0
    if not ok.any():
        return None
    ratios = num[ok] / den[ok]
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(lo), float(hi)


def naive_bootstrap_ratio_ci(mine: list[float], ref: list[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                             seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> tuple[float, float] | None:
    """Reference: the same resamples, one at a time in plain Python, and a sorted-list percentile
    (linear interpolation between order statistics, as numpy's default)."""
    idx = _resample_indices(len(mine), resamples, seed).tolist() if mine else []
    ratios = []
    for row in idx:
        den = sum(ref[i] for i in row) / len(row)
        if den != 0:
            ratios.append((sum(mine[i] for i in row) / len(row)) / den)
    if not ratios:
        return None
    ratios.sort()

    def pct(q: float) -> float:
        pos = q / 100 * (len(ratios) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ratios) - 1)
        return ratios[lo] + (ratios[hi] - ratios[lo]) * (pos - lo)

    tail = (1 - level) / 2 * 100
    return pct(tail), pct(100 - tail)


def paired_vs_full(res: dict[str, dict], full: dict[str, dict], ids: list[str], kind: str) -> dict:
    """Paired statistics of one version against the full cache over ``ids`` (tasks both answered):
    for question kinds lost/gained answers, McNemar p, and intervals of the accuracy ratio and
    of the answer-NLL ratio; for continuation the interval of the NLL ratio."""
    ids = [i for i in ids if i in res and i in full]
    out: dict = {"n": len(ids)}
    if not ids:
        return out
    _round = lambda ci: None if ci is None else [round(ci[0], 4), round(ci[1], 4)]  # noqa: E731
    nll_ci = bootstrap_ratio_ci([res[i]["nll"] for i in ids], [full[i]["nll"] for i in ids])
    if kind == "continuation":
        out["nll_ratio_ci"] = _round(nll_ci)
        return out
    mine = [float(res[i]["correct"]) for i in ids]
    ref = [float(full[i]["correct"]) for i in ids]
    lost = sum(1 for m, r in zip(mine, ref) if r and not m)
    gained = sum(1 for m, r in zip(mine, ref) if m and not r)
    out.update({"lost": lost, "gained": gained, "p": round(mcnemar_p(lost, gained), 4),
                "accuracy_ratio_ci": _round(bootstrap_ratio_ci(mine, ref)), "answer_nll_ratio_ci": _round(nll_ci)})
    return out


def median(xs: list[float]) -> float | None:
    """The middle value (the mean of the two middle ones for an even count); None when empty."""
    if not xs:
        return None
    ys = sorted(xs)
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2


def answer_kind_vs_full(res: dict[str, dict], full: dict[str, dict], ids: list[str], kind: str) -> dict:
    """One version against the full cache over the tasks ``ids`` of one answer kind (``digits``,
    ``words`` or ``continuation``): how many each answers (with the count), answers lost and
    gained, McNemar p, and the per-task NLL ratio version / full (its median, the mean NLL ratio,
    and on how many tasks the NLL is higher). The NLL is the answer's, teacher-forced, or the
    continuation's."""
    ids = [i for i in ids if i in res and i in full]
    out: dict = {"n": len(ids)}
    if not ids:
        return out
    ratios = [res[i]["nll"] / full[i]["nll"] for i in ids if full[i]["nll"] > 0]
    out.update({"median_nll_ratio": round(median(ratios), 4) if ratios else None,
                "mean_nll_ratio": round(sum(res[i]["nll"] for i in ids) / sum(full[i]["nll"] for i in ids), 4)
                if sum(full[i]["nll"] for i in ids) > 0 else None,
                "nll_worse": sum(res[i]["nll"] > full[i]["nll"] for i in ids),
                "nll_better": sum(res[i]["nll"] < full[i]["nll"] for i in ids)})
    if kind == "continuation":
        return out
    mine = [bool(res[i].get("correct")) for i in ids]
    ref = [bool(full[i].get("correct")) for i in ids]
    lost = sum(r and not m for m, r in zip(mine, ref))
    gained = sum(m and not r for m, r in zip(mine, ref))
    out.update({"correct": sum(mine), "full_correct": sum(ref),
                "accuracy_vs_full": round(sum(mine) / sum(ref), 4) if sum(ref) else None,
                "lost": lost, "gained": gained, "p": round(mcnemar_p(lost, gained), 4)})
    return out


ANSWER_KIND_HEADER = ("version", "answer kind", "n", "correct (full)", "accuracy / full", "lost/gained (McNemar p)",
                      "median NLL / full", "mean NLL / full", "NLL worse/better (tasks)")


def answer_kind_rows(result: dict) -> list[tuple[str, ...]]:
    """Text cells, one row per (compressed version, answer kind) of an ``evaluate_tasks``
    result, in ``ANSWER_KIND_HEADER`` order; every accuracy carries its counts."""
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    rows = []
    for v in result["versions"]:
        if v["label"] == "full":
            continue
        for kind, s in (v.get("by_answer_kind") or {}).items():
            if not s.get("n"):
                continue
            has_answers = "correct" in s
            rows.append((v["label"], kind, str(s["n"]),
                         f"{s['correct']}/{s['n']} ({s['full_correct']}/{s['n']})" if has_answers else "-",
                         f(s.get("accuracy_vs_full"), ".1%") if has_answers else "-",
                         f"{s['lost']}/{s['gained']} ({s['p']:.3f})" if has_answers else "-",
                         f(s.get("median_nll_ratio"), ".4f"), f(s.get("mean_nll_ratio"), ".4f"),
                         f"{s['nll_worse']}/{s['nll_better']}"))
    return rows


def answer_kind_markdown(result: dict, names: dict[str, str] | None = None) -> str:
    rows = ["| " + " | ".join(ANSWER_KIND_HEADER) + " |", "|---|---" + "|---:" * (len(ANSWER_KIND_HEADER) - 2) + "|"]
    rows += ["| " + " | ".join(((names or {}).get(r[0], r[0]),) + r[1:]) + " |" for r in answer_kind_rows(result)]
    return "\n".join(rows)


PAIRED_HEADER = ("version", "needle lost/gained (p)", "needle / full, 95% CI", "multi-fact lost/gained (p)",
                 "multi-fact / full, 95% CI", "fact answer NLL / full, 95% CI", "NLL / full, 95% CI")


def paired_rows(result: dict) -> list[tuple[str, ...]]:
    """One row of text cells per compressed version of an ``evaluate_tasks`` result (the full
    cache is the baseline, so it has none), in ``PAIRED_HEADER`` order."""
    def counts(s: dict) -> str:
        return "-" if "lost" not in s else f"{s['lost']}/{s['gained']} ({s['p']:.2f})"

    def ci(s: dict, key: str) -> str:
        v = s.get(key)
        return "-" if v is None else f"{v[0]:.1%}-{v[1]:.1%}"

    rows = []
    for v in result["versions"]:
        p = v.get("paired_vs_full")
        if not p:
            continue
        n, m, c = p.get("needle", {}), p.get("multifact", {}), p.get("continuation", {})
        rows.append((v["label"], counts(n), ci(n, "accuracy_ratio_ci"), counts(m), ci(m, "accuracy_ratio_ci"),
                     ci(m, "answer_nll_ratio_ci"), ci(c, "nll_ratio_ci")))
    return rows


def paired_markdown(result: dict, names: dict[str, str] | None = None) -> str:
    rows = ["| " + " | ".join(PAIRED_HEADER) + " |", "|---" + "|---:" * (len(PAIRED_HEADER) - 1) + "|"]
    rows += ["| " + " | ".join(((names or {}).get(r[0], r[0]),) + r[1:]) + " |" for r in paired_rows(result)]
    return "\n".join(rows)


def paired_text(result: dict) -> str:
    widths = [max(len(h), 30 if i == 0 else 0) for i, h in enumerate(PAIRED_HEADER)]
    rows = [PAIRED_HEADER] + paired_rows(result)
    return "\n".join(" ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)
