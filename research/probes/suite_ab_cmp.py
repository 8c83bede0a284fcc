"""Compare two bench/suite_timing.py logs of one same-start A/B (bench/suite_ab.sh): per test
file, the seconds each half spent on the tests both ran (setup + call + teardown), the totals
over those common tests, and each half's wall time.

    python bench/suite_ab_cmp.py A.jsonl B.jsonl [--top 25]
"""

import argparse
import json
from collections import defaultdict


def load(path):
    per, start, end, last = defaultdict(float), None, None, None
    for line in open(path):
        r = json.loads(line)
        if "start" in r:
            start = r["start"]
        elif "end" in r:
            end = r["end"]
        else:
            per[r["id"]] += r["s"]
            last = r["t"]
    return per, start, end, last


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    A, a0, a1, al = load(args.a)
    B, b0, b1, bl = load(args.b)
    common = set(A) & set(B)
    mods = defaultdict(lambda: [0.0, 0.0])
    for t in common:
        m = t.split("::")[0]
        mods[m][0] += A[t]
        mods[m][1] += B[t]
    rows = sorted(mods.items(), key=lambda kv: -abs(kv[1][0] - kv[1][1]))
    for m, (x, y) in rows[: args.top]:
        print(f"{m:45s} A {x:8.1f}  B {y:8.1f}  B-A {y - x:+8.1f}  B/A {y / x if x else float('nan'):.2f}")
    sa, sb = sum(v[0] for v in mods.values()), sum(v[1] for v in mods.values())
    print(f"common tests {len(common)} (A ran {len(A)}, B ran {len(B)}): A {sa:.0f} s, B {sb:.0f} s, B/A {sb / sa:.3f}")
    wa = f"{a1 - a0:.0f} s (done)" if a1 else f"{al - a0:.0f} s so far"
    wb = f"{b1 - b0:.0f} s (done)" if b1 else f"{bl - b0:.0f} s so far"
    ratio = f"; B/A wall {(b1 - b0) / (a1 - a0):.3f}" if a1 and b1 else ""
    print(f"A wall {wa}; B wall {wb}{ratio}")


if __name__ == "__main__":
    main()
