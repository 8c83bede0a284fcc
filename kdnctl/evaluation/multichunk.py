"""``kdnctl eval-compose``: how good are composed independent chunks, and how fast?

For every multi-chunk question (``examples/multichunk_qa.jsonl``: ``question``, ``answer``,
``aliases``, ``docs``, ``evidence`` sentences) the context is built from stored independent
chunks: the chunks holding the evidence sentences plus distractor chunks (other chunks of at
least ``min_tokens`` tokens, any document) up to ``n_chunks``, shuffled with a fixed seed.
The same context is then answered by

* naive concatenation (re-rotated keys, ``recompute=0``),
* selective recompute at each requested ratio (CacheBlend-style),
* a full prefill of ``header + chunks + question`` (no stored KV),

all in the same run. Fidelity to the full prefill: the greedy answer is identical, the first
token is the same, and KL(full || method) of the first-token distribution. Accuracy: the greedy answer contains the answer or an alias
(case-insensitive, normalised). TTFT counts from before the chunks are read from the store
(objects are read once beforehand so every method sees a warm OS page cache) to the first
token's logits; the full prefill starts its clock at its forward pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.hf import full_prefill_generate, generate
from ..errors import NotFoundError
from .jsonl import read_jsonl
from ..ingest.prompting import PromptFormat
from ..engine.independent import context_token_ids
from ..engine.retrieval import ChunkInfo, compose_chunks, list_chunks, load_chunk_bundles
from .qa import QAItem, is_correct


@dataclass
class MultiQA:
    question: str
    answer: str
    aliases: list[str] = field(default_factory=list)
    docs: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)


@dataclass
class Case:
    item: MultiQA
    chunks: list[ChunkInfo]
    evidence_ids: list[str]
    unmatched_evidence: int = 0


def load_multichunk_qa(path: str | Path) -> list[MultiQA]:
    return read_jsonl(path, lambda o: MultiQA(o["question"], o["answer"], list(o.get("aliases", [])),
                                              list(o.get("docs", [])), list(o.get("evidence", []))),
                      what="QA", fields='{"question", "answer", "aliases"?, "docs", "evidence"}')


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def build_cases(store, items: list[MultiQA], *, n_chunks: int = 4, min_tokens: int = 256, seed: int = 0,
                fingerprint: str | None = None) -> list[Case]:
    """Evidence chunks + distractors (>= n_chunks in all, at least one distractor), shuffled."""
    unique: dict[str, ChunkInfo] = {}
    for c in list_chunks(store, fingerprint=fingerprint):
        unique.setdefault(c.content_hash, c)
    pool = list(unique.values())
    if not pool:
        raise NotFoundError("the store has no independent chunks",
                            hint="give a corpus, or run `kdnctl ingest --mode independent` first", param="corpus")
    texts = {c.content_hash: _norm(c.text(store)) for c in pool}
    cases = []
    for qi, item in enumerate(items):
        evidence: list[ChunkInfo] = []
        unmatched = 0
        for sentence in item.evidence:
            s = _norm(sentence)
            hits = [c for c in pool if s in texts[c.content_hash]]
            hits.sort(key=lambda c: c.doc_id not in item.docs)
            if not hits:  # split across chunks or reformatted: best word overlap within the docs
                unmatched += 1
                scope = [c for c in pool if c.doc_id in item.docs] or pool
                hits = [max(scope, key=lambda c: len(_words(sentence) & _words(texts[c.content_hash])))]
            if hits[0] not in evidence:
                evidence.append(hits[0])
        rng = random.Random(f"{seed}:{qi}")
        others = [c for c in pool if c not in evidence]
        big = [c for c in others if c.n_tokens >= min_tokens]
        candidates = big if len(big) >= n_chunks else others
        want = max(n_chunks - len(evidence), 1)
        chosen = evidence + rng.sample(candidates, min(want, len(candidates)))
        rng.shuffle(chosen)
        cases.append(Case(item, chosen, [c.id for c in evidence], unmatched))
    return cases


def _method_name(r: float | None) -> str:
    if r is None:
        return "full prefill"
    return "naive concat" if r == 0 else f"recompute {r:g}"


def evaluate_compose(lm: LoadedModel, store, cases: list[Case], *, recompute_levels=(0.0, 0.15, 0.3), max_new_tokens: int = 24,
                     on_step=None) -> dict:
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    methods: list[float | None] = [float(r) for r in recompute_levels] + [None]
    score = {m: {"correct": 0, "agree_full": 0, "ttft": [], "load": [], "recomputed": [], "kl": [], "top1": 0}
             for m in methods}
    rows = []
    generate(lm, None, fmt.question_ids(lm.tokenizer, "warm-up"), max_new_tokens=1)  # first-call overheads
    for case in cases:
        qa = QAItem(",".join(case.item.docs), case.item.question, case.item.answer, case.item.aliases)
        suffix = fmt.question_ids(lm.tokenizer, case.item.question)
        # Read once untimed: every method then reads equally warm objects (OS page cache).
        header, bundles, _ = load_chunk_bundles(lm, store, case.chunks)
        token_ids = context_token_ids(header, bundles)
        context_tokens = len(token_ids)
        del header, bundles
        answers, first = {}, {}
        for m in methods:
            if m is None:
                res = full_prefill_generate(lm, token_ids, suffix, max_new_tokens=max_new_tokens)
                load_s, recomputed = 0.0, context_tokens
            else:
                info: dict = {}
                t0 = time.perf_counter()
                ctx = compose_chunks(lm, store, case.chunks, suffix, m, info=info)
                res = generate(lm, ctx, suffix, max_new_tokens=max_new_tokens, t0=t0)
                load_s, recomputed = ctx.load_s, info.get("recomputed_tokens", 0)
                del ctx
            first[m] = torch.log_softmax(res.first_logits.float(), dim=-1)
            ok = is_correct(res.answer, qa)
            s = score[m]
            s["correct"] += ok
            s["ttft"].append(res.ttft_s)
            s["load"].append(load_s)
            s["recomputed"].append(recomputed)
            answers[_method_name(m)] = {"answer": res.answer, "correct": ok, "ttft_s": round(res.ttft_s, 4)}
            if on_step:
                on_step(1)
        full_answer = answers[_method_name(None)]["answer"]
        ref = first[None]
        for m in methods:
            score[m]["agree_full"] += answers[_method_name(m)]["answer"] == full_answer
            kl = float((ref.exp() * (ref - first[m])).sum())
            score[m]["kl"].append(kl)
            score[m]["top1"] += int(first[m].argmax()) == int(ref.argmax())
            answers[_method_name(m)]["first_token_kl"] = round(kl, 5)
        rows.append({"question": case.item.question, "answer": case.item.answer, "chunks": [c.id for c in case.chunks],
                     "evidence_chunks": case.evidence_ids, "unmatched_evidence": case.unmatched_evidence,
                     "context_tokens": context_tokens, "methods": answers})
    n = len(cases)
    mean = lambda xs: round(statistics.fmean(xs), 4) if xs else None  # noqa: E731
    table = []
    for m in methods:
        s = score[m]
        table.append({"method": _method_name(m), "recompute": m, "accuracy": round(s["correct"] / n, 4) if n else None,
                      "correct": s["correct"], "n": n, "ttft_mean_s": mean(s["ttft"]),
                      "ttft_median_s": round(statistics.median(s["ttft"]), 4) if s["ttft"] else None,
                      "load_mean_s": mean(s["load"]), "recomputed_tokens_mean": mean(s["recomputed"]),
                      "same_answer_as_full": round(s["agree_full"] / n, 4) if n else None,
                      "first_token_kl_mean": mean(s["kl"]),
                      "first_token_same_as_full": round(s["top1"] / n, 4) if n else None})
    ctx_tokens = [r["context_tokens"] for r in rows]
    return {"methods": table, "cases": rows,
            "summary": {"questions": n, "context_tokens_mean": mean(ctx_tokens),
                        "chunks_per_question_mean": mean([len(c.chunks) for c in cases]),
                        "multi_evidence_chunk_questions": sum(len(c.evidence_ids) > 1 for c in cases),
                        "unmatched_evidence": sum(c.unmatched_evidence for c in cases)}}
