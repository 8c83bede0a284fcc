"""Task by task, one version's answer NLL against another's in a results file: lower / higher and
the two-sided sign test.   python paired.py RESULTS.json A B"""
import json
import math
import sys

r = json.load(open(sys.argv[1]))
a, b = sys.argv[2], sys.argv[3]
lo = hi = 0
for t in r["tasks"]:
    x, y = t["by_version"][a]["nll"], t["by_version"][b]["nll"]
    lo += x < y
    hi += x > y
n, k = lo + hi, min(lo, hi)
p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)
print(f"{a} against {b} on {len(r['tasks'])} tasks: answer NLL lower on {lo}, higher on {hi} (sign p = {p:.3g})")
