"""Steering edits (PASTA) on stored KV: the shared machinery and the registry of edit modes.

PASTA (Zhang et al., 2023, "Tell Your Model Where to Attend") scales the attention that chosen
(layer, query head) pairs pay to every token OUTSIDE the highlighted spans by ``alpha`` and
renormalises; that is exactly adding ``log(alpha)`` to those attention logits (0 inside the
spans). kdnctl stores that additive bias per chunk as ``layers.{i}.bias`` float16 ``[H_q, T_i]``
over the chunk's cached tokens, and kdnctl's attention function adds it at every decode step.

Edit modes (one file each, looked up in ``EDITS``):

* ``bias``      (:mod:`.pasta_bias`) copy the source version's K/V unchanged and add the bias:
  the steering acts on the question and the answer tokens (cheap, works on any source version,
  pruned and quantized ones included);
* ``reprefill`` (:mod:`.reprefill`) recompute the document's KV with the bias active during the
  prefill as well (exact PASTA over the document: later layers' K/V change), then store that KV
  with the bias.

``steer_document`` loads the source version, maps the SPECs to token ranges, runs the edit and
commits a new version (``parent`` = source label, ``recipe`` = the source's steps + this step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import importlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..format.bundle import KVBundle, decode_bundle
from ..errors import ModelMismatchError, UnsupportedError, UsageError
from ..ingest.prompting import PromptFormat
from ..store import Store, VersionRecord
from ..versions import derive_version, existing_version
from .heads import heads_list
from .highlight import Highlight, find_highlight

EDITS: dict[str, str] = {
    "bias": "kdnctl.steer.pasta_bias:PastaBiasEdit",
    "reprefill": "kdnctl.steer.reprefill:ReprefillEdit",
}
DEFAULT_ALPHA = 0.01


def get_edit(mode: str) -> "SteerEdit":
    if mode not in EDITS:
        raise UsageError(f"unknown steering mode {mode!r}", hint=f"choose one of: {', '.join(EDITS)}")
    module, cls = EDITS[mode].split(":")
    return getattr(importlib.import_module(module), cls)()


def validate_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not (0 < alpha <= 1) or math.isnan(alpha):
        raise UsageError(f"alpha must be in (0, 1], got {alpha}", hint="PASTA uses 0.01; 1 changes nothing", param="alpha")
    return alpha


@dataclass
class SteerSpec:
    spans: list[str]
    heads: dict[int, list[int]]
    alpha: float = DEFAULT_ALPHA
    mode: str = "bias"
    heads_spec: str = ""

    def __post_init__(self) -> None:
        self.alpha = validate_alpha(self.alpha)
        if self.mode not in EDITS:
            raise UsageError(f"unknown steering mode {self.mode!r}", hint=f"choose one of: {', '.join(EDITS)}")
        if not self.heads:
            raise UsageError("no steered heads")

    def step(self, source: str) -> dict[str, Any]:
        return {"step": "steer", "source": source, "mode": self.mode, "spans": list(self.spans),
                "alpha": self.alpha, "heads": heads_list(self.heads), "heads_spec": self.heads_spec}


def pasta_bias(highlight: torch.Tensor, positions: torch.Tensor, heads: list[int], n_q_heads: int,
               alpha: float) -> torch.Tensor:
    """Bias float32 ``[H_q, T_i]`` for one layer of one chunk.

    ``highlight`` bool [T_doc] over absolute positions; ``positions`` int64 [H_kv, T_i], the
    absolute positions each KV head holds (a query head uses its GQA group's positions);
    ``heads`` the steered query heads: ``log(alpha)`` outside the spans, 0 inside; other heads 0."""
    h_kv = positions.shape[0]
    group = n_q_heads // h_kv
    inside = highlight[positions].repeat_interleave(group, dim=0)  # [H_q, T_i]
    out = torch.zeros(n_q_heads, positions.shape[1], dtype=torch.float32)
    value = math.log(alpha)
    for h in heads:
        out[h] = torch.where(inside[h], torch.tensor(0.0), torch.tensor(value, dtype=torch.float32))
    return out


@dataclass
class EditContext:
    lm: Any
    doc_id: str
    source: VersionRecord
    bundles: list[KVBundle]
    token_ids: list[int]
    highlight: Highlight
    spec: SteerSpec

    @property
    def n_q_heads(self) -> int:
        return int(self.lm.summary["n_q_heads"])

    def layer_bias(self, bundle: KVBundle, layer: int) -> torch.Tensor:
        return pasta_bias(self.highlight.mask, bundle.layer_positions(layer), self.spec.heads[layer],
                          self.n_q_heads, self.spec.alpha)


class SteerEdit:
    """One edit mode: new tensors for every chunk bundle of the source version."""

    name = ""

    def apply(self, ctx: EditContext) -> list[dict[str, torch.Tensor]]:  # pragma: no cover
        raise NotImplementedError


@dataclass
class SteerResult:
    doc_id: str
    label: str
    status: str  # "steered" | "unchanged"
    mode: str
    n_tokens: int = 0
    n_highlighted: int = 0
    bytes: int = 0
    seconds: float = 0.0
    spans: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"doc": self.doc_id, "label": self.label, "status": self.status, "mode": self.mode,
                "n_tokens": self.n_tokens, "n_highlighted": self.n_highlighted, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "spans": self.spans}


def default_label(source: str, spec: SteerSpec) -> str:
    label = f"{source}+steer"
    if spec.mode != "bias":
        label += f"-{spec.mode}"
    if spec.alpha != DEFAULT_ALPHA:
        label += f"-a{spec.alpha:g}"
    return label


def load_source(store: Store, lm: LoadedModel, doc_id: str, source: str) -> tuple[VersionRecord, list[KVBundle], str]:
    """(version, decoded chunk bundles, stored document text)."""
    src = store.get_version(doc_id, source)
    if src.fingerprint != lm.fingerprint:
        raise ModelMismatchError(f"{doc_id} [{source}] was made with model {src.fingerprint[:12]}, "
                                 f"the loaded model is {lm.fingerprint[:12]}")
    if src.mode != "prefix":
        raise UnsupportedError(f"{doc_id} [{source}] is a {src.mode!r} version; steering edits need a prefix version",
                               hint="steer the document's `full` version")
    bundles = [decode_bundle(store.read_object(c.object), expect_fingerprint=lm.fingerprint)
               for c in sorted(src.chunks, key=lambda c: c.index)]
    doc = store.get_document(doc_id, src.doc_version)
    text = store.read_object(doc.text_object).decode("utf-8")
    return src, bundles, text


def steer_document(store: Store, lm: LoadedModel, doc_id: str, spec: SteerSpec, *, source: str = "full",
                   label: str | None = None) -> SteerResult:
    """Apply a steering edit to ``doc_id``'s ``source`` version and commit it as ``label``."""
    t0 = time.perf_counter()
    label = label or default_label(source, spec)
    if label == source:
        raise UsageError(f"label {label!r} is the source version's label", hint="choose another label", param="label")
    with store.writer():
        src, bundles, text = load_source(store, lm, doc_id, source)
        step = spec.step(source)
        done = existing_version(store, doc_id, label, step, doc_version=src.doc_version)
        if done is not None:
            return SteerResult(doc_id, label, "unchanged", spec.mode, src.n_tokens,
                               bytes=done.nbytes, seconds=time.perf_counter() - t0)
        token_ids = [int(t) for b in bundles for t in b.token_ids.tolist()]
        fmt = PromptFormat.for_tokenizer(lm.tokenizer)
        highlight = find_highlight(lm.tokenizer, fmt, text, token_ids, spec.spans)
        ctx = EditContext(lm, doc_id, src, bundles, token_ids, highlight, spec)
        new_tensors = get_edit(spec.mode).apply(ctx)
        ranges = [list(r) for m in highlight.matches for r in m.token_ranges]
        steer = {"mode": spec.mode, "alpha": spec.alpha, "heads": heads_list(spec.heads), "token_ranges": ranges}
        record = derive_version(store, src, label, step, bundles, new_tensors, meta={"steer": steer})
    return SteerResult(doc_id, label, "steered", spec.mode, len(token_ids), highlight.n_highlighted, record.nbytes,
                       time.perf_counter() - t0, highlight.as_dict()["spans"])
