"""bench/quality.py's run control: tasks interleaved by kind, each task's document ingested and
compressed right before it is evaluated (--per-task), and a deadline that stops the run after a
whole task with the results JSON already written (real model, real store, one task)."""

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO

SET = REPO / "examples" / "eval" / "realtext.jsonl"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_quality", REPO / "bench" / "quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_interleave_keeps_every_prefix_in_proportion():
    tasks = ([SimpleNamespace(id=f"n{i}", kind="needle") for i in range(6)]
             + [SimpleNamespace(id=f"m{i}", kind="multifact") for i in range(4)]
             + [SimpleNamespace(id=f"c{i}", kind="continuation") for i in range(2)])
    out = _bench().interleave(tasks)
    assert sorted(t.id for t in out) == sorted(t.id for t in tasks)
    for kind in ("needle", "multifact", "continuation"):  # each kind keeps its own order
        ids = [t.id for t in out if t.kind == kind]
        assert ids == sorted(ids, key=lambda x: int(x[1:]))
    for n in (3, 6, 12):
        prefix = [t.kind for t in out[:n]]
        assert abs(prefix.count("needle") - n * 6 / 12) <= 1 and abs(prefix.count("multifact") - n * 4 / 12) <= 1


def test_per_task_run_stops_at_the_deadline_with_results_written(tmp_path):
    recs = [json.loads(l) for l in SET.read_text(encoding="utf-8").splitlines() if l.strip()]
    picked = [next(r for r in recs if r["kind"] == k) for k in ("needle", "continuation")]
    subset = tmp_path / "tasks.jsonl"
    subset.write_text("".join(json.dumps(r) + "\n" for r in picked))
    out = tmp_path / "q.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "quality.py"), "--store", str(tmp_path / "kdn"),
                          "--tasks", str(subset), "--no-default-recipes", "--recipe", "--budget 1 --quant int8",
                          "--per-task", "--interleave", "--deadline", "+0", "--out", str(out)],
                         capture_output=True, text=True, cwd=REPO, timeout=1800)
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert result["n_tasks"] == 1 and result["per_task"] and len(result["tasks"]) == 1  # stopped after one task
    by = {v["label"]: v for v in result["versions"]}
    assert set(by) == {"full", "int8-b1"}
    assert by["int8-b1"]["n_tasks"] == by["full"]["n_tasks"] == 1
    assert 0.4 < by["int8-b1"]["fp16_fraction"] < 0.6
    assert "stopped after 1 of 2 tasks" in res.stderr
    kind = result["tasks"][0]["answer_kind"]  # the paired table per answer kind, one row per kind evaluated
    assert kind == {"needle": "digits", "continuation": "continuation"}[result["tasks"][0]["kind"]]
    assert f"| int8-b1 | {kind} | 1 | " in res.stdout and set(by["int8-b1"]["by_answer_kind"]) == {kind}
    from kdnctl.store import Store

    st = Store(tmp_path / "kdn", create=False)
    try:  # the second task's document was never ingested (nor compressed)
        assert [d.doc_id for d in st.list_documents()] == [result["tasks"][0]["id"]]
    finally:
        st.close()
    rec = {r["recipe"]: r for r in result["recipes"]}["--budget 1 --quant int8"]
    assert rec["label"] == "int8-b1" and rec["statuses"] == ["compressed"]


def test_merged_shards_score_like_one_run():
    """Shards of one run, merged, give the same scores, ratios and byte fractions as the whole
    set scored at once (per-task records pooled, nothing averaged twice)."""
    from kdnctl.evaluation.tasks import Task, _result, merge_results

    tasks = [Task(id=f"t{i}", kind=("needle", "multifact", "continuation")[i % 3], text="", answer=str(i))
             for i in range(11)]
    labels = ["full", "x"]

    def rec(t, label):
        if t.kind == "continuation":
            return {"nll": 2.0 + 0.1 * int(t.answer) + (0.3 if label == "x" else 0)}
        return {"answer": "a", "correct": (int(t.answer) + (label == "x")) % 2 == 0, "distracted": False,
                "nll": 1.0 + 0.05 * int(t.answer)}

    def run(ts):
        results = {l: {t.id: rec(t, l) for t in ts} for l in labels}
        sizes = {l: {"stored": 1000 * len(ts) * (1 if l == "full" else 0.25), "kv": 900 * len(ts), "tokens": 10 * len(ts),
                     "seconds": 0.5 * len(ts), "recipe": {"step": l}} for l in labels}
        return _result(labels, results, sizes, ts, 100)

    whole = run(tasks)
    merged = merge_results([run(tasks[0::3]), run(tasks[1::3]), run(tasks[2::3])], order=[t.id for t in tasks])
    assert [t["id"] for t in merged["tasks"]] == [t.id for t in tasks]
    assert merged["versions"] == whole["versions"]
    assert merged["versions"][1]["ratio_vs_full"]["continuation"] > 1  # not trivially equal
    with pytest.raises(ValueError, match="more than one part"):
        merge_results([run(tasks[:3]), run(tasks[2:5])])
