"""HTTP plumbing of serve-files: error bodies, raw path segments, byte ranges, file streaming."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

BLOCK_BYTES = 1 << 20  # file read size: big blocks keep per-block overhead off throughput
IMMUTABLE = "public, max-age=31536000, immutable"


def _clean(text: str) -> str:
    # a lone surrogate from a hostile request must not turn an error answer into a 500
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error(status: int, message: str, hint: str = "", headers: dict | None = None) -> JSONResponse:
    body = {"error": _clean(message), "status": status}
    if hint:
        body["hint"] = _clean(hint)
    return JSONResponse(body, status_code=status, headers=headers)


def not_found(what: str) -> JSONResponse:
    return error(404, f"{what} is not in the store", "GET /v1/docs lists what this token can see")


def raw_segments(request: Request, prefix: str) -> list[str]:
    """Path segments after ``prefix``, split BEFORE percent-decoding.

    Starlette routes on the decoded path, where an encoded "/" (%2F) in a doc id or label is
    indistinguishable from a separator; splitting the raw path keeps ids with "/" exact."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    raw = raw.decode("latin-1").split("?", 1)[0]
    rest = raw[raw.index(prefix) + len(prefix):] if prefix in raw else ""
    return [unquote(s) for s in rest.split("/")]


def parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """One ``bytes=`` range -> (start, end exclusive); "unsatisfiable"; None = ignore the header.

    Multi-range and malformed headers are ignored (RFC 9110 lets a server answer 200)."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash or len(first) > 20 or len(last) > 20:
        return None
    try:
        if first == "":  # suffix range: the last N bytes
            n = int(last)
            if n < 0:
                return None
            return (max(size - n, 0), size) if n > 0 and size > 0 else "unsatisfiable"
        start = int(first)
        end = int(last) + 1 if last != "" else size
    except ValueError:
        return None
    if start < 0 or (last != "" and end <= start):
        return None  # "5-2" is invalid syntax (ignored), unlike a start past the end (416)
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size)


def etag_matches(header: str, etag: str) -> bool:
    if header.strip() == "*":
        return True
    tags = [t.strip() for t in header.split(",")]
    return any(t.removeprefix("W/") == etag for t in tags)  # If-None-Match uses weak comparison


class FileSlice(Response):
    """Streams bytes [start, end) of a file in big blocks read off the event loop."""

    def __init__(self, path: Path, start: int, end: int, status_code: int, headers: dict, head: bool):
        super().__init__(status_code=status_code, headers=headers)
        self.path, self.start, self.end, self.head = path, start, end, head
        self.headers["content-length"] = str(end - start)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if self.head or self.end == self.start:
            await send({"type": "http.response.body", "body": b""})
            return
        f = await anyio.to_thread.run_sync(open, self.path, "rb")
        try:
            pos = self.start
            await anyio.to_thread.run_sync(f.seek, pos)
            while pos < self.end:
                block = await anyio.to_thread.run_sync(f.read, min(BLOCK_BYTES, self.end - pos))
                if not block:  # the file shrank under us: never possible for a valid object
                    raise OSError(f"{self.path} ended early")
                pos += len(block)
                await send({"type": "http.response.body", "body": block, "more_body": pos < self.end})
        finally:
            await anyio.to_thread.run_sync(f.close)
