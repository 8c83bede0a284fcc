"""The word-answer evaluation set (examples/eval/realtext-words.jsonl), its generator, the
tune/report halves, the word scorer and the per-answer-kind paired report."""

import hashlib
import json
import random
import re
import statistics
from collections import Counter

import pytest

from conftest import REPO
from kdnctl.errors import UsageError
from kdnctl.evaluation import realtext
from kdnctl.evaluation.paired import answer_kind_markdown, answer_kind_vs_full, mcnemar_p, median
from kdnctl.evaluation.tasks import Task, _result, answer_in, load_tasks, merge_results, words_in

WORDS_SET = REPO / "examples" / "eval" / "realtext-words.jsonl"
OTHER_SETS = [REPO / "examples" / "eval" / f"{n}.jsonl" for n in ("realtext", "realtext-multifact", "realtext-continuation")]


def records(path=WORDS_SET):
    return [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]


def whole_word_count(text: str, word: str) -> int:
    return len(re.findall(rf"(?<![^\W_]){re.escape(word.lower())}(?![^\W_])", text.lower()))


# --------------------------------------------------------------------------- committed set


def test_committed_word_set_counts_halves_and_meta():
    recs = records()
    assert Counter(r["kind"] for r in recs) == {"needle": 60, "multifact": 60}
    assert {r["answer_kind"] for r in recs} == {"words"}
    assert Counter((r["kind"], r["split"]) for r in recs) == {(k, s): 30 for k in ("needle", "multifact")
                                                               for s in ("tune", "report")}
    assert len({r["id"] for r in recs}) == len(recs) and all(r["id"].startswith("realtext-words/") for r in recs)
    assert len({r["source"] for r in recs}) == len(recs), "one man page per task"
    meta = json.loads(WORDS_SET.with_name("realtext-words.meta.json").read_text())
    assert meta["sha256"] == hashlib.sha256(WORDS_SET.read_bytes()).hexdigest(), "regenerate with bench/make_eval_set.py"
    assert meta["splits"] == {"tune": 60, "report": 60} and meta["answer_kinds"] == {"words": 120}


def test_word_set_shares_no_page_family_with_the_other_sets():
    mine = {realtext.page_family(r["source"]) for r in records()}
    for other in OTHER_SETS:
        assert not mine & {realtext.page_family(r["source"]) for r in records(other)}, other.name


def test_word_answers_are_planted_once_and_asked_after_the_context():
    for r in records():
        text, q, a = r["text"], r["question"], r["answer"]
        assert not re.search(r"\d", a) and len(a.split()) == 1, r["id"]
        assert q not in text and a.lower() not in q.lower(), r["id"]
        assert whole_word_count(text, a) == 1, r["id"]  # the answer is in the context exactly once
        for s in r["planted"]:
            assert text.count(s) == 1 and f"\n{s}\n" in text, r["id"]
        asked = next(s for s in r["planted"] if whole_word_count(s, a))
        assert asked.startswith(r["answer_lead"] + " ") and asked.endswith(f" {a}."), r["id"]
        if r["kind"] == "needle":
            assert len(r["planted"]) == 1
        else:
            values = [a, *r["distractors"]]
            assert 2 <= len(values) <= 3 and len(set(values)) == len(values) == len(r["planted"])
            assert all(whole_word_count(text, v) == 1 for v in values), r["id"]
            name = re.search(r"the (\w+) (team|group|project|office)", asked, re.I).group(1)
            assert name in q and name in r["answer_lead"], r["id"]


def test_word_set_token_counts(lm):
    recs = records()
    for r in recs:
        assert len(lm.tokenizer(r["text"], add_special_tokens=False).input_ids) == r["context_tokens"], r["id"]
        assert 500 <= r["context_tokens"] <= 2100, r["id"]  # 500-2000 of page text, plus the planted lines
    assert statistics.mean(r["context_tokens"] for r in recs) > 800


# --------------------------------------------------------------------------- halves and kinds


