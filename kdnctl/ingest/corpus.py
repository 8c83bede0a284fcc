"""Read a corpus of documents from files and directories.

``read_corpus`` turns the PATHs a user passes into ``Document``s (text plus a stable id) and
``Skipped`` entries (what was not ingested and why). Only a PATH that does not exist is an
error: one bad file in a large folder should be reported, not abort the whole ingest.

Skip reasons the CLI can rely on:
- ``"unsupported type"`` (exactly) for files of another type found inside a directory; the
  CLI counts these rather than listing them. An explicitly named file of an unsupported type
  gets a longer reason that starts with ``"unsupported type"``.
- ``"empty file"``, ``"binary file"``, ``"not valid UTF-8 (byte 0x.. at offset N)"``,
  ``"no visible text"`` (HTML), ``"duplicate document id ..."``, ``"line N: ..."`` (JSONL).
Hidden files and directories (name starting with ".", e.g. .git, .kdn) under a directory
PATH are skipped silently and not reported at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from kdnctl.errors import InputError

__all__ = ["Document", "Skipped", "read_corpus", "html_to_text", "SUPPORTED_SUFFIXES"]

TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst"})
HTML_SUFFIXES = frozenset({".html", ".htm"})
JSONL_SUFFIXES = frozenset({".jsonl"})
SUPPORTED_SUFFIXES = TEXT_SUFFIXES | HTML_SUFFIXES | JSONL_SUFFIXES

_SNIFF_BYTES = 8192
# Above this share of control bytes in the first 8 KiB a file is treated as binary. Text
# files essentially never contain control bytes other than tab/newline/CR/FF/VT/ESC.
_CONTROL_RATIO = 0.10
_ALLOWED_CONTROLS = frozenset(b"\t\n\v\f\r\x1b")
_CONTROL_BYTES = frozenset(b for b in range(32) if b not in _ALLOWED_CONTROLS) | {0x7F}


@dataclass
class Document:
    doc_id: str
    text: str
    source: str
    content_sha256: str


@dataclass
class Skipped:
    path: str
    reason: str


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _normalise_newlines(text: str) -> str:
    # Line endings are not content: the same file checked out on Windows must hash the same.
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _binary_reason(data: bytes) -> str | None:
    # NUL never appears in real text, so look for it everywhere (cheap); the control-byte
    # ratio only needs a sample.
    if b"\x00" in data:
        return "binary file"
    sample = data[:_SNIFF_BYTES]
    if sample:
        controls = sum(1 for b in sample if b in _CONTROL_BYTES)
        if controls / len(sample) > _CONTROL_RATIO:
            return "binary file"
    return None


def _decode_utf8(data: bytes, base_offset: int = 0) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason); the reason names the first bad byte and its offset."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start]
        return None, f"not valid UTF-8 (byte 0x{bad:02x} at offset {base_offset + exc.start})"
    # A UTF-8 byte order mark is an encoding artefact, not text.
    if text.startswith("\ufeff"):
        text = text[1:]
    return text, None


# --------------------------------------------------------------------------- HTML


class _VisibleTextParser(HTMLParser):
    """Collects the text a browser would show, with block boundaries as newlines."""

    # Content of these is never rendered. "title" sits in <head>, but pages often omit <head>.
    SKIP = frozenset({"script", "style", "head", "title", "noscript", "template", "svg", "iframe"})
    # Tags allowed inside <head>; any other start tag means the browser has left <head>
    # (so a missing </head> does not swallow the whole page).
    HEAD_CONTENT = frozenset(
        {"title", "meta", "link", "style", "script", "base", "noscript", "template"}
    )
    # Blocks separated by a blank line.
    PARAGRAPH = frozenset(
        {"p", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre", "table", "ul", "ol",
         "dl", "figure", "hr"}
    )
    # Blocks separated by a single newline (list items, table cells and rows, ...).
    LINE = frozenset(
        {"div", "li", "tr", "td", "th", "caption", "dt", "dd", "section", "article", "header",
         "footer", "nav", "aside", "main", "figcaption", "form", "fieldset", "address",
         "details", "summary", "thead", "tbody", "tfoot", "body", "html", "option", "legend"}
    )

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)  # entities arrive already unescaped
        self._skip: list[str] = []
        self._pre = 0
        self._pre_start = False  # just after <pre>: browsers drop one leading newline there
        self._parts: list[str] = []
        self._line_empty = True  # nothing but spaces written on the current line
        self._pending = 0  # newlines owed before the next text

    # -- output helpers
    def _break(self, n: int) -> None:
        self._pending = max(self._pending, n)

    def _flush_break(self) -> None:
        if self._pending and self._parts:
            if self._parts[-1].endswith(" ") and not self._pre:
                self._parts[-1] = self._parts[-1].rstrip(" ")
            # Text from <pre> may already end in newlines; count them towards the break.
            last = self._parts[-1]
            have = len(last) - len(last.rstrip("\n"))
            self._parts.append("\n" * max(min(self._pending, 2) - have, 0))
            self._line_empty = True
        self._pending = 0

    def _write(self, text: str) -> None:
        if self._pre:
            if self._pre_start and text.startswith("\n"):
                text = text[1:]
            self._pre_start = False
            if not text:
                return
            self._flush_break()
            self._parts.append(text)
            self._line_empty = text.endswith("\n")
            return
        # Source whitespace (incl. newlines and &nbsp;) renders as one space.
        text = re.sub(r"[\s\xa0]+", " ", text)
        if self._line_empty or self._pending:
            text = text.lstrip(" ")
        elif self._parts and self._parts[-1].endswith(" ") and text.startswith(" "):
            text = text[1:]
        if not text:
            return
        self._flush_break()
        self._parts.append(text)
        self._line_empty = False

    # -- parser callbacks
    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._start(tag, self_closing=False)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._start(tag, self_closing=True)

    def _start(self, tag: str, *, self_closing: bool) -> None:
        if "head" in self._skip and tag not in self.HEAD_CONTENT:
            del self._skip[self._skip.index("head"):]
        if tag in self.SKIP:
            if not self_closing:
                self._skip.append(tag)
            return
        if self._skip:
            return
        if tag == "br":
            # Each <br> is its own line break, so <br><br> leaves a blank line.
            # (a blank line at most: more would only be layout, not content).
            self._pending = min(self._pending + 1, 2) if self._parts else 0
        elif tag in self.PARAGRAPH:
            self._break(2)
        elif tag in self.LINE:
            self._break(1)
        if tag == "pre" and not self_closing:
            self._pre += 1
            self._pre_start = True

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            if tag in self._skip:
                # Close the innermost open element of this name and anything left open in it.
                last = len(self._skip) - 1 - self._skip[::-1].index(tag)
                del self._skip[last:]
            return
        if self._skip:
            return
        if tag == "pre" and self._pre:
            self._pre -= 1
        if tag in self.PARAGRAPH:
            self._break(2)
        elif tag in self.LINE:
            self._break(1)

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self._write(data)

    # Comments, doctype, processing instructions and CDATA are ignored by not overriding
    # handle_comment/handle_decl/handle_pi/unknown_decl (the defaults drop them).

    def text(self) -> str:
        out = "".join(self._parts)
        lines = [line.rstrip(" ") for line in out.split("\n")]
        return "\n".join(lines).strip("\n")


def html_to_text(markup: str) -> str:
    """Visible text of an HTML document (stdlib parser only)."""
    parser = _VisibleTextParser()
    parser.feed(markup)
    parser.close()
    return parser.text()


# --------------------------------------------------------------------------- reading


class _Reader:
    """One read_corpus run: collects documents and skips, tracks ids seen so far."""

    def __init__(self) -> None:
        self.documents: list[Document] = []
        self.skipped: list[Skipped] = []
        self._seen: dict[str, str] = {}  # doc_id -> source that claimed it first

    def skip(self, path: str, reason: str) -> None:
        self.skipped.append(Skipped(path=path, reason=reason))

    def add(self, doc_id: str, text: str, source: str, skip_path: str) -> None:
        first = self._seen.get(doc_id)
        if first is not None:
            self.skip(skip_path, f"duplicate document id {doc_id!r} (already read from {first})")
            return
        self._seen[doc_id] = source
        self.documents.append(
            Document(doc_id=doc_id, text=text, source=source, content_sha256=_sha256_text(text))
        )

    # -- per PATH
    def read_path(self, path: Path) -> None:
        if path.is_dir():
            self._read_dir(path)
        elif path.is_file():
            self._read_file(path, path.name, explicit=True)
        else:
            self.skip(str(path), "not a regular file or directory")

    def _read_dir(self, root: Path) -> None:
        found: list[tuple[str, Path]] = []
        # Symlinked directories are not followed: they can loop or escape the PATH given.
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith("."):
                    continue
                full = Path(dirpath) / name
                found.append((full.relative_to(root).as_posix(), full))
        # Sort on the id so the order does not depend on the file system's listing order.
        for rel, full in sorted(found):
            self._read_file(full, rel, explicit=False)

    def _read_file(self, path: Path, doc_id: str, *, explicit: bool) -> None:
        where = str(path)
        suffix = path.suffix.lower()
        if suffix not in SUPPORTED_SUFFIXES:
            if explicit:
                supported = ", ".join(sorted(SUPPORTED_SUFFIXES))
                what = f"'{path.suffix}'" if path.suffix else "(no extension)"
                self.skip(where, f"unsupported type {what} (supported: {supported})")
            else:
                self.skip(where, "unsupported type")
            return
        if not path.is_file():  # e.g. a dangling symlink found while walking
            self.skip(where, "not a regular file")
            return
        try:
            doc_id.encode("utf-8")
        except UnicodeEncodeError:
            self.skip(where, "file name is not valid UTF-8")
            return
        try:
            data = path.read_bytes()
        except OSError as exc:
            self.skip(where, f"cannot read ({exc.strerror or exc})")
            return
        if not data.strip():
            self.skip(where, "empty file")
            return
        reason = _binary_reason(data)
        if reason:
            self.skip(where, reason)
            return
        if suffix in JSONL_SUFFIXES:
            self._read_jsonl(path, data)
            return
        text, reason = _decode_utf8(data)
        if text is None:
            self.skip(where, reason or "not valid UTF-8")
            return
        text = _normalise_newlines(text)
        if suffix in HTML_SUFFIXES:
            text = html_to_text(text)
            if not text.strip():
                self.skip(where, "no visible text")
                return
        elif not text.strip():  # e.g. only a BOM and spaces
            self.skip(where, "empty file")
            return
        self.add(doc_id, text, where, where)

    def _read_jsonl(self, path: Path, data: bytes) -> None:
        # Decode line by line so one bad line costs that line only, not the whole file.
        offset = 0
        for lineno, raw in enumerate(data.split(b"\n"), start=1):
            line_offset, offset = offset, offset + len(raw) + 1
            where = f"{path}:{lineno}"
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw, line_offset = raw[3:], line_offset + 3
            if not raw.strip():
                continue  # blank lines (e.g. a trailing newline) are not records
            line, reason = _decode_utf8(raw, line_offset)
            if line is None:
                self.skip(where, f"line {lineno}: {reason}")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                self.skip(where, f"line {lineno}: invalid JSON ({exc.msg})")
                continue
            if not isinstance(record, dict):
                self.skip(where, f"line {lineno}: expected a JSON object with 'id' and 'text'")
                continue
            doc_id, text = record.get("id"), record.get("text")
            if not isinstance(doc_id, str) or not doc_id.strip():
                self.skip(where, f"line {lineno}: 'id' must be a non-empty string")
                continue
            if not isinstance(text, str):
                self.skip(where, f"line {lineno}: 'text' must be a string")
                continue
            text = _normalise_newlines(text)
            if not text.strip():
                self.skip(where, f"line {lineno}: empty text")
                continue
            self.add(doc_id, text, where, where)


def read_corpus(paths: list[str | Path]) -> tuple[list[Document], list[Skipped]]:
    """Read every PATH (file or directory, recursively) into documents plus skip reports.

    Document ids: for a directory PATH the file's path relative to it with forward slashes;
    for a file PATH its file name; for JSONL each line's ``id``. The first claimant of an id
    wins, later ones are skipped. Raises InputError if a PATH does not exist (checked for
    all PATHs before anything is read, so nothing is half-done).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    resolved = [Path(p) for p in paths]
    missing = [str(p) for p in resolved if not p.exists()]
    if missing:
        names = ", ".join(missing)
        plural = "s do" if len(missing) > 1 else " does"
        raise InputError(f"input path{plural} not exist: {names}")
    reader = _Reader()
    for path in resolved:
        reader.read_path(path)
    return reader.documents, reader.skipped
