"""The real-text evaluation set (examples/eval/realtext.jsonl): its structure, the generator's
pieces, the scorer, and one small end-to-end `kdnctl eval --tasks` run with the real SmolLM2."""

import hashlib
import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from conftest import REPO, cli_json, run_cli
from kdnctl.errors import InputError, UsageError
from kdnctl.evaluation import realtext
from kdnctl.evaluation.tasks import KINDS, load_tasks, number_in

SET = REPO / "examples" / "eval" / "realtext.jsonl"
META = REPO / "examples" / "eval" / "realtext.meta.json"
MULTIFACT_SET = REPO / "examples" / "eval" / "realtext-multifact.jsonl"
COMMITTED = {SET: {"needle": 60, "multifact": 40, "continuation": 30}, MULTIFACT_SET: {"multifact": 160}}


def records(path: Path = SET):
    return [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]


def count_number(text: str, value: str) -> int:
    return len(re.findall(rf"(?<!\d){value}(?!\d)", text))


# --------------------------------------------------------------------------- committed set


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.stem)
def test_committed_set_counts_ids_and_meta(path):
    recs = records(path)
    kinds = Counter(r["kind"] for r in recs)
    assert dict(kinds) == COMMITTED[path]
    assert all(r["id"].startswith(f"{path.stem}/") for r in recs)
    assert len({r["id"] for r in recs}) == len(recs)
    assert len({r["source"] for r in recs}) == len(recs), "one man page per task"
    meta = json.loads(path.with_name(path.stem + ".meta.json").read_text())
    assert meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest(), "regenerate with bench/make_eval_set.py"
    assert meta["counts"] == dict(kinds)
    assert path.stat().st_size < 3_000_000


def test_committed_sets_share_no_page_family():
    """The extra multi-fact set is over other man pages than the main set (another sample of real
    text, not the same documents asked again)."""
    fams = [{realtext.page_family(r["source"]) for r in records(p)} for p in COMMITTED]
    assert not fams[0] & fams[1]
    assert {t.id for t in load_tasks("realtext-multifact")} == {r["id"] for r in records(MULTIFACT_SET)}


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.stem)
def test_committed_questions_come_after_and_needles_are_planted_once(path):
    for r in records(path):
        assert 500 <= r["context_tokens"] <= 2000, r["id"]
        if r["kind"] == "continuation":
            assert r["question"] is None and r["answer"] is None and r["continuation"].strip()
            continue
        text, q, a = r["text"], r["question"], r["answer"]
        assert a not in q and q not in text, r["id"]  # the question is not in the cached context
        assert count_number(text, a) == 1, r["id"]  # the needle is there exactly once
        for sentence in r["planted"]:
            assert text.count(sentence) == 1 and f"\n{sentence}\n" in text, r["id"]
        if r["kind"] == "needle":
            assert len(r["planted"]) == 1 and a in r["planted"][0] and a.isdigit() and len(a) == 5
        else:
            values = [a, *r["distractors"]]
            assert 4 <= len(values) <= 6 and len(set(values)) == len(values) == len(r["planted"])
            assert all(count_number(text, v) == 1 for v in values), r["id"]
            asked = next(s for s in r["planted"] if a in s)
            name = re.search(r"the (\w+) (service|team|office|group)", asked).group(1)
            assert name in q, r["id"]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.stem)
def test_committed_token_counts_and_continuation_boundaries(lm, path):
    tok = lm.tokenizer
    for r in records(path):
        ids = tok(r["text"], add_special_tokens=False).input_ids
        assert len(ids) == r["context_tokens"], r["id"]
        if r["kind"] == "continuation":
            cont = tok(r["continuation"], add_special_tokens=False).input_ids
            joint = tok(r["text"] + r["continuation"], add_special_tokens=False).input_ids
            assert joint == ids + cont and len(cont) > realtext.CONTINUATION_TOKENS, r["id"]


