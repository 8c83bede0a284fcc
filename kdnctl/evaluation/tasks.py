"""``kdnctl eval --tasks``: needle, multi-fact and continuation tasks over stored versions.

A task file (``examples/eval/realtext.jsonl``, built by ``bench/make_eval_set.py``) holds one
task a line; its ``text`` is the context that is ingested and compressed, and the probe comes
after it, unknown at compress time. For every version label each task is answered from the
stored KV through the real loader (``load_document`` + ``generate``):

* needle / multifact: greedy answer (up to ``max_new_tokens``; where the task names an
  ``answer_lead``, the reply is given that lead first); correct when the planted answer
  appears in it: a number as a whole number (thousands separators ignored), a word or phrase as
  whole words in any case; a multi-fact answer that holds another planted answer of the same
  task counts as distracted. ``answer_nll`` is the mean -log p of the answer's tokens
  teacher-forced after the question (a steadier signal) and the lead, if any. Word tasks
  carry a lead ("The mascot of this program is a"): a 135M model's free replies to them miss
  on form ("The document above contains the answer ...") in about a quarter of the tasks
  whatever the cache holds, and an answer NLL scored at the reply's first token measures how
  the model opens a reply, not which word the context names;
* continuation: the real text after the context is fed directly (no question); the first token
  is fed and the next CONTINUATION_TOKENS are scored: mean NLL per token.

Every task has an answer kind (``digits``, ``words``, ``continuation``) and a half (``split``:
``tune`` for choosing a method, ``report`` for judging it); both are read from the task file or,
where a file predates them, derived by the rules in ``realtext``. Scores are reported per kind
and per answer kind, each paired against the full cache on the same tasks.

Bytes per version: everything stored (``bytes_per_token``) and the K/V payload (every ``layers.*``
tensor: codes, scales, zero points, positions) as a fraction of fp16 K/V (2 bytes per element of
K and V, all layers and KV heads, every token of the original context).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import hashlib
import json
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..format.bundle import decode_bundle
from ..engine.hf import forward_suffix, generate, load_document
from ..errors import InputError, NotFoundError, UsageError
from ..ingest.prompting import PromptFormat
from .paired import answer_kind_vs_full, paired_vs_full
from .realtext import ANSWER_KINDS, CONTINUATION_TOKENS, answer_kind, assign_splits

KINDS = ("needle", "multifact", "continuation")
SPLITS = ("tune", "report")
_EVAL_DIR = Path(__file__).resolve().parents[2] / "examples" / "eval"
# realtext: the 130-task set (60 needle, 40 multi-fact, 30 continuation); realtext-multifact: 160
# more multi-fact tasks over other man pages, to tell versions apart where 40 cannot;
# realtext-words: 60 needle and 60 multi-fact tasks whose answers are words, over other pages again
NAMED_SETS = {name: _EVAL_DIR / f"{name}.jsonl" for name in ("realtext", "realtext-multifact", "realtext-words")}


@dataclass
class Task:
    id: str
    kind: str
    text: str
    question: str | None = None
    answer: str | None = None
    distractors: list[str] = field(default_factory=list)
    continuation: str | None = None
    context_tokens: int = 0
    source: str = ""
    answer_kind: str = ""
    answer_lead: str = ""
    split: str = ""

    def __post_init__(self):
        if not self.answer_kind:
            self.answer_kind = answer_kind(self.kind, self.answer)


def resolve_task_file(spec: str | Path) -> Path:
    """A named set (``realtext``) or a path to a task jsonl."""
    path = NAMED_SETS.get(str(spec), Path(spec))
    if not path.is_file():
        hint = f"named sets: {', '.join(NAMED_SETS)} (from a source checkout), or a path to a .jsonl"
        raise InputError(f"task file {path} does not exist", hint=hint)
    return path


def load_tasks(path: str | Path, *, kinds: list[str] | None = None, limit: int | None = None,
               split: str | None = None, answer_kinds: list[str] | None = None) -> list[Task]:
    """Tasks of ``kinds`` (default all) and ``answer_kinds`` (default all) in half ``split``
    (default both), the first ``limit`` of each kind (default all)."""
    path = resolve_task_file(path)
    kinds = list(kinds or KINDS)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise UsageError(f"unknown task kind(s) {', '.join(bad)}", hint=f"kinds: {', '.join(KINDS)}")
    bad = [k for k in answer_kinds or [] if k not in ANSWER_KINDS]
    if bad:
        raise UsageError(f"unknown answer kind(s) {', '.join(bad)}", hint=f"answer kinds: {', '.join(ANSWER_KINDS)}")
    if split is not None and split not in SPLITS:
        raise UsageError(f"unknown split {split!r}", hint=f"splits: {', '.join(SPLITS)}")
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}")
    every: list[tuple[int, Task]] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            task = Task(obj["id"], obj["kind"], obj["text"], obj.get("question"), obj.get("answer"),
                        list(obj.get("distractors") or []), obj.get("continuation"),
                        int(obj.get("context_tokens", 0)), obj.get("source", ""), obj.get("answer_kind") or "",
                        obj.get("answer_lead") or "", obj.get("split") or "")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{path}:{n}: bad task line ({exc})", hint='each line: {"id", "kind", "text", ...}') from None
        if task.kind not in KINDS:
            raise InputError(f"{path}:{n}: unknown task kind {task.kind!r}")
        if (task.kind == "continuation") != (task.continuation is not None) or (task.kind != "continuation") != bool(task.question and task.answer):
            raise InputError(f"{path}:{n}: a {task.kind} task needs " + ("a continuation" if task.kind == "continuation" else "a question and an answer"))
        if task.split and task.split not in SPLITS:
            raise InputError(f"{path}:{n}: unknown split {task.split!r}", hint=f"splits: {', '.join(SPLITS)}")
        every.append((n, task))
    if any(not t.split for _, t in every):  # a file that predates the halves: the generator's rule
        halves = assign_splits([{"kind": t.kind, "answer_kind": t.answer_kind} for _, t in every])
        for (_, t), h in zip(every, halves):
            t.split = t.split or h["split"]
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for _, task in every:
        if task.kind not in kinds or (split and task.split != split) or (answer_kinds and task.answer_kind not in answer_kinds):
            continue
        if limit is None or seen.get(task.kind, 0) < limit:
            seen[task.kind] = seen.get(task.kind, 0) + 1
            tasks.append(task)
    return tasks


def number_in(answer: str, value: str) -> bool:
    """``value`` (a number) occurs in ``answer`` as a whole number; separators between digits
    ("48,213", "48 213") are ignored, a longer number containing it ("148213") does not count."""
    squashed = re.sub(r"(?<=\d)[,\s'](?=\d)", "", answer)
    return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", squashed) is not None


def words_in(answer: str, value: str) -> bool:
    """``value`` (a word or phrase) occurs in ``answer`` as whole words, in any case, with any
    run of spaces or punctuation between its words ("New  York" or "new_york" for "New York";
    neither "Parisian" nor "snake_case" holds a word "Paris" or "case")."""
    words = re.findall(r"[^\W_]+", value.lower())
    if not words:
        return False
    pattern = r"(?<!\w)" + r"[\W_]+".join(map(re.escape, words)) + r"(?!\w)"
    return re.search(pattern, answer.lower()) is not None


def answer_in(answer: str, value: str, kind: str) -> bool:
    """Whether the generated ``answer`` holds the planted ``value`` of answer kind ``kind``."""
    return number_in(answer, value) if kind == "digits" else words_in(answer, value)


def missing_documents(store, tasks: list[Task]) -> list[Task]:
    """Tasks whose context is not in the store with exactly this text."""
    out = []
    for t in tasks:
        try:
            doc = store.get_document(t.id)
        except NotFoundError:
            out.append(t)
            continue
        if doc.content_sha256 != hashlib.sha256(t.text.encode("utf-8")).hexdigest():
            out.append(t)
    return out


def ingest_tasks(lm: LoadedModel, store, tasks: list[Task], **kw):
    """Ingest the contexts of ``tasks`` (unchanged ones are skipped by ingest itself)."""
    from ..ingest.corpus import Document
    from ..ingest import IngestOptions, ingest_documents

    docs = [Document(t.id, t.text, t.source or t.id, hashlib.sha256(t.text.encode("utf-8")).hexdigest()) for t in tasks]
    return ingest_documents(store, lm, docs, IngestOptions(), **kw)


def default_labels(store, tasks: list[Task]) -> list[str]:
    """Every version label stored for any of the tasks' documents."""
    wanted = {t.id for t in tasks}
    return sorted({v.label for v in store.list_versions() if v.doc_id in wanted})


