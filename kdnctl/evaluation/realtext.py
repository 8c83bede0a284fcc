"""Build an evaluation set from real text the project did not write (rendered man pages).

Three task kinds, each a context (what gets ingested and compressed) and, after it, a probe the
compressor never sees:

* ``needle``       one planted sentence carrying a random 5-digit code ("The maintenance access
                   code for this tool is 48213.") at a random depth; the question asks for it;
* ``multifact``    4-6 planted facts of one kind with different names ("The port for the kestrel
                   service is 7310."); the question asks for one, the others are distractors;
* ``continuation`` no question: the real text that follows the context; scored by NLL.

The needle and multi-fact kinds also come with answers that are words (``word_needle_task``,
``word_fact_task``: a name, a city, an object or an animal; 2-3 facts per multi-fact task), each
with the lead of its planted sentence (``answer_lead``). ``assign_splits`` names each task's half,
``tune`` or ``report`` (docs/evaluation.md).

Everything is drawn from one ``random.Random(seed)``; pages are read in sorted order, so the
same man pages, groff and tokenizer give the same file. The committed set
(``examples/eval/realtext.jsonl``) is what the project measures with; ``bench/make_eval_set.py``
regenerates it. Each line is also a corpus record (``id`` + ``text``), so ``kdnctl ingest`` reads
the contexts directly.
"""

from __future__ import annotations

import gzip
import random
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

MAN_SECTIONS = ("man1", "man5", "man7", "man8")
CONTINUATION_TOKENS = 64  # scored tokens; one more continuation token is fed before them

NEEDLE_TEMPLATES = [
    ("The maintenance access code for this tool is {v}.", "What is the maintenance access code for this tool?"),
    ("The recovery number assigned to this manual is {v}.", "What is the recovery number assigned to this manual?"),
    ("The support ticket number for this page is {v}.", "What is the support ticket number for this page?"),
    ("The licence serial number of this program is {v}.", "What is the licence serial number of this program?"),
]

# (fact template, question template); {name} is one of NAMES, {v} a 4-digit number.
FACT_TEMPLATES = [
    ("The port for the {name} service is {v}.", "What is the port for the {name} service?"),
    ("The room number of the {name} team is {v}.", "What is the room number of the {name} team?"),
    ("The phone extension of the {name} office is {v}.", "What is the phone extension of the {name} office?"),
    ("The locker code of the {name} group is {v}.", "What is the locker code of the {name} group?"),
]
NAMES = ["kestrel", "marlin", "juniper", "cobalt", "heron", "tundra", "saffron", "basalt", "lynx",
         "quartz", "willow", "osprey", "ember", "glacier", "meadow", "falcon", "cedar", "onyx",
         "harbor", "maple", "comet", "otter", "granite", "sparrow"]

# Word answers: the same task shapes, the answer a word (a name, a place, an object, an animal),
# never a digit. Each template names its vocabulary; answers and fact names never share a word.
WORD_NEEDLE_TEMPLATES = [
    ("The secret password for this manual is {w}.", "What is the secret password for this manual?", "objects"),
    ("The author of this page was born in {w}.", "In which city was the author of this page born?", "cities"),
    ("The mascot of this program is a {w}.", "What animal is the mascot of this program?", "animals"),
    ("The maintainer of this tool is called {w}.", "What is the name of the maintainer of this tool?", "people"),
]
WORD_FACT_TEMPLATES = [
    ("The {name} team is based in {w}.", "In which city is the {name} team based?", "cities"),
    ("The leader of the {name} group is {w}.", "Who is the leader of the {name} group?", "people"),
    ("The logo of the {name} project is a {w}.", "What is the logo of the {name} project?", "objects"),
    ("The mascot of the {name} office is a {w}.", "What animal is the mascot of the {name} office?", "animals"),
]
WORDS = {
    "cities": ["Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Cairo", "Lisbon", "Vienna", "Dublin",
               "Moscow", "Sydney", "Chicago", "Boston", "Toronto", "Athens", "Prague", "Oslo", "Delhi", "Seoul",
               "Lima", "Nairobi", "Warsaw", "Budapest"],
    "people": ["Alice", "Oliver", "Sophia", "Daniel", "Emma", "Lucas", "Maria", "Henry", "Clara", "Thomas",
               "Julia", "Victor", "Laura", "Martin", "Nina", "George", "Hannah", "Peter", "Sarah", "David",
               "Anna", "Michael", "Rachel", "Samuel"],
    "objects": ["pineapple", "lantern", "violin", "umbrella", "anchor", "teapot", "compass", "candle", "pencil",
                "guitar", "rocket", "mirror", "bicycle", "kettle", "hammer", "balloon", "trumpet", "ladder",
                "basket", "banana", "piano", "castle", "crown", "feather"],
    "animals": ["tiger", "elephant", "penguin", "giraffe", "dolphin", "rabbit", "zebra", "kangaroo", "panda",
                "turtle", "monkey", "camel", "parrot", "squirrel", "wolf", "bear", "lion", "horse", "frog",
                "eagle", "shark", "goat", "duck", "mouse"],
}
ANSWER_KINDS = ("digits", "words", "continuation")


