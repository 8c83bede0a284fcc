"""``kdnctl eval-steer``: does a steering edit make the model follow the highlighted text?

The task set (``examples/steering/tasks.jsonl``) holds short documents, each with one
``highlight`` (an instruction such as "answer in capital letters", or a counterfactual fact), a
``question`` and a mechanical ``check`` of the answer. Every task document is ingested into the
given store (idempotent), then answered from:

* the source version without any edit (``none``);
* the source version steered with ``kdnctl edit --steer HIGHLIGHT`` for every requested mode
  (``bias``, ``reprefill``) and alpha, each committed as a real version and loaded back through
  the engine exactly as ``kdnctl ask --version LABEL`` does.

Accuracy = share of tasks whose greedy answer passes its check (``score_check``, the same
semantics as ``examples/check_examples.py``), overall and per task kind.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import InputError
from ..steer.checks import score_check
from .jsonl import read_jsonl

CHECK_TYPES = {"contains", "contains_any", "uppercase", "lowercase", "word_count_max", "starts_with", "ends_with"}


@dataclass
class SteerTask:
    id: str
    kind: str
    text: str
    highlight: str
    question: str
    check: dict


def load_tasks(path: str | Path) -> list[SteerTask]:
    tasks = read_jsonl(path, lambda o: SteerTask(o["id"], o.get("kind", ""), o["text"], o["highlight"], o["question"],
                                                 dict(o["check"])),
                       what="task", fields='{"id", "text", "highlight", "question", "check"}')
    for n, task in enumerate(tasks, 1):
        if task.check.get("type") not in CHECK_TYPES:
            raise InputError(f"{path}: task {n} ({task.id}): unknown check type {task.check.get('type')!r}")
    if not tasks:
        raise InputError(f"task file {path} has no tasks")
    return tasks


def task_document(task: SteerTask):
    from ..ingest.corpus import Document

    return Document(task.id, task.text, f"task:{task.id}", hashlib.sha256(task.text.encode("utf-8")).hexdigest())


def _summary(mode: str, alpha: float | None, tasks: list[SteerTask], ok: list[bool]) -> dict:
    kinds: dict[str, list[bool]] = {}
    for t, c in zip(tasks, ok):
        kinds.setdefault(t.kind, []).append(c)
    return {"mode": mode, "alpha": alpha, "n_correct": sum(ok), "n": len(ok),
            "accuracy": round(sum(ok) / len(ok), 4) if ok else 0.0,
            "by_kind": {k: round(sum(v) / len(v), 4) for k, v in sorted(kinds.items())}}


def evaluate_steering(
    lm, store, tasks: list[SteerTask], *, heads: dict[int, list[int]], heads_spec: str = "",
    source: str = "full", alphas: tuple[float, ...] = (0.01, 0.1), modes: tuple[str, ...] = ("bias", "reprefill"),
    max_new_tokens: int = 32, chunk_tokens: int = 256, on_progress: Callable[[str], None] | None = None,
) -> dict:
    """Accuracy of the task set on ``source`` without edit and with each (mode, alpha) edit."""
    from ..engine.hf import generate, load_document
    from ..ingest import IngestOptions, ingest_documents
    from ..ingest.prompting import PromptFormat
    from ..steer.base import SteerSpec, steer_document

    t0 = time.perf_counter()
    ingest_documents(store, lm, [task_document(t) for t in tasks], IngestOptions(chunk_tokens=chunk_tokens))
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    runs = [("none", None)] + [(m, a) for m in modes for a in alphas]
    tag = hashlib.sha256(json.dumps(sorted(heads.items())).encode()).hexdigest()[:8]
    ok: dict[tuple, list[bool]] = {r: [] for r in runs}
    answers = []
    for task in tasks:
        suffix = fmt.question_ids(lm.tokenizer, task.question)
        row = {"id": task.id, "kind": task.kind}
        for mode, alpha in runs:
            label = source
            if mode != "none":
                spec = SteerSpec([task.highlight], heads, alpha=alpha, mode=mode, heads_spec=heads_spec)
                label = f"{source}+steer-{mode}-a{alpha:g}-{tag}"
                steer_document(store, lm, task.id, spec, source=source, label=label)
            answer = generate(lm, load_document(lm, store, task.id, label), suffix, max_new_tokens=max_new_tokens).answer
            passed = score_check(answer, task.check)
            ok[(mode, alpha)].append(passed)
            row["none" if mode == "none" else f"{mode}@{alpha:g}"] = {"answer": answer, "ok": passed}
        answers.append(row)
        if on_progress:
            on_progress(task.id)
    return {
        "source": source, "n_tasks": len(tasks), "heads": heads_spec,
        "n_heads": sum(len(h) for h in heads.values()), "max_new_tokens": max_new_tokens,
        "results": [_summary(m, a, tasks, ok[(m, a)]) for m, a in runs],
        "answers": answers, "seconds": round(time.perf_counter() - t0, 1),
    }


def format_table(report: dict) -> str:
    kinds = sorted({k for r in report["results"] for k in r["by_kind"]})
    head = f"{'mode':<10} {'alpha':>6} {'accuracy':>9} " + " ".join(f"{k:>12}" for k in kinds)
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        alpha = "-" if r["alpha"] is None else f"{r['alpha']:g}"
        acc = f"{r['n_correct']}/{r['n']} {r['accuracy']:.2f}"
        lines.append(f"{r['mode']:<10} {alpha:>6} {acc:>9} " + " ".join(f"{r['by_kind'].get(k, 0):>12.2f}" for k in kinds))
    return "\n".join(lines)