def version_bytes(store, version) -> tuple[int, int]:
    """(all stored bytes, K/V payload bytes: every ``layers.*`` tensor) of a version, read from
    the safetensors headers of its objects (8-byte length + JSON; no tensor is decoded)."""
    kv = 0
    for ref in version.chunks:
        kv += _kv_payload(store.read_object(ref.object, verify=False))
    return version.nbytes, kv


def _kv_payload(data: bytes) -> int:
    try:
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + n])
        return sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k.startswith("layers."))
    except (struct.error, ValueError, KeyError, TypeError):  # not a plain safetensors object
        b = decode_bundle(data)
        return sum(t.numel() * t.element_size() for k, t in b.tensors.items() if k.startswith("layers."))


def fp16_bytes_per_token(summary: dict) -> int:
    """K and V at 2 bytes per element, all layers and KV heads."""
    return 2 * 2 * summary["n_layers"] * summary["n_kv_heads"] * summary["head_dim"]


@torch.inference_mode()
def run_task(lm: LoadedModel, ctx, task: Task, fmt: PromptFormat, max_new_tokens: int) -> dict:
    """Score one task against a loaded context; returns the per-task record."""
    tok = lm.tokenizer
    if task.kind == "continuation":
        ids = tok(task.continuation, add_special_tokens=False).input_ids[: CONTINUATION_TOKENS + 1]
        logits, _ = forward_suffix(lm, ctx, ids)
        logp = torch.log_softmax(logits[:-1], dim=-1)
        nll = -logp.gather(1, torch.tensor(ids[1:], device=logp.device)[:, None]).mean().item()
        return {"nll": round(nll, 5), "n_scored": len(ids) - 1}
    suffix = fmt.question_ids(tok, task.question)
    if task.answer_lead:  # the reply opens with the planted sentence's lead; the answer follows it
        suffix = suffix + tok(task.answer_lead, add_special_tokens=False).input_ids
        target = tok(" " + task.answer, add_special_tokens=False).input_ids
    else:
        target = tok(task.answer, add_special_tokens=False).input_ids
    answer = generate(lm, ctx, suffix, max_new_tokens=max_new_tokens).answer
    logits, _ = forward_suffix(lm, ctx, suffix + target)
    start = len(suffix) - 1
    logp = torch.log_softmax(logits[start : start + len(target)], dim=-1)
    nll = -logp.gather(1, torch.tensor(target, device=logp.device)[:, None]).mean().item()
    return {"answer": answer, "correct": answer_in(answer, task.answer, task.answer_kind),
            "distracted": any(answer_in(answer, d, task.answer_kind) for d in task.distractors), "nll": round(nll, 5)}