def answer_kind(kind: str, answer: str | None) -> str:
    """``continuation`` (no answer), ``digits`` (an answer of digits only) or ``words``."""
    if kind == "continuation" or answer is None:
        return "continuation"
    return "digits" if answer.isdigit() else "words"


@dataclass(frozen=True)
class Page:
    source: str  # e.g. "man1/tar.1.gz"
    text: str


def render_man(path: Path, timeout: float = 20.0) -> str:
    """Plain text of a man page: groff (ASCII, no hyphenation, long lines), then the running
    header and footer dropped, indentation and justification spaces collapsed."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    out = subprocess.run(["groff", "-man", "-Tascii", "-rLL=1000n", "-rHY=0", "-P-cbou"],
                         input=raw, capture_output=True, timeout=timeout).stdout
    lines = out.decode("ascii", errors="replace").splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    lines = lines[1:-1]  # running header "TAR(1) ... TAR(1)" and footer
    clean: list[str] = []
    for line in lines:
        line = re.sub(r"[ \t]+", " ", line).strip()
        if line or (clean and clean[-1]):
            clean.append(line)
    return "\n".join(clean).strip() + "\n"


def page_family(source: str) -> str:
    """The command family of a man page (``man1/git-log.1.gz`` -> ``git``): the name before the
    first '-', '.' or '_'."""
    return re.split(r"[-._]", Path(source).name, maxsplit=1)[0].lower()


def find_pages(root: Path, *, rng: random.Random, want: int, min_chars: int, count_tokens,
               min_tokens: int, sections=MAN_SECTIONS, skip_families: frozenset[str] = frozenset()) -> list[Page]:
    """``want`` rendered pages of at least ``min_tokens`` tokens, one per command family
    (``page_family``) and none of ``skip_families`` (e.g. those of another task set, so two sets
    share no text), in a seeded random order of the sorted listing."""
    files = sorted(p for s in sections for p in (root / s).glob("*") if p.is_file() and p.stat().st_size > 1500)
    rng.shuffle(files)
    pages: list[Page] = []
    families: set[str] = set(skip_families)
    for f in files:
        family = page_family(f.name)
        if family in families:
            continue
        try:
            text = render_man(f)
        except (subprocess.SubprocessError, OSError, EOFError, gzip.BadGzipFile):
            continue
        if len(text) < min_chars or _non_ascii_share(text) > 0.01 or count_tokens(text) < min_tokens:
            continue
        families.add(family)
        pages.append(Page(f"{f.parent.name}/{f.name}", text))
        if len(pages) == want:
            break
    return pages


def _non_ascii_share(text: str) -> float:
    return sum(ch == "\ufffd" or ord(ch) > 126 for ch in text) / max(len(text), 1)


def cut_at_line(text: str, offsets: list[tuple[int, int]], n_tokens: int, min_tokens: int = 0) -> str:
    """The longest prefix of ``text`` that ends at a line break within the first ``n_tokens``
    tokens, or, where that leaves fewer than ``min_tokens``, the shortest one past them."""
    end = offsets[min(n_tokens, len(offsets)) - 1][1]
    cut = text.rfind("\n", 0, end)
    if cut <= 0 or sum(1 for o in offsets if o[1] <= cut) < min_tokens:
        nxt = text.find("\n", end)
        cut = nxt if nxt > 0 else len(text) - 1
    return text[: cut + 1]


def line_starts(text: str) -> list[int]:
    """Offsets where a planted line may go: the start of every non-empty line but the first."""
    return [m.end() for m in re.finditer(r"\n(?=\S)", text)]


def plant(text: str, sentence: str, depth: float) -> tuple[str, int]:
    """Insert ``sentence`` as its own line at the line start nearest to ``depth`` (0-1) of the text;
    returns (new text, character offset of the sentence)."""
    starts = line_starts(text)
    if not starts:
        raise ValueError("text has no line to plant a sentence before")
    target = depth * len(text)
    at = min(starts, key=lambda s: abs(s - target))
    return text[:at] + sentence + "\n" + text[at:], at


def fresh_number(rng: random.Random, digits: int, avoid: str, taken: set[str]) -> str:
    """A random number of ``digits`` digits that occurs nowhere in ``avoid`` and is not a
    substring (or superstring) of one already ``taken``."""
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if v not in avoid and not any(v in t or t in v for t in taken):
            return v


def fresh_word(rng: random.Random, vocabulary: list[str], avoid: str, taken: set[str]) -> str:
    """A word of ``vocabulary`` that occurs nowhere in ``avoid`` as a whole word (any case) and
    is not one already ``taken``."""
    lowered = avoid.lower()
    free = [w for w in vocabulary if w not in taken and not re.search(rf"(?<![a-z]){w.lower()}(?![a-z])", lowered)]
    if not free:
        raise ValueError("every word of the vocabulary occurs in the text")
    return free[rng.randrange(len(free))]


def word_needle_task(task_id: str, page: Page, rng: random.Random, tokenize, length: int, min_tokens: int = 0) -> dict:
    """A needle whose answer is a word: one planted sentence at a random depth."""
    base = cut_at_line(page.text, tokenize(page.text), length, min_tokens)
    template, question, vocab = WORD_NEEDLE_TEMPLATES[rng.randrange(len(WORD_NEEDLE_TEMPLATES))]
    value = fresh_word(rng, WORDS[vocab], base, set())
    sentence = template.format(w=value)
    text, at = plant(base, sentence, rng.uniform(0.05, 0.95))
    return {"id": task_id, "kind": "needle", "answer_kind": "words", "source": page.source, "text": text,
            "question": question, "answer": value, "answer_lead": answer_lead(template),
            "planted": [sentence], "depth": round(at / len(text), 4)}


def word_fact_task(task_id: str, page: Page, rng: random.Random, tokenize, length: int, min_tokens: int = 0,
                   n_facts: tuple[int, int] = (2, 3)) -> dict:
    """Several planted facts of one template whose answers are words of one vocabulary (a city
    per team, a leader per group, ...); the question asks for one, the others are distractors."""
    base = cut_at_line(page.text, tokenize(page.text), length, min_tokens)
    template, question, vocab = WORD_FACT_TEMPLATES[rng.randrange(len(WORD_FACT_TEMPLATES))]
    n = rng.randint(*n_facts)
    lowered = base.lower()
    names = rng.sample([m for m in NAMES if not re.search(rf"(?<![a-z]){m}(?![a-z])", lowered)], n)
    taken: set[str] = set()
    values = []
    for _ in names:
        values.append(fresh_word(rng, WORDS[vocab], base, taken))
        taken.add(values[-1])
    depths = [(i + rng.uniform(0.1, 0.9)) / n for i in range(n)]
    text = base
    for name, value, depth in sorted(zip(names, values, depths), key=lambda x: -x[2]):
        text, _ = plant(text, template.format(name=name, w=value), depth)
    ask = rng.randrange(n)
    sentences = [template.format(name=m, w=v) for m, v in zip(names, values)]
    return {"id": task_id, "kind": "multifact", "answer_kind": "words", "source": page.source, "text": text,
            "question": question.format(name=names[ask]), "answer": values[ask],
            "answer_lead": answer_lead(template, name=names[ask]),
            "distractors": [v for i, v in enumerate(values) if i != ask], "planted": sentences,
            "depth": round(text.index(sentences[ask]) / len(text), 4)}


def answer_lead(template: str, **names: str) -> str:
    """The words of a planted sentence before its answer ("The mascot of this program is a"):
    the answer NLL of a word task is scored after the question and this lead, so it measures
    whether the context still tells which word comes, not how the model likes to open a reply."""
    return template.split("{w}")[0].format(**names).rstrip()


def assign_splits(tasks: list[dict]) -> list[dict]:
    """Name every task's half: within each (kind, answer kind), in file order, the even-numbered
    tasks are ``tune`` (for choosing a method) and the odd-numbered ``report`` (for the numbers
    a method is judged by). Lengths, depths and templates are drawn at random, so the halves are
    two samples of one design."""
    seen: dict[tuple[str, str], int] = {}
    for t in tasks:
        key = (t["kind"], t.get("answer_kind") or answer_kind(t["kind"], t.get("answer")))
        t["split"] = "tune" if seen.get(key, 0) % 2 == 0 else "report"
        seen[key] = seen.get(key, 0) + 1
    return tasks


def needle_task(task_id: str, page: Page, rng: random.Random, tokenize, length: int, min_tokens: int = 0) -> dict:
    base = cut_at_line(page.text, tokenize(page.text), length, min_tokens)
    template, question = NEEDLE_TEMPLATES[rng.randrange(len(NEEDLE_TEMPLATES))]
    value = fresh_number(rng, 5, base, set())
    sentence = template.format(v=value)
    depth = rng.uniform(0.05, 0.95)
    text, at = plant(base, sentence, depth)
    return {"id": task_id, "kind": "needle", "source": page.source, "text": text, "question": question,
            "answer": value, "planted": [sentence], "depth": round(at / len(text), 4)}


def multifact_task(task_id: str, page: Page, rng: random.Random, tokenize, length: int, min_tokens: int = 0) -> dict:
    base = cut_at_line(page.text, tokenize(page.text), length, min_tokens)
    template, question = FACT_TEMPLATES[rng.randrange(len(FACT_TEMPLATES))]
    n_facts = rng.randint(4, 6)
    names = rng.sample(NAMES, n_facts)
    taken: set[str] = set()
    values = []
    for _ in names:
        values.append(fresh_number(rng, 4, base, taken))
        taken.add(values[-1])
    # depths spread over the text: one per equal slice, in a shuffled order of names
    depths = [(i + rng.uniform(0.1, 0.9)) / n_facts for i in range(n_facts)]
    text = base
    for name, value, depth in sorted(zip(names, values, depths), key=lambda x: -x[2]):
        text, _ = plant(text, template.format(name=name, v=value), depth)  # deepest first: offsets stay valid
    ask = rng.randrange(n_facts)
    sentences = [template.format(name=n, v=v) for n, v in zip(names, values)]
    return {"id": task_id, "kind": "multifact", "source": page.source, "text": text,
            "question": question.format(name=names[ask]), "answer": values[ask],
            "distractors": [v for i, v in enumerate(values) if i != ask], "planted": sentences,
            "depth": round(text.index(sentences[ask]) / len(text), 4)}


def continuation_task(task_id: str, page: Page, rng: random.Random, tokenizer, length: int) -> dict | None:
    """Context = the page up to a word boundary near ``length`` tokens; continuation = the real
    text after it (at least CONTINUATION_TOKENS + 1 tokens). The split is kept only where the
    two parts tokenize exactly as the joined text does, so the scored tokens are the real ones."""
    text = page.text
    offsets = _offsets(tokenizer, text)
    if len(offsets) < length + CONTINUATION_TOKENS + 40:
        return None
    start = offsets[length][0]
    for m in re.finditer(r"(?<=[^\s]) (?=[A-Za-z0-9])", text[start:]):
        p = start + m.start()
        ctx, rest = text[:p], text[p:]
        need = [o for o in offsets if o[0] >= p][: CONTINUATION_TOKENS + 24]
        if len(need) < CONTINUATION_TOKENS + 24:
            return None
        cont = rest[: need[-1][1] - p]
        joint = tokenizer(ctx + cont, add_special_tokens=False).input_ids
        a = tokenizer(ctx, add_special_tokens=False).input_ids
        b = tokenizer(cont, add_special_tokens=False).input_ids
        if joint == a + b and len(b) > CONTINUATION_TOKENS:
            return {"id": task_id, "kind": "continuation", "source": page.source, "text": ctx,
                    "question": None, "answer": None, "continuation": cont}
        if p - start > 2000:
            return None
    return None


def _offsets(tokenizer, text: str) -> list[tuple[int, int]]:
    return [tuple(o) for o in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]


def build_set(pages: list[Page], tokenizer, *, n_needle: int, n_multifact: int, n_continuation: int,
              min_tokens: int, max_tokens: int, rng: random.Random, set_name: str = "realtext",
              n_word_needle: int = 0, n_word_fact: int = 0) -> list[dict]:
    """Tasks over distinct pages (one page per task), context lengths uniform in
    [min_tokens, max_tokens] tokens of the base text (planted sentences add a few); task ids
    are ``<set_name>/<kind>-NNN`` (word-answer tasks ``<set_name>/<kind>-words-NNN``)."""
    tokenize = lambda t: _offsets(tokenizer, t)  # noqa: E731
    tasks: list[dict] = []
    pages = list(pages)
    plan = [("needle", n_needle), ("multifact", n_multifact), ("continuation", n_continuation),
            ("needle-words", n_word_needle), ("multifact-words", n_word_fact)]
    for kind, count in plan:
        made = 0
        while made < count:
            if not pages:
                raise ValueError(f"not enough pages for {count} {kind} tasks")
            page = pages.pop(0)
            length = rng.randint(min_tokens, max_tokens)
            task_id = f"{set_name}/{kind}-{made:03d}"
            if kind == "needle-words":
                task = word_needle_task(task_id, page, rng, tokenize, length, min_tokens)
            elif kind == "multifact-words":
                task = word_fact_task(task_id, page, rng, tokenize, length, min_tokens)
            elif kind == "needle":
                task = needle_task(task_id, page, rng, tokenize, length, min_tokens)
            elif kind == "multifact":
                task = multifact_task(task_id, page, rng, tokenize, length, min_tokens)
            else:
                task = continuation_task(task_id, page, rng, tokenizer, length)
            if task is None:
                continue
            task["context_tokens"] = len(tokenizer(task["text"], add_special_tokens=False).input_ids)
            tasks.append(task)
            made += 1
    return tasks