def test_load_tasks_by_split_and_answer_kind():
    report = load_tasks("realtext-words", split="report")
    tune = load_tasks("realtext-words", split="tune")
    assert len(report) == len(tune) == 60 and not {t.id for t in report} & {t.id for t in tune}
    assert {t.answer_kind for t in report} == {"words"} and all(t.answer_lead for t in report)
    # a file written before the halves gets them by the generator's rule, per kind and in file order
    old = load_tasks("realtext")
    assert Counter((t.kind, t.split) for t in old) == {("needle", "tune"): 30, ("needle", "report"): 30,
                                                       ("multifact", "tune"): 20, ("multifact", "report"): 20,
                                                       ("continuation", "tune"): 15, ("continuation", "report"): 15}
    assert [t.split for t in old if t.kind == "needle"][:4] == ["tune", "report", "tune", "report"]
    assert Counter(t.answer_kind for t in old) == {"digits": 100, "continuation": 30}
    assert [t.id for t in load_tasks("realtext", answer_kinds=["continuation"], split="report")] == \
        [t.id for t in old if t.kind == "continuation" and t.split == "report"]
    with pytest.raises(UsageError):
        load_tasks("realtext-words", split="test")
    with pytest.raises(UsageError):
        load_tasks("realtext-words", answer_kinds=["letters"])


def test_answer_kind_and_splits_rule():
    assert realtext.answer_kind("needle", "48213") == "digits"
    assert realtext.answer_kind("multifact", "Lisbon") == "words"
    assert realtext.answer_kind("needle", "A7") == "words"
    assert realtext.answer_kind("continuation", None) == "continuation"
    tasks = [{"kind": k, "answer": a} for k, a in [("needle", "1"), ("needle", "x"), ("needle", "2"),
                                                    ("multifact", "y"), ("needle", "3"), ("needle", "z")]]
    halves = [t["split"] for t in realtext.assign_splits(tasks)]
    # each (kind, answer kind) alternates on its own: digits 1,2,3; words x,z; multifact y
    assert halves == ["tune", "tune", "report", "tune", "tune", "report"]


@pytest.mark.parametrize("answer,value,ok", [
    ("The mascot of this program is a parrot.", "parrot", True),
    ("PARROT", "parrot", True),
    ("parrots.", "parrot", False),
    ("a sparrow", "parrot", False),
    ("Parisian", "Paris", False),
    ("born in new  york.", "New York", True),
    ("new-york", "New York", True),
    ("new_york", "New York", True),
    ("newyork", "New York", False),
    ("", "Paris", False),
    ("snake_case", "case", False),
])
def test_words_in(answer, value, ok):
    assert words_in(answer, value) is ok


def test_answer_in_picks_the_scorer_by_kind():
    assert answer_in("code 48,213", "48213", "digits") and not answer_in("code 48,213", "48213", "words")
    assert answer_in("Oslo.", "Oslo", "words")


# --------------------------------------------------------------------------- generator


