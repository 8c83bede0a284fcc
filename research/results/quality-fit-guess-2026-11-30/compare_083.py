"""The 0.083 default now against its run at the last stop, on the tasks both hold (per version its own run's full cache).

    python research/results/quality-fit-guess-2026-11-30/compare_083.py research/results/quality-fit-guess-2026-11-30/words083.json
"""
import json, statistics, sys
new = json.load(open(sys.argv[1]))
old = json.load(open(str(__import__("pathlib").Path(__file__).resolve().parents[1] / "words-083-lift-union" / "report.json")))
ot = {t["id"]: t for t in old["tasks"]}
rows = []
for t in new["tasks"]:
    o = ot[t["id"]]
    nb, nf = t["by_version"]["b0.083"], t["by_version"]["full"]
    ob, of = o["by_version"]["b0.083-lift-union"], o["by_version"]["full"]
    rows.append((t["id"], nf["correct"], nb["correct"], ob["correct"], nb["nll"] / nf["nll"], ob["nll"] / of["nll"], nb["answer"] == ob["answer"], nf["nll"] == of["nll"]))
print(len(rows), "full", sum(r[1] for r in rows), "new", sum(r[2] for r in rows), "old", sum(r[3] for r in rows),
      "only new", sum(r[2] and not r[3] for r in rows), "only old", sum(r[3] and not r[2] for r in rows))
print("median ratio new", round(statistics.median(r[4] for r in rows), 4), "old", round(statistics.median(r[5] for r in rows), 4),
      "new lower", sum(r[4] < r[5] for r in rows), "higher", sum(r[4] > r[5] for r in rows))
print("same answer text", sum(r[6] for r in rows), "full nll same", sum(r[7] for r in rows))
