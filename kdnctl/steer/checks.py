"""Mechanical checks of a steered answer (does it follow the highlighted instruction?), shared
by head profiling (:mod:`.profile`) and the steering evaluation (``kdnctl eval-steer``)."""

from __future__ import annotations

import re

_EDGE = " \t\r\n\"'`*.,!?;:()[]{}-"


def score_check(answer: str, check: dict) -> bool:
    """True if ``answer`` passes the mechanical ``check`` (see examples/check_examples.py)."""
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
