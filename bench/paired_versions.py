"""Paired comparison of two versions in bench/quality.py results: per task, who answers what.

    python bench/paired_versions.py RESULTS.json A B
        per kind: how many each answers, tasks only A / only B answers (exact McNemar p; for
        continuations: tasks where A's / B's NLL is lower, exact sign test) and the mean NLL of A, B, full (``--tasks-of OTHER.json``: only the tasks another run holds;
        ``--also OTHER.json``: the versions of another run of the same tasks too, where its full
        cache agrees task for task; ``--worst N``: the N continuation tasks A loses most on, each
        label's NLL / full there)
    python bench/paired_versions.py RESULTS.json LABEL... --vs-full [--tasks-of OTHER.json] [--also OTHER.json]
        each label against the full cache per answer kind (digits / words / continuation): answers
        of the label and of the full cache with counts, lost, gained, exact McNemar p, median and
        mean per-task NLL ratio; ``--also`` joins a run of the same tasks (its full cache must
        agree), ``--tasks-of`` keeps the tasks another run holds (e.g. those a cut-off run reached),
        ``--by-task-kind`` splits each answer kind into needle and multi-fact rows
    python bench/paired_versions.py NEW.json LABEL --against OLD.json
        LABEL in two deterministic runs on the tasks both hold (the full cache must agree): counts,
        tasks only one run answers (exact McNemar p), identical answers, the largest NLL change
        (``--old-label L``: the old run named that version L, e.g. a ``--label`` given by hand)

The quotes in docs/compression.md of ``research/results/quality-cpu-layers*/`` come from here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def mcnemar(a: int, b: int) -> float:
    n = a + b
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(a, b) + 1)) / 2 ** n) if n else 1.0


def vs_full_table(tasks: list[dict], labels: list[str], *, joined: bool = False, by_task_kind: bool = False) -> str:
    """Markdown: one row per (label, answer kind) of ``label`` against the full cache, over the
    tasks where both answered; ``by_task_kind``: one row per (label, answer kind, task kind)."""
    from kdnctl.evaluation.paired import ANSWER_KIND_HEADER, answer_kind_vs_full
    from kdnctl.evaluation.realtext import ANSWER_KINDS, answer_kind

    kind_of = {t["id"]: t.get("answer_kind") or answer_kind(t["kind"], t.get("answer")) for t in tasks}
    groups = list(ANSWER_KINDS)
    if by_task_kind:
        kind_of = {t["id"]: f"{kind_of[t['id']]} ({t['kind']})" if t["kind"] != "continuation" else "continuation"
                   for t in tasks}
        groups = [f"{a} ({k})" for a in ANSWER_KINDS[:2] for k in ("needle", "multifact")] + ["continuation"]
    by = lambda label: {t["id"]: t["by_version"][label] for t in tasks if label in t["by_version"]}  # noqa: E731
    full = by("full")
    rows = ["| " + " | ".join(ANSWER_KIND_HEADER) + " |", "|---|---" + "|---:" * (len(ANSWER_KIND_HEADER) - 2) + "|"]
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for label in labels:
        res = by(label)
        for kind in groups:
            s = answer_kind_vs_full(res, full, [i for i, k in kind_of.items() if k == kind], kind)
            if not s["n"]:
                continue
            q = "correct" in s
            rows.append(f"| {label} | {kind} | {s['n']} | "
                        + (f"{s['correct']}/{s['n']} ({s['full_correct']}/{s['n']}) | {f(s['accuracy_vs_full'], '.1%')} | "
                           f"{s['lost']}/{s['gained']} ({s['p']:.3f})" if q else "- | - | -")
                        + f" | {f(s['median_nll_ratio'], '.4f')} | {f(s['mean_nll_ratio'], '.4f')} | "
                          f"{s['nll_worse']}/{s['nll_better']} |")
    return "\n".join(rows) + ("\n(runs joined by --also; the full cache agrees task for task)" if joined else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("labels", nargs="+")
    ap.add_argument("--against", default=None)
    ap.add_argument("--tasks-of", default=None, help="another results JSON: only the tasks it holds (before --also joins runs)")
    ap.add_argument("--also", action="append", default=[], help="another run's results JSON of the same tasks")
    ap.add_argument("--old-label", default=None, help="with --against and one label: its label in the old run")
    ap.add_argument("--vs-full", action="store_true", help="each label against the full cache, per answer kind")
    ap.add_argument("--by-task-kind", action="store_true", help="with --vs-full: needle and multi-fact rows apart")
    ap.add_argument("--worst", type=int, default=0, help="print the N continuation tasks A loses most on")
    args = ap.parse_args()
    tasks = json.load(open(args.results))["tasks"]
    if args.tasks_of:
        held = {t["id"] for t in json.load(open(args.tasks_of))["tasks"]}
        tasks = [t for t in tasks if t["id"] in held]
    for other in args.also:
        more = {t["id"]: t for t in json.load(open(other))["tasks"]}
        for t in tasks:
            o = more[t["id"]]["by_version"]
            if abs(o["full"]["nll"] - t["by_version"]["full"]["nll"]) > 1e-3:
                raise SystemExit(f"{other}: the full cache differs on {t['id']}: not the same tasks and model")
            t["by_version"] = {**o, **t["by_version"]}
    if args.vs_full:
        return print(vs_full_table(tasks, args.labels, joined=bool(args.also), by_task_kind=args.by_task_kind))
    if args.worst:
        cont = [t for t in tasks if t["kind"] == "continuation"]
        ratio = {(t["id"], k): t["by_version"][k]["nll"] / t["by_version"]["full"]["nll"] for t in cont for k in args.labels}
        cont.sort(key=lambda t: -ratio[t["id"], args.labels[0]])
        print("continuation NLL / full: " + ", ".join(args.labels))
        for t in cont[:args.worst]:
            print(f"{t['id']} {t.get('source', '')}: " + " ".join(f"{100 * ratio[t['id'], k]:.0f}%" for k in args.labels))
        return
    if args.against is None:
        a_label, b_label = args.labels[:2]
        for kind in ("needle", "multifact", "continuation"):  # continuation tasks have an NLL, no answer
            ts = [t for t in tasks if t["kind"] == kind]
            if not ts:
                continue
            ok = [(bool(t["by_version"][a_label].get("correct")), bool(t["by_version"][b_label].get("correct"))) for t in ts]
            only_a, only_b = sum(a and not b for a, b in ok), sum(b and not a for a, b in ok)
            nll = {k: sum(t["by_version"][k]["nll"] for t in ts) for k in (a_label, b_label, "full")}
            line = f"{kind}, {len(ts)} tasks, {'runs joined by --also' if args.also else 'same run'}: "
            if kind != "continuation":
                line += (f"{a_label} answers {sum(a for a, _ in ok)}, {b_label} {sum(b for _, b in ok)}; "
                         f"only {a_label} answers {only_a}, only {b_label} answers {only_b}, "
                         f"exact McNemar p = {mcnemar(only_a, only_b):.3f}; ")
            if kind == "continuation":  # per task, whose NLL is lower (exact sign test over the tasks that differ)
                lower = [t["by_version"][a_label]["nll"] - t["by_version"][b_label]["nll"] for t in ts]
                a_low, b_low = sum(x < 0 for x in lower), sum(x > 0 for x in lower)
                line += f"{a_label} lower on {a_low}, {b_label} lower on {b_low} (sign test p = {mcnemar(a_low, b_low):.3f}); "
            print(line + f"mean NLL: full {nll['full'] / len(ts):.4f}, " + ", ".join(
                f"{k} {nll[k] / len(ts):.4f} ({nll[k] / nll['full'] * 100:.2f}%)" for k in (a_label, b_label)))
        return
    new = {t["id"]: t for t in tasks}
    old = {t["id"]: t for t in json.load(open(args.against))["tasks"]}
    if args.old_label:
        if len(args.labels) != 1:
            raise SystemExit("--old-label pairs one label with its old name: give one label")
        for t in old.values():  # the old run's name for the version, read as the new one's
            t["by_version"][args.labels[0]] = t["by_version"][args.old_label]
    for label in args.labels:
        for kind in ("needle", "multifact", "continuation"):
            ids = [i for i in new if new[i]["kind"] == kind and i in old]
            if not ids:
                continue
            full_new = sum(new[i]["by_version"]["full"]["nll"] for i in ids)
            full_old = sum(old[i]["by_version"]["full"]["nll"] for i in ids)
            got = [sum(r[i]["by_version"][label]["nll"] for i in ids) / f for r, f in ((new, full_new), (old, full_old))]
            right = [sum(bool(r[i]["by_version"][k].get("correct")) for i in ids)
                     for r, k in ((new, "full"), (new, label), (old, label))]
            ok = [(bool(new[i]["by_version"][label].get("correct")), bool(old[i]["by_version"][label].get("correct"))) for i in ids]
            only_new, only_old = sum(a and not b for a, b in ok), sum(b and not a for a, b in ok)
            same = sum(new[i]["by_version"][label].get("answer") == old[i]["by_version"][label].get("answer") for i in ids)
            moved = max(abs(new[i]["by_version"][label]["nll"] - old[i]["by_version"][label]["nll"]) for i in ids)
            print(f"{label} {kind} n={len(ids)}: full same in both runs {abs(full_new - full_old) < 1e-3}; correct full "
                  f"{right[0]}, new {right[1]}, old {right[2]} (only new {only_new}, only old {only_old}, exact McNemar "
                  f"p = {mcnemar(only_new, only_old):.3f}); NLL/full new {got[0] * 100:.1f}% old {got[1] * 100:.1f}%; "
                  f"identical answer text in {same}/{len(ids)}, answer NLLs at most {moved:.4f} apart")


if __name__ == "__main__":
    main()
