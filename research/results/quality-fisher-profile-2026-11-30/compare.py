"""Task by task: NEW.json OLD.json NEW_LABEL OLD_LABEL -> how many answer texts are the same, and each task right in one run only."""
import json, sys
new=json.load(open(sys.argv[1])); old=json.load(open(sys.argv[2])); nl, ol = sys.argv[3], sys.argv[4]
O={t["id"]:t for t in old["tasks"]}
same=0; n=0; diff=[]
for t in new["tasks"]:
    o=O.get(t["id"]); 
    if o is None or ol not in o["by_version"]: continue
    a=t["by_version"][nl]; b=o["by_version"][ol]; f=t["by_version"]["full"]
    n+=1; same+= a.get("answer")==b.get("answer")
    if a.get("correct")!=b.get("correct"):
        diff.append((t["id"], "now" if a.get("correct") else "before", f"nll now {a['nll']:.3f} before {b['nll']:.3f} full {f['nll']:.3f}", str(a.get("answer"))[:80], "|", t.get("answer")))
print(f"same answer text {same}/{n}")
for d in diff: print(*d)