def evaluate_tasks(lm: LoadedModel, store, labels: list[str], tasks: list[Task], *, max_new_tokens: int = 24,
                   on_step=None, on_task=None, before_task=None) -> dict:
    """Answer every task from every version in ``labels`` (``full`` always, first).

    ``on_task(partial)`` is called after each task with the result over the tasks done so far;
    when it returns True the evaluation stops there (every version answered the same tasks).
    ``before_task(task)`` runs first (e.g. to ingest and compress that task's document)."""
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    labels = ["full"] + [l for l in dict.fromkeys(labels) if l != "full"]
    per_token_fp16 = fp16_bytes_per_token(lm.summary)
    results: dict[str, dict[str, dict]] = {l: {} for l in labels}
    sizes: dict[str, dict] = {l: {"stored": 0, "kv": 0, "tokens": 0, "recipe": {}, "seconds": 0.0} for l in labels}
    for n_done, task in enumerate(tasks, 1):
        if before_task is not None:
            before_task(task)
        for label in labels:
            try:
                version = store.get_version(task.id, label)
            except NotFoundError:
                continue
            t0 = time.perf_counter()
            ctx = load_document(lm, store, task.id, label)
            results[label][task.id] = run_task(lm, ctx, task, fmt, max_new_tokens)
            s = sizes[label]
            s["seconds"] += time.perf_counter() - t0
            stored, kv = version_bytes(store, version)
            s["stored"] += stored
            s["kv"] += kv
            s["tokens"] += version.n_tokens
            s["recipe"] = version.recipe
            if on_step:
                on_step(1)
        if on_task is not None and on_task(_result(labels, results, sizes, tasks[:n_done], per_token_fp16)):
            tasks = tasks[:n_done]
            break
    return _result(labels, results, sizes, tasks, per_token_fp16)


def _result(labels, results, sizes, tasks: list[Task], per_token_fp16: int) -> dict:
    versions = [summarise(l, results[l], results["full"], tasks, sizes[l], per_token_fp16)
                for l in labels if results[l]]
    return {"versions": versions, "n_tasks": len(tasks), "fp16_bytes_per_token": per_token_fp16,
            "tasks": [{"id": t.id, "kind": t.kind, "answer_kind": t.answer_kind, "split": t.split, "answer": t.answer,
                       "by_version": {l: results[l][t.id] for l in labels if t.id in results[l]}} for t in tasks]}


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 5) if xs else None


def _kind_stats(res: dict[str, dict], tasks: list[Task], kind: str) -> dict:
    ids = [t.id for t in tasks if t.kind == kind and t.id in res]
    if kind == "continuation":
        return {"n": len(ids), "nll": _mean([res[i]["nll"] for i in ids])}
    correct = sum(res[i]["correct"] for i in ids)
    out = {"n": len(ids), "correct": correct, "accuracy": round(correct / len(ids), 4) if ids else None,
           "answer_nll": _mean([res[i]["nll"] for i in ids])}
    if kind == "multifact":
        out["distracted"] = sum(res[i]["distracted"] for i in ids)
    return out