def test_load_tasks_filters_and_validates(tmp_path):
    tasks = load_tasks("realtext", limit=3)
    assert Counter(t.kind for t in tasks) == {k: 3 for k in KINDS}
    assert [t.kind for t in load_tasks("realtext", kinds=["continuation"])] == ["continuation"] * 30
    with pytest.raises(UsageError):
        load_tasks("realtext", kinds=["cloze"])
    with pytest.raises(InputError):
        load_tasks(tmp_path / "absent.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "kind": "needle", "text": "t", "question": "q?"}) + "\n")
    with pytest.raises(InputError, match="question and an answer"):
        load_tasks(bad)


# --------------------------------------------------------------------------- scorer and generator


@pytest.mark.parametrize("answer,value,ok", [
    ("The maintenance access code for this tool is 48213.", "48213", True),
    ("48,213", "48213", True),
    ("code: 48 213", "48213", True),
    ("148213", "48213", False),
    ("482130", "48213", False),
    ("4821", "48213", False),
    ("The port is 7310 or 7311", "7311", True),
    ("", "7311", False),
])
def test_number_in(answer, value, ok):
    assert number_in(answer, value) is ok


def test_plant_puts_a_line_near_the_depth():
    text = "".join(f"line {i} of the page\n" for i in range(100))
    out, at = realtext.plant(text, "The code is 11111.", 0.5)
    assert out.count("The code is 11111.\n") == 1 and out[at - 1] == "\n"
    assert abs(at / len(text) - 0.5) < 0.02
    assert out.replace("The code is 11111.\n", "") == text
    first, at0 = realtext.plant(text, "X.", 0.0)
    assert at0 > 0, "never before the first line"


def test_fresh_number_avoids_the_text_and_taken_values():
    rng = random.Random(0)
    avoid = " ".join(str(n) for n in range(1000, 9999, 2))  # every even 4-digit number
    taken = set()
    for _ in range(50):
        v = realtext.fresh_number(rng, 4, avoid, taken)
        assert int(v) % 2 == 1 and not any(v in t or t in v for t in taken)
        taken.add(v)


def test_tasks_are_deterministic_and_well_formed(lm):
    tok = lm.tokenizer
    body = "".join(f"The option --flag{i} sets the value of parameter number {i} for the program.\n" for i in range(300))
    page = realtext.Page("man1/fake.1.gz", body)
    offsets = lambda t: [tuple(o) for o in tok(t, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]  # noqa: E731
    a = realtext.needle_task("n", page, random.Random(3), offsets, 600)
    b = realtext.needle_task("n", page, random.Random(3), offsets, 600)
    assert a == b and count_number(a["text"], a["answer"]) == 1
    assert 580 <= len(tok(a["text"], add_special_tokens=False).input_ids) <= 640
    m = realtext.multifact_task("m", page, random.Random(4), offsets, 800)
    assert all(m["text"].count(s) == 1 for s in m["planted"]) and m["answer"] not in m["distractors"]
    c = realtext.continuation_task("c", page, random.Random(5), tok, 700)
    assert c is not None and (page.text.startswith(c["text"] + c["continuation"]))
    assert c["text"][-1] != " " and c["continuation"][0] == " "


@pytest.mark.skipif(shutil.which("groff") is None or not Path("/usr/share/man/man1").is_dir(), reason="needs groff and man pages")
def test_render_man_gives_plain_text():
    page = next(p for p in sorted(Path("/usr/share/man/man1").glob("*.1.gz")) if p.stat().st_size > 3000)
    text = realtext.render_man(page)
    assert len(text) > 1000 and "\x08" not in text and "\x1b" not in text and ".TH" not in text
    assert not re.search(r"^ ", text, re.M) and "  " not in text


# --------------------------------------------------------------------------- end to end


def test_eval_tasks_end_to_end(tmp_path):
    """Ingest 3 contexts (one per kind) through `kdnctl eval --tasks`, add an int8 version,
    and score both from the stored KV with the real model."""
    store = tmp_path / "kdn"
    subset = tmp_path / "tasks.jsonl"
    recs = records()
    # the shortest context of each kind (what is checked does not depend on the length)
    picked = [min((r for r in recs if r["kind"] == k), key=lambda r: r["context_tokens"]) for k in KINDS]
    subset.write_text("".join(json.dumps(r) + "\n" for r in picked))
    first = run_cli("eval", "--tasks", str(subset), store=store, check=True)  # ingests, then scores full
    assert "ingesting 3 task contexts" in first.stderr
    head, row = first.stdout.splitlines()[:2]
    assert "needle acc (n)" in head and "multi-fact acc (n)" in head and "cont. NLL (n)" in head
    assert row.split()[:3] == ["full", "1.000", "(1)"] and row.count("(1)") == 3
    out = cli_json("compress", "--budget", "1", "--quant", "int8", *[r["id"] for r in picked], store=store)
    label = out["results"][0]["label"]
    res = cli_json("eval", "--tasks", str(subset), "--versions", f"full,{label}", store=store)
    by = {v["label"]: v for v in res["versions"]}
    assert set(by) == {"full", label}
    for v in by.values():
        assert v["needle"]["n"] == v["multifact"]["n"] == v["continuation"]["n"] == 1
        assert 0 < v["continuation"]["nll"] < 10
    full, q8 = by["full"], by[label]
    assert full["needle"]["accuracy"] == 1.0  # the first needle is found from the full cache
    assert full["fp16_fraction"] == pytest.approx(2.0, rel=0.01)  # fp32 K/V on CPU
    assert 0.45 < q8["fp16_fraction"] < 0.7 and q8["bytes_per_token"] < full["bytes_per_token"]
    assert q8["continuation"]["nll"] == pytest.approx(full["continuation"]["nll"], rel=0.05)
    assert full["ratio_vs_full"]["needle"] == 1.0 and full["ratio_vs_full"]["continuation"] == 1.0
    assert full["paired_vs_full"] == {}  # the baseline is not paired with itself
    pn, pc = q8["paired_vs_full"]["needle"], q8["paired_vs_full"]["continuation"]
    assert pn["n"] == 1 and pn["lost"] + pn["gained"] <= 1 and 0 < pn["p"] <= 1
    assert pc["nll_ratio_ci"][0] == pytest.approx(q8["ratio_vs_full"]["continuation"], abs=1e-3)
    answers = {t["kind"]: t["by_version"]["full"] for t in res["tasks"]}
    assert answers["needle"]["correct"] and picked[0]["answer"] in answers["needle"]["answer"]
    bad = run_cli("eval", "--tasks", str(subset), "--qa", str(REPO / "examples" / "qa.jsonl"), store=store)
    assert bad.returncode == 2


def test_quality_vs_bytes_plot(tmp_path):
    from kdnctl.evaluation.plot import plot_quality_vs_bytes

    def version(label, frac, acc, nll):
        return {"label": label, "fp16_fraction": frac, "needle": {"n": 60, "accuracy": acc},
                "multifact": {"n": 40, "accuracy": acc / 2}, "continuation": {"n": 30, "nll": nll}}

    result = {"versions": [version("full", 2.0, 0.98, 2.5), version("b1-int4", 0.31, 0.97, 2.52),
                           version("kvcrush-b0.25", 0.5, 0.23, 2.9)]}
    out = plot_quality_vs_bytes(result, tmp_path / "q.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
