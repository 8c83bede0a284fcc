"""Consistency checks for the example corpus and evaluation sets.

Run:  .venv/bin/python examples/check_examples.py
Exits non-zero if any check fails. Needs only the standard library.

Also defines `score_check(answer, check)`, the reference semantics of the
mechanical `check` objects in steering/tasks.jsonl.
"""
from __future__ import annotations

import html.parser
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"

CHECK_TYPES = {"contains", "contains_any", "uppercase", "lowercase",
               "word_count_max", "starts_with", "ends_with"}

_EDGE = " \t\r\n\"'`*.,!?;:()[]{}-"  # stripped before starts_with / ends_with


def score_check(answer: str, check: dict) -> bool:
    """Return True if `answer` satisfies the mechanical `check`.

    contains       value (str) occurs in answer, case-insensitive
    contains_any   any of value (list[str]) occurs in answer, case-insensitive
    uppercase      answer has at least one letter and no lowercase letters
    lowercase      answer has at least one letter and no uppercase letters
    word_count_max number of whitespace-separated words <= value (and >= 1)
    starts_with    answer, stripped of surrounding whitespace/quotes/punctuation,
                   starts with value, case-insensitive, at a word boundary
    ends_with      same, at the end
    """
    t = check["type"]
    a = answer.strip()
    if t == "contains":
        return check["value"].lower() in a.lower()
    if t == "contains_any":
        return any(v.lower() in a.lower() for v in check["value"])
    if t == "uppercase":
        return any(c.isalpha() for c in a) and not any(c.islower() for c in a)
    if t == "lowercase":
        return any(c.isalpha() for c in a) and not any(c.isupper() for c in a)
    if t == "word_count_max":
        return 1 <= len(a.split()) <= int(check["value"])
    if t in ("starts_with", "ends_with"):
        core = a.strip(_EDGE).lower()
        v = check["value"].lower()
        if t == "starts_with":
            return re.match(re.escape(v) + r"\b", core) is not None
        return re.search(r"\b" + re.escape(v) + r"$", core) is not None
    raise ValueError(f"unknown check type {t!r}")