@pytest.fixture(scope="module")
def page_and_offsets(lm):
    tok = lm.tokenizer
    body = "".join(f"The option --flag{i} sets parameter {i} of the program; see the paris manual.\n" for i in range(300))
    offsets = lambda t: [tuple(o) for o in tok(t, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]  # noqa: E731
    return realtext.Page("man1/fake.1.gz", body), offsets


def test_word_tasks_are_deterministic_and_well_formed(page_and_offsets):
    page, offsets = page_and_offsets
    for seed in range(6):
        a = realtext.word_needle_task("n", page, random.Random(seed), offsets, 600)
        assert a == realtext.word_needle_task("n", page, random.Random(seed), offsets, 600)
        assert a["answer"] != "Paris" and whole_word_count(a["text"], a["answer"]) == 1  # "paris" is in the page
        assert a["planted"][0] == f"{a['answer_lead']} {a['answer']}."
        m = realtext.word_fact_task("m", page, random.Random(seed), offsets, 800)
        values = [m["answer"], *m["distractors"]]
        assert len(set(values)) == len(values) and "Paris" not in values
        assert all(m["text"].count(s) == 1 for s in m["planted"])
        assert f"{m['answer_lead']} {m['answer']}." in m["planted"]


def test_fresh_word_avoids_the_text_and_taken_words():
    rng = random.Random(0)
    vocab = ["Paris", "Oslo", "Rome", "Lima"]
    got = {realtext.fresh_word(rng, vocab, "trips to PARIS and rome", {"Oslo"}) for _ in range(20)}
    assert got == {"Lima"}
    with pytest.raises(ValueError):
        realtext.fresh_word(rng, vocab, "paris oslo rome lima", set())


def test_vocabularies_hold_no_digit_and_no_fact_name():
    words = [w for ws in realtext.WORDS.values() for w in ws]
    assert len(words) == len(set(w.lower() for w in words)) and not any(re.search(r"\d", w) for w in words)
    assert not {w.lower() for w in words} & set(realtext.NAMES)
    for template, _question, vocab in realtext.WORD_NEEDLE_TEMPLATES + realtext.WORD_FACT_TEMPLATES:
        assert vocab in realtext.WORDS and len(realtext.WORDS[vocab]) >= 20 and template.endswith("{w}.")


# --------------------------------------------------------------------------- per answer kind, paired


def naive_answer_kind(res, full, ids):
    """Reference: one pass per statistic, plain loops."""
    lost = gained = worse = 0
    for i in ids:
        lost += full[i]["correct"] and not res[i]["correct"]
        gained += res[i]["correct"] and not full[i]["correct"]
        worse += res[i]["nll"] > full[i]["nll"]
    ratios = sorted(res[i]["nll"] / full[i]["nll"] for i in ids)
    n = len(ratios)
    med = ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2
    return lost, gained, worse, med


@pytest.mark.parametrize("n", [1, 2, 7, 20])
def test_answer_kind_vs_full_matches_reference(n):
    rng = random.Random(n)
    ids = [f"t{i}" for i in range(n)]
    full = {i: {"correct": rng.random() < 0.8, "nll": rng.uniform(0.05, 3)} for i in ids}
    res = {i: {"correct": rng.random() < 0.7, "nll": full[i]["nll"] * rng.uniform(0.8, 1.5)} for i in ids}
    s = answer_kind_vs_full(res, full, ids, "words")
    lost, gained, worse, med = naive_answer_kind(res, full, ids)
    assert (s["lost"], s["gained"], s["nll_worse"]) == (lost, gained, worse)
    assert s["median_nll_ratio"] == pytest.approx(med, abs=1e-4)
    assert s["p"] == pytest.approx(mcnemar_p(lost, gained), abs=1e-4)
    assert s["correct"] == sum(r["correct"] for r in res.values()) and s["full_correct"] == sum(r["correct"] for r in full.values())
    c = answer_kind_vs_full(res, full, ids, "continuation")
    assert "lost" not in c and c["median_nll_ratio"] == s["median_nll_ratio"]


def test_median():
    assert median([]) is None and median([3.0]) == 3.0 and median([4.0, 1.0, 2.0]) == 2.0 and median([1.0, 4.0]) == 2.5


def test_results_carry_answer_kinds_and_merge_keeps_them():
    kinds = [("needle", "48213"), ("needle", "parrot"), ("multifact", "Oslo"), ("continuation", None),
             ("multifact", "7310"), ("needle", "Emma")]
    tasks = [Task(id=f"t{i}", kind=k, text="", answer=a, split=("tune", "report")[i % 2]) for i, (k, a) in enumerate(kinds)]
    labels = ["full", "b0.25"]

    def rec(t, label):
        if t.kind == "continuation":
            return {"nll": 2.0 + (0.1 if label != "full" else 0)}
        lose = label != "full" and t.answer == "parrot"  # the compressed version loses one word answer
        return {"answer": "", "correct": not lose, "distracted": False, "nll": 0.5 * (1.4 if lose else 1.0)}

    def run(ts):
        results = {l: {t.id: rec(t, l) for t in ts} for l in labels}
        sizes = {l: {"stored": 100 * len(ts), "kv": 90 * len(ts), "tokens": 10 * len(ts), "seconds": 0.5 * len(ts),
                     "recipe": {}}
                 for l in labels}
        return _result(labels, results, sizes, ts, 100)

    whole = run(tasks)
    assert {t["id"]: t["answer_kind"] for t in whole["tasks"]} == {
        "t0": "digits", "t1": "words", "t2": "words", "t3": "continuation", "t4": "digits", "t5": "words"}
    by = whole["versions"][1]["by_answer_kind"]
    assert by["digits"] == {**by["digits"], "n": 2, "correct": 2, "full_correct": 2, "lost": 0, "gained": 0}
    assert (by["words"]["n"], by["words"]["correct"], by["words"]["full_correct"], by["words"]["lost"]) == (3, 2, 3, 1)
    assert by["words"]["median_nll_ratio"] == 1.0 and by["words"]["nll_worse"] == 1
    assert by["continuation"]["median_nll_ratio"] == pytest.approx(1.05)
    merged = merge_results([run(tasks[0::2]), run(tasks[1::2])], order=[t.id for t in tasks])
    assert merged["versions"] == whole["versions"] and whole["versions"][0]["by_answer_kind"] == {}
    assert [t["split"] for t in merged["tasks"]] == [t.split for t in tasks]
    table = answer_kind_markdown(whole)
    assert "| b0.25 | words | 3 | 2/3 (3/3) | 66.7% | 1/0 (1.000) |" in table
    assert "| b0.25 | continuation | 1 | - | - | - |" in table and "| full |" not in table


def test_paired_versions_vs_full_per_answer_kind(tmp_path):
    """bench/paired_versions.py --vs-full: rows per answer kind (and task kind), counts beside
    every accuracy, a second run joined by --also only where its full cache agrees."""
    import subprocess
    import sys

    def task(i, kind, answer, full_ok, ok, nll, label="b0.25"):
        return {"id": f"t{i}", "kind": kind, "answer": answer,
                "by_version": {"full": {"correct": full_ok, "nll": 1.0}, label: {"correct": ok, "nll": nll}}}

    a = {"tasks": [task(0, "needle", "parrot", True, False, 1.5), task(1, "multifact", "Oslo", True, True, 0.9),
                   task(2, "needle", "48213", True, True, 1.0), task(3, "needle", "Emma", False, True, 1.1)]}
    b = {"tasks": [task(i, t["kind"], t["answer"], True, True, 1.2, label="b0.083") for i, t in enumerate(a["tasks"][:2])]}
    for name, data in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(data))
    script = [sys.executable, str(REPO / "bench" / "paired_versions.py")]
    out = subprocess.run(script + [str(tmp_path / "a.json"), "b0.25", "--vs-full"], capture_output=True, text=True, check=True).stdout
    assert "| b0.25 | words | 3 | 2/3 (2/3) | 100.0% | 1/1 (1.000) | 1.1000 | 1.1667 | 2/1 |" in out
    assert "| b0.25 | digits | 1 | 1/1 (1/1) | 100.0% | 0/0 (1.000) | 1.0000 |" in out
    out = subprocess.run(script + [str(tmp_path / "a.json"), "b0.25", "b0.083", "--vs-full", "--by-task-kind",
                                   "--tasks-of", str(tmp_path / "b.json"), "--also", str(tmp_path / "b.json")],
                         capture_output=True, text=True, check=True).stdout
    assert "| b0.083 | words (needle) | 1 | 1/1 (1/1) |" in out and "| b0.25 | words (multifact) | 1 | 1/1 (1/1) |" in out
    assert "digits" not in out and "joined by --also" in out
    b["tasks"][0]["by_version"]["full"]["nll"] = 2.0
    (tmp_path / "b.json").write_text(json.dumps(b))
    bad = subprocess.run(script + [str(tmp_path / "a.json"), "b0.25", "--vs-full", "--also", str(tmp_path / "b.json")],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "full cache differs" in bad.stderr
