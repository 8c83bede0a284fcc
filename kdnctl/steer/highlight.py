"""Highlight SPECs -> exact token ranges of a stored document.

A SPEC names the text to emphasise (``kdnctl edit --steer SPEC``, repeatable; spans are unioned):

* ``TEXT``            every (non-overlapping) occurrence of TEXT, case-sensitive;
* ``lit:TEXT``        the same, for a TEXT that itself starts with ``re:``/``markers:``/``lit:``;
* ``re:PATTERN``      every non-empty match of the Python regex PATTERN (``(?i)`` etc. allowed);
* ``markers:FILE``    FILE holds the document text with ``<<`` and ``>>`` around the highlighted
  regions; with the markers removed it must equal the stored text exactly (no nesting, no
  escaping: a document that itself contains ``<<``/``>>`` cannot use marker files). The markers
  are never prefilled: the edit keeps the stored KV (made from the unmarked text) and only uses
  the file to locate spans.

Character spans become token ranges through the tokenizer's offset mapping over the document
text. The stored tokens are ``header + document`` (see :class:`kdnctl.ingest.prompting.PromptFormat`),
so the mapping is only exact if tokenizing the stored text alone reproduces the stored document
tokens; that is checked and a mismatch is an error. A token is highlighted if its character range
overlaps a span (so a span starting mid-word includes that word's token). Positions returned are
absolute (header tokens included), the coordinates of ``positions``/``layers.{i}.positions``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InputError, UnsupportedError, UsageError

OPEN, CLOSE = "<<", ">>"


@dataclass
class SpanMatch:
    spec: str
    char_ranges: list[tuple[int, int]]
    token_ranges: list[tuple[int, int]]  # absolute, end exclusive


@dataclass
class Highlight:
    mask: torch.Tensor  # bool [T] over absolute positions; True = highlighted
    matches: list[SpanMatch] = field(default_factory=list)

    @property
    def n_highlighted(self) -> int:
        return int(self.mask.sum())

    def as_dict(self) -> dict:
        return {
            "n_tokens": int(self.mask.numel()),
            "n_highlighted": self.n_highlighted,
            "spans": [{"spec": m.spec, "chars": [list(c) for c in m.char_ranges],
                       "tokens": [list(t) for t in m.token_ranges]} for m in self.matches],
        }


def parse_markers(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """Strip ``<<``/``>>`` markers; returns (clean text, char ranges in the clean text)."""
    out: list[str] = []
    ranges: list[tuple[int, int]] = []
    pos = 0  # position in the clean text
    i = 0
    start: int | None = None
    while i < len(marked):
        if marked.startswith(OPEN, i):
            if start is not None:
                raise UsageError(f"nested {OPEN} at character {i} of the markers file")
            start = pos
            i += len(OPEN)
        elif marked.startswith(CLOSE, i):
            if start is None:
                raise UsageError(f"{CLOSE} without a matching {OPEN} at character {i} of the markers file")
            if pos > start:
                ranges.append((start, pos))
            start = None
            i += len(CLOSE)
        else:
            out.append(marked[i])
            pos += 1
            i += 1
    if start is not None:
        raise UsageError(f"unclosed {OPEN} in the markers file")
    return "".join(out), ranges


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def char_spans(spec: str, text: str) -> list[tuple[int, int]]:
    """Character ranges of ``text`` that ``spec`` selects (may be empty)."""
    if spec.startswith("re:"):
        try:
            pattern = re.compile(spec[3:])
        except re.error as exc:
            raise UsageError(f"bad regex in span {spec!r}: {exc}", param="steer") from None
        return [m.span() for m in pattern.finditer(text) if m.end() > m.start()]
    if spec.startswith("markers:"):
        path = Path(spec[len("markers:"):])
        if not path.is_file():
            raise InputError(f"markers file {path} does not exist")
        try:
            marked = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError(f"markers file {path} is not UTF-8") from None
        clean, ranges = parse_markers(marked)
        if clean != text:
            at = _first_difference(clean, text)
            raise UsageError(
                f"markers file {path} without its markers differs from the stored document text "
                f"(first difference at character {at})",
                hint="the file must be the ingested document with only << >> added",
            )
        return ranges
    literal = spec[4:] if spec.startswith("lit:") else spec
    if not literal:
        raise UsageError("empty span", param="steer")
    out, i = [], text.find(literal)
    while i >= 0:
        out.append((i, i + len(literal)))
        i = text.find(literal, i + len(literal))
    return out


def token_offsets(tokenizer, text: str, stored_ids: list[int], n_header: int) -> list[tuple[int, int]]:
    """Character offsets of the document tokens (stored_ids[n_header:]); checks that the text
    re-tokenizes to exactly the stored tokens."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if ids != list(stored_ids[n_header:]):
        raise UnsupportedError(
            "the stored document text does not re-tokenize to the stored tokens, so span offsets "
            "would be inexact",
            hint="re-ingest the document (split segments of over-long documents are not supported)",
        )
    return [tuple(o) for o in enc["offset_mapping"]]


def _token_ranges(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], n_header: int) -> list[tuple[int, int]]:
    out = []
    for s, e in spans:
        toks = [j for j, (a, b) in enumerate(offsets) if b > a and a < e and b > s]
        if toks:
            out.append((n_header + toks[0], n_header + toks[-1] + 1))
    return out


def find_highlight(tokenizer, fmt, text: str, stored_ids: list[int], specs: list[str]) -> Highlight:
    """Map every SPEC to token ranges of the stored document; union them into one mask.

    ``stored_ids`` are the stored header + document tokens; ``fmt`` is the PromptFormat used at
    ingest (its header tokens must be the prefix of ``stored_ids``)."""
    if not specs:
        raise UsageError("no span given", param="steer")
    header = fmt.header_ids(tokenizer)
    n_header = len(header)
    if list(stored_ids[:n_header]) != header:
        raise UnsupportedError("the stored tokens do not start with this tokenizer's prompt header",
                               hint="re-ingest the document with this kdnctl and model")
    offsets = token_offsets(tokenizer, text, stored_ids, n_header)
    mask = torch.zeros(len(stored_ids), dtype=torch.bool)
    matches = []
    for spec in specs:
        spans = char_spans(spec, text)
        ranges = _token_ranges(offsets, spans, n_header)
        if not ranges:
            raise UsageError(f"span {spec!r} matches nothing in the document",
                             hint="spans are case-sensitive literal text; use re:PATTERN for a regex", param="steer")
        for s, e in ranges:
            mask[s:e] = True
        matches.append(SpanMatch(spec, spans, ranges))
    return Highlight(mask, matches)