def summarise(label: str, res: dict, full: dict, tasks: list[Task], size: dict, per_token_fp16: int) -> dict:
    """Per-kind scores of one version, and ratios against the full cache on the SAME tasks."""
    out = {"label": label, "recipe": size["recipe"], "n_tasks": len(res), "eval_seconds": round(size["seconds"], 2)}
    ratios, paired = {}, {}
    for kind in KINDS:
        mine = _kind_stats(res, tasks, kind)
        ref = _kind_stats({i: full[i] for i in res if i in full}, tasks, kind)
        out[kind] = mine
        key = "nll" if kind == "continuation" else "accuracy"
        if mine.get(key) is not None and ref.get(key):
            ratios[kind] = round(mine[key] / ref[key], 4)
        if label != "full":
            paired[kind] = paired_vs_full(res, full, [t.id for t in tasks if t.kind == kind], kind)
    out["ratio_vs_full"] = ratios
    out["paired_vs_full"] = paired
    out["by_answer_kind"] = {k: answer_kind_vs_full(res, full, [t.id for t in tasks if t.answer_kind == k], k)
                             for k in ANSWER_KINDS if label != "full" and any(t.answer_kind == k for t in tasks)}
    tokens = size["tokens"]
    out["bytes_per_token"] = round(size["stored"] / tokens, 1) if tokens else None
    out["kv_bytes_per_token"] = round(size["kv"] / tokens, 1) if tokens else None
    out["fp16_fraction"] = round(size["kv"] / (tokens * per_token_fp16), 4) if tokens else None
    out["stored_fp16_fraction"] = round(size["stored"] / (tokens * per_token_fp16), 4) if tokens else None
    out["totals"] = {k: size[k] for k in ("stored", "kv", "tokens", "seconds")}  # what merge_results sums
    return out


def merge_results(parts: list[dict], order: list[str] | None = None) -> dict:
    """One result from several ``evaluate_tasks`` results over disjoint task sets (shards of one
    run, e.g. ``bench/quality.py --shard I/N`` on separate processes): per-task records are
    pooled and every score and ratio is recomputed over the union, as if one process had run it.
    ``order`` (task ids) fixes the order of the merged tasks."""
    if not parts:
        raise ValueError("nothing to merge")
    labels = list(dict.fromkeys(v["label"] for p in parts for v in p["versions"]))
    results: dict[str, dict[str, dict]] = {l: {} for l in labels}
    sizes = {l: {"stored": 0, "kv": 0, "tokens": 0, "seconds": 0.0, "recipe": {}} for l in labels}
    tasks: dict[str, Task] = {}
    for p in parts:
        for t in p["tasks"]:
            if t["id"] in tasks:
                raise ValueError(f"task {t['id']} is in more than one part")
            tasks[t["id"]] = Task(id=t["id"], kind=t["kind"], text="", answer=t["answer"],
                                  answer_kind=t.get("answer_kind") or "", split=t.get("split") or "")
            for l, rec in t["by_version"].items():
                results[l][t["id"]] = rec
        for v in p["versions"]:
            if "totals" not in v:
                raise ValueError(f"part without byte totals for {v['label']} (written by an older bench/quality.py)")
            s = sizes[v["label"]]
            for k in ("stored", "kv", "tokens", "seconds"):
                s[k] += v["totals"][k]
            s["recipe"] = v["recipe"]
    rank = {tid: i for i, tid in enumerate(order or [])}
    ordered = sorted(tasks.values(), key=lambda t: (rank.get(t.id, len(rank)), t.id))
    return _result(labels, results, sizes, ordered, parts[0]["fp16_bytes_per_token"])


def format_table(result: dict) -> str:
    """Plain-text table: accuracy always with its count."""
    head = (f"{'version':<30} {'needle acc (n)':>16} {'multi-fact acc (n)':>19} {'cont. NLL (n)':>15} "
            f"{'needle/full':>11} {'mf/full':>8} {'NLL/full':>8} {'B/token':>8} {'KV/fp16':>8}")
    lines = [head]
    for v in result["versions"]:
        n, m, c, r = v["needle"], v["multifact"], v["continuation"], v["ratio_vs_full"]
        f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
        lines.append(f"{v['label']:<30} {f(n['accuracy'], '.3f') + ' (' + str(n['n']) + ')':>16} "
                     f"{f(m['accuracy'], '.3f') + ' (' + str(m['n']) + ')':>19} {f(c['nll'], '.3f') + ' (' + str(c['n']) + ')':>15} "
                     f"{f(r.get('needle'), '.3f'):>11} {f(r.get('multifact'), '.3f'):>8} {f(r.get('continuation'), '.3f'):>8} "
                     f"{f(v['bytes_per_token'], '.0f'):>8} {f(v['fp16_fraction'], '.3f'):>8}")
    return "\n".join(lines)
