"""``kdnctl eval``: how close are the answers from a stored version to the full cache's?

For every version label and every document, on (a) a QA file and (b) automatic probes built
from the documents themselves (no hand labels):

* accuracy      the greedy answer contains the reference answer (or an alias), normalised;
* answer_nll    mean -log p of the reference answer tokens, teacher-forced after the question;
* kl            KL(full || version) of the next-token distributions over those answer positions;
* probe_nll/kl  the same two numbers on cloze probes: a sentence of the document is cut in half,
                the model is asked to complete it, and the held-back half is scored;
* bytes_per_token and compression_ratio from the stored objects.

The full cache (label ``full``) is the reference for KL and is always evaluated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import random
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.hf import LoadedContext, forward_suffix, generate, load_document
from ..errors import NotFoundError
from .jsonl import read_jsonl
from ..ingest.prompting import PromptFormat

PROBE_TEMPLATE = "Complete this sentence from the document: {head}"


@dataclass
class QAItem:
    doc: str
    question: str
    answer: str
    aliases: list[str] = field(default_factory=list)


def load_qa(path: str | Path) -> list[QAItem]:
    return read_jsonl(path, lambda o: QAItem(o["doc"], o["question"], o["answer"], list(o.get("aliases", []))),
                      what="QA", fields='{"doc", "question", "answer"}')


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower().replace("\u2212", "-")
    text = re.sub(r"[^\w%.,:/-]+", " ", text)
    return re.sub(r"\s+", " ", text).strip(" .,")


def is_correct(generated: str, item: QAItem) -> bool:
    got = normalise(generated)
    return any(normalise(a) and normalise(a) in got for a in [item.answer, *item.aliases])


def cloze_probes(text: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(head, tail) pairs from sentences of 10+ words, chosen with a fixed seed."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text) if len(s.split()) >= 10]
    rng = random.Random(seed)
    picked = rng.sample(sentences, min(n, len(sentences)))
    out = []
    for s in picked:
        words = s.split()
        cut = len(words) // 2
        out.append((" ".join(words[:cut]), " " + " ".join(words[cut:])))
    return out


def _scored_logits(lm: LoadedModel, ctx: LoadedContext, prompt_ids: list[int], target_ids: list[int]) -> torch.Tensor:
    """Log-probs [len(target), V] of the positions that predict ``target_ids``."""
    logits, _ = forward_suffix(lm, ctx, prompt_ids + target_ids)
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start : start + len(target_ids)], dim=-1)


def _nll_kl(logp: torch.Tensor, ref: torch.Tensor | None, target_ids: list[int]) -> tuple[float, float]:
    tgt = torch.tensor(target_ids)
    nll = -logp.gather(1, tgt[:, None]).mean().item()
    kl = 0.0 if ref is None else (ref.exp() * (ref - logp)).sum(-1).mean().item()
    return nll, kl


def _score_vs_full(lm: LoadedModel, ctx: LoadedContext, prompt_ids: list[int], target_ids: list[int], label: str,
                   refs: list[torch.Tensor], j: int) -> tuple[float, float]:
    """NLL of ``target_ids`` after ``prompt_ids``, and KL vs the ``full`` version's distribution
    for the same prompt (``refs[j]``; the ``full`` version, evaluated first, appends it)."""
    logp = _scored_logits(lm, ctx, prompt_ids, target_ids)
    if label == "full":
        refs.append(logp)
        return _nll_kl(logp, None, target_ids)
    return _nll_kl(logp, refs[j], target_ids)


@dataclass
class VersionScore:
    label: str
    correct: int = 0
    n: int = 0
    nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    probe_nll: list[float] = field(default_factory=list)
    probe_kl: list[float] = field(default_factory=list)
    bytes: int = 0
    tokens: int = 0
    recipe: dict = field(default_factory=dict)

    def as_dict(self, full_bytes: int) -> dict:
        mean = lambda xs: round(sum(xs) / len(xs), 5) if xs else None  # noqa: E731
        return {"label": self.label, "accuracy": round(self.correct / self.n, 4) if self.n else None,
                "answer_nll": mean(self.nll), "kl": mean(self.kl), "probe_nll": mean(self.probe_nll),
                "probe_kl": mean(self.probe_kl), "n_questions": self.n,
                "bytes_per_token": round(self.bytes / self.tokens, 1) if self.tokens else None,
                "compression_ratio": round(full_bytes / self.bytes, 3) if self.bytes else None,
                "recipe": self.recipe}


def evaluate(lm: LoadedModel, store, labels: list[str], *, qa: list[QAItem] | None = None, docs: list[str] | None = None,
             probes_per_doc: int = 4, max_new_tokens: int = 40, on_step=None) -> dict:
    """Evaluate ``labels`` (``full`` is always added first) on QA items and cloze probes."""
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    tok = lm.tokenizer
    qa = qa or []
    doc_ids = docs or sorted({i.doc for i in qa} or {d.doc_id for d in store.list_documents()})
    labels = ["full"] + [l for l in labels if l != "full"]
    scores = {l: VersionScore(l) for l in labels}
    for doc_id in doc_ids:
        doc = store.get_document(doc_id)
        text = store.read_object(doc.text_object).decode("utf-8")
        items = [i for i in qa if i.doc == doc_id]
        probes = cloze_probes(text, probes_per_doc)
        ref_q: list[torch.Tensor] = []
        ref_p: list[torch.Tensor] = []
        for label in labels:
            try:
                version = store.get_version(doc_id, label)
            except NotFoundError:
                continue
            sc = scores[label]
            sc.recipe = version.recipe
            sc.bytes += version.nbytes
            sc.tokens += version.n_tokens
            ctx = load_document(lm, store, doc_id, label)
            for j, item in enumerate(items):
                suffix = fmt.question_ids(tok, item.question)
                answer = generate(lm, ctx, suffix, max_new_tokens=max_new_tokens).answer
                sc.correct += is_correct(answer, item)
                sc.n += 1
                target = tok(item.answer, add_special_tokens=False).input_ids
                nll, kl = _score_vs_full(lm, ctx, suffix, target, label, ref_q, j)
                sc.nll.append(nll)
                sc.kl.append(kl)
                if on_step:
                    on_step(1)
            for j, (head, tail) in enumerate(probes):
                prompt = fmt.question_ids(tok, PROBE_TEMPLATE.format(head=head))
                target = tok(tail, add_special_tokens=False).input_ids
                nll, kl = _score_vs_full(lm, ctx, prompt, target, label, ref_p, j)
                sc.probe_nll.append(nll)
                sc.probe_kl.append(kl)
    full_bytes = scores["full"].bytes
    return {"versions": [s.as_dict(full_bytes) for s in scores.values() if s.tokens],
            "documents": doc_ids}
