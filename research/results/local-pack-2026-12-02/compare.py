"""Task by task against an earlier run: NEW.json OLD.json NEW_LABEL OLD_LABEL -> on the tasks both ran,
each run's answers right against its own full cache's, the same answer text, the answers right in
one run only, and the per-task answer (or continuation) NLL ratio to the run's full cache."""
import json
import statistics
import sys

new, old = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
nl, ol = sys.argv[3], sys.argv[4]
O = {t["id"]: t for t in old["tasks"]}
rows = []
for t in new["tasks"]:
    o = O.get(t["id"])
    if o is None or ol not in o["by_version"] or nl not in t["by_version"]:
        continue
    rows.append((t, o))
print(f"{len(rows)} tasks in both runs ({sys.argv[1]} {nl} / {sys.argv[2]} {ol})\n")
print("| kind | n | right now (full now) | right before (full before) | same answer text | right now only | right before only "
      "| median NLL / full, now | before | now lower / higher NLL ratio |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for kind in sorted({t["kind"] for t, _ in rows}):
    rs = [(t, o) for t, o in rows if t["kind"] == kind]
    a = lambda t, lab, key="correct": t["by_version"][lab].get(key)  # noqa: E731
    rn = sum(bool(a(t, nl)) for t, _ in rs)
    ro = sum(bool(a(o, ol)) for _, o in rs)
    fn = sum(bool(a(t, "full")) for t, _ in rs)
    fo = sum(bool(a(o, "full")) for _, o in rs)
    same = sum(a(t, nl, "answer") == a(o, ol, "answer") for t, o in rs)
    now_only = sum(bool(a(t, nl)) and not a(o, ol) for t, o in rs)
    before_only = sum(bool(a(o, ol)) and not a(t, nl) for t, o in rs)
    rn_ = [a(t, nl, "nll") / a(t, "full", "nll") for t, _ in rs]
    ro_ = [a(o, ol, "nll") / a(o, "full", "nll") for _, o in rs]
    lower = sum(x < y for x, y in zip(rn_, ro_))
    higher = sum(x > y for x, y in zip(rn_, ro_))
    c = kind == "continuation"
    print(f"| {kind} | {len(rs)} | {'-' if c else f'{rn} ({fn})'} | {'-' if c else f'{ro} ({fo})'} | {'-' if c else same} | "
          f"{'-' if c else now_only} | {'-' if c else before_only} | {statistics.median(rn_):.4f} | {statistics.median(ro_):.4f} | "
          f"{lower} / {higher} |")