class _Visible(html.parser.HTMLParser):
    """Collects text outside <script>/<style>; comments are dropped by the parser."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self.skip += 1

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self.skip -= 1

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def raw_text(doc: str) -> str:
    return (CORPUS / doc).read_text(encoding="utf-8")


def visible_text(doc: str) -> str:
    s = raw_text(doc)
    if doc.endswith((".html", ".htm")):
        p = _Visible()
        p.feed(s)
        s = "".join(p.parts)
    return s


def load_jsonl(path: Path) -> list[dict]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:  # pragma: no cover
                raise SystemExit(f"{path.name}:{n}: bad JSON: {e}")
    return out


def main() -> int:
    errors: list[str] = []
    warn: list[str] = []

    def err(msg: str) -> None:
        errors.append(msg)

    # ---- corpus --------------------------------------------------------
    docs = sorted(p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*") if p.is_file())
    print("corpus:")
    for d in docs:
        w = len(visible_text(d).split())
        wr = len(raw_text(d).split())
        print(f"  {d:32s} visible words {w:5d}  raw words {wr:5d}  ~tokens {int(w * 1.3):5d}")
        if not 700 <= w <= 2000:
            err(f"corpus/{d}: {w} visible words, want 700-2000")
    # HTML: text in <script>/<style>/comments/meta must not leak into visible text
    for d in docs:
        if d.endswith(".html"):
            vis = visible_text(d)
            for decoy in ("Ilse Varn", "1702", "North Rock Light", "Matthias Cole",
                          "Varn Cut", "1901", "smugglers", "quizAnswers"):
                if decoy in vis:
                    err(f"corpus/{d}: decoy {decoy!r} is in visible text")
                if decoy not in raw_text(d):
                    err(f"corpus/{d}: decoy {decoy!r} missing from raw html")

    # ---- qa.jsonl -------------------------------------------------------
    qa = load_jsonl(HERE / "qa.jsonl")
    per_doc: dict[str, int] = {}
    alias_hits = alias_total = 0
    for i, r in enumerate(qa, 1):
        for k in ("doc", "question", "answer", "position"):
            if k not in r:
                err(f"qa.jsonl:{i}: missing {k}")
        d = r.get("doc", "")
        if d not in docs:
            err(f"qa.jsonl:{i}: unknown doc {d!r}")
            continue
        per_doc[d] = per_doc.get(d, 0) + 1
        vis = visible_text(d).lower()
        if r["answer"].lower() not in vis:
            err(f"qa.jsonl:{i}: answer {r['answer']!r} not in visible text of {d}")
        if not 1 <= len(r["answer"].split()) <= 4:
            err(f"qa.jsonl:{i}: answer {r['answer']!r} not 1-4 words")
        if r["position"] not in ("start", "middle", "end"):
            err(f"qa.jsonl:{i}: bad position {r['position']!r}")
        for a in r.get("aliases", []):
            alias_total += 1
            alias_hits += a.lower() in vis
    print(f"qa.jsonl: {len(qa)} items, per doc {per_doc}, "
          f"aliases verbatim in doc {alias_hits}/{alias_total} (not required)")
    pos = {}
    for r in qa:
        pos[r["position"]] = pos.get(r["position"], 0) + 1
    print(f"  positions {pos}")
    if len(qa) != 40:
        err(f"qa.jsonl: {len(qa)} items, want 40")
    if any(v != 8 for v in per_doc.values()) or len(per_doc) != 5:
        err(f"qa.jsonl: want 8 items for each of 5 docs, got {per_doc}")

    # ---- multichunk_qa.jsonl ---------------------------------------------
    mc = load_jsonl(HERE / "multichunk_qa.jsonl")
    for i, r in enumerate(mc, 1):
        for k in ("docs", "question", "answer", "evidence"):
            if k not in r:
                err(f"multichunk_qa.jsonl:{i}: missing {k}")
        if any(d not in docs for d in r["docs"]):
            err(f"multichunk_qa.jsonl:{i}: unknown doc in {r['docs']}")
            continue
        raws = {d: raw_text(d) for d in r["docs"]}
        if len(r["evidence"]) < 2:
            err(f"multichunk_qa.jsonl:{i}: want >= 2 evidence sentences")
        found_in = []
        for e in r["evidence"]:
            where = [d for d, t in raws.items() if e in t]
            if not where:
                err(f"multichunk_qa.jsonl:{i}: evidence not verbatim: {e!r}")
            found_in.append(where)
        if len(r["docs"]) == 2 and not (set(found_in[0]) ^ set(found_in[1]) or len(found_in[0]) == 1):
            warn.append(f"multichunk_qa.jsonl:{i}: evidence not from distinct docs")
        if not any(r["answer"].lower() in visible_text(d).lower() for d in r["docs"]):
            err(f"multichunk_qa.jsonl:{i}: answer {r['answer']!r} not in docs")
        # the two facts should be far apart when they come from one document
        if len(r["docs"]) == 1:
            t = raws[r["docs"][0]]
            a, b = (t.find(e) for e in r["evidence"][:2])
            if a >= 0 and b >= 0 and abs(a - b) < 150:
                warn.append(f"multichunk_qa.jsonl:{i}: evidence only {abs(a - b)} chars apart")
    print(f"multichunk_qa.jsonl: {len(mc)} items, "
          f"{sum(len(r['docs']) == 2 for r in mc)} cross-document")
    if len(mc) != 15:
        err(f"multichunk_qa.jsonl: {len(mc)} items, want 15")

    # ---- steering/tasks.jsonl ------------------------------------------
    st = load_jsonl(HERE / "steering" / "tasks.jsonl")
    kinds: dict[str, int] = {}
    ids = set()
    for i, r in enumerate(st, 1):
        for k in ("id", "kind", "text", "highlight", "question", "check"):
            if k not in r:
                err(f"steering/tasks.jsonl:{i}: missing {k}")
        if r["id"] in ids:
            err(f"steering/tasks.jsonl:{i}: duplicate id {r['id']}")
        ids.add(r["id"])
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        if r["kind"] not in ("instruction", "counterfact"):
            err(f"steering/tasks.jsonl:{i}: bad kind {r['kind']!r}")
        n = r["text"].count(r["highlight"])
        if n != 1:
            err(f"steering/tasks.jsonl:{i}: highlight occurs {n} times (want exactly 1)")
        w = len(r["text"].split())
        if not 150 <= w <= 400:
            err(f"steering/tasks.jsonl:{i}: text has {w} words, want 150-400")
        c = r["check"]
        if c.get("type") not in CHECK_TYPES:
            err(f"steering/tasks.jsonl:{i}: unknown check type {c.get('type')!r}")
        if r["kind"] == "counterfact":
            vals = c["value"] if isinstance(c.get("value"), list) else [c.get("value")]
            if not any(v.lower() in r["highlight"].lower() for v in vals):
                err(f"steering/tasks.jsonl:{i}: counterfact answer not in highlight")
    print(f"steering/tasks.jsonl: {len(st)} items, kinds {kinds}")
    if len(st) != 24:
        err(f"steering/tasks.jsonl: {len(st)} items, want 24")

    # ---- self-test of score_check ----------------------------------------
    cases = [
        ("LEEKS", {"type": "uppercase"}, True), ("Leeks", {"type": "uppercase"}, False),
        ("anselm pryde", {"type": "lowercase"}, True), ("Anselm", {"type": "lowercase"}, False),
        ("Twenty minutes", {"type": "word_count_max", "value": 3}, True),
        ("It should simmer for twenty minutes.", {"type": "word_count_max", "value": 3}, False),
        ('"Certainly! Twelve cars."', {"type": "starts_with", "value": "Certainly"}, True),
        ("Certainlyyy", {"type": "starts_with", "value": "Certainly"}, False),
        ("Ten minutes. Done.", {"type": "ends_with", "value": "Done"}, True),
        ("Done. Ten minutes.", {"type": "ends_with", "value": "Done"}, False),
        ("It has 10 legs", {"type": "contains_any", "value": ["ten", "10"]}, True),
        ("The capital is Lyon.", {"type": "contains", "value": "Lyon"}, True),
        ("The capital is Paris.", {"type": "contains", "value": "Lyon"}, False),
    ]
    for ans, chk, want in cases:
        if score_check(ans, chk) != want:
            err(f"score_check({ans!r}, {chk}) != {want}")

    for w_ in warn:
        print("WARN", w_)
    for e in errors:
        print("FAIL", e)
    print("OK" if not errors else f"{len(errors)} failure(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
