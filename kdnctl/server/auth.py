"""Bearer tokens and namespaces: who may see which documents.

A grant G covers doc ids equal to G or under "G/": `acme` covers `acme/faq.md` and
`acme/eu/x.md` but not `acmecorp/y.md`, so a prefix can never leak into a sibling."""

from __future__ import annotations

import dataclasses
import hmac
import os
from pathlib import Path

from starlette.requests import Request

from ..errors import UsageError


def _grant(raw: str, where: str) -> str:
    g = raw.strip()
    if g == "*":
        return g
    name = g.strip("/")
    if not name:  # "/" once meant "everything" by accident: a grant must name a namespace or be *
        raise UsageError(f"{where}: grant {raw!r} names no namespace", hint="write * to grant every document")
    if "\x00" in name or any(part in ("", ".", "..") for part in name.split("/")):
        raise UsageError(f"{where}: malformed grant {raw!r}")
    return name


def load_tokens(path: str | os.PathLike) -> dict[str, list[str]]:
    """Parse a token file: one ``TOKEN grant1,grant2`` per line, ``#`` comments, ``*`` = all."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read token file {path}: {exc}") from None
    tokens: dict[str, list[str]] = {}
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"token file {path} line {n}"
        if len(parts) != 2:
            raise UsageError(f"{where}: expected `TOKEN namespace1,namespace2`")
        token = parts[0]
        grants = [_grant(g, where) for g in parts[1].split(",") if g.strip()]
        if token in tokens:
            raise UsageError(f"{where}: duplicate token")
        if not grants:
            raise UsageError(f"{where}: no namespaces")
        tokens[token] = grants
    if not tokens:
        raise UsageError(f"token file {path} holds no tokens", hint="one `TOKEN namespace,...` per line; `*` = all")
    return tokens


@dataclasses.dataclass(frozen=True)
class Access:
    """What one request may see. ``grants=None`` means everything (no auth or a ``*`` token)."""

    grants: tuple[str, ...] | None

    @property
    def unrestricted(self) -> bool:
        return self.grants is None

    def sees(self, doc_id: str) -> bool:
        if self.grants is None:
            return True
        return any(doc_id == g or doc_id.startswith(g + "/") for g in self.grants)

    @property
    def filter(self):
        """The predicate to hand to the store (None = no filtering)."""
        return None if self.grants is None else self.sees


def authorize(request: Request, tokens: dict[str, list[str]] | None) -> Access | None:
    if tokens is None:
        return Access(None)
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return None
    presented_b = presented.strip().encode("utf-8", "surrogateescape")
    found = None
    for token, grants in tokens.items():
        # compare against every token (no early exit) so timing does not reveal a prefix
        if hmac.compare_digest(token.encode(), presented_b):
            found = grants
    if found is None:
        return None
    return Access(None if "*" in found else tuple(found))
