"""The one reader of the evaluation sets' JSON-lines files (QA, multi-chunk QA, steering tasks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, TypeVar

from ..errors import InputError

T = TypeVar("T")


def read_jsonl(path: str | Path, build: Callable[[dict], T], *, what: str, fields: str) -> list[T]:
    """``build(obj)`` for every non-blank line of ``path``; a missing file or a line that is not
    JSON or lacks a field -> InputError naming the file and line (``what``: "QA", "task", ...;
    ``fields``: the expected fields, for the hint)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} file {path} does not exist")
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(build(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InputError(f"{path}:{n}: bad {what} line ({exc})", hint=f"each line: {fields}") from None
    return items
