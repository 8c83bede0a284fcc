"""`kdnctl serve-files`: a read-only HTTP server that lets engines pull bundles from a store.

API reference: docs/serve-files.md. Design points the code below protects:

- read-only: the server opens the store once, never takes the writer lock, and only issues
  LMDB read transactions, so `kdnctl ingest`/`compress` keep working next to it;
- objects are immutable and content-addressed, so they are served with a strong ETag (the
  hash) and a one-year immutable Cache-Control; any CDN or proxy in front may cache them;
- namespaces: a restricted token only ever sees documents inside its grants. Everything a
  request can reach (listings, metadata, lookups, objects) goes through `Access.sees`, and an
  invisible document answers exactly like a missing one (404, same message), so a token cannot
  even probe for names in other namespaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import unquote

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .chunking import iter_chain_hashes
from .errors import KdnError, NotFoundError, UsageError
from .store import Store

MAX_BODY_BYTES = 4 << 20  # a lookup of ~500k token ids; anything larger is not a prompt
BLOCK_BYTES = 1 << 20  # file read size: big blocks keep per-block overhead off throughput
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
IMMUTABLE = "public, max-age=31536000, immutable"


# -- tokens and namespaces -----------------------------------------------------------------

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
        if len(parts) != 2:
            raise UsageError(f"token file {path} line {n}: expected `TOKEN namespace1,namespace2`")
        token, grants = parts[0], [g.strip().strip("/") or "*" for g in parts[1].split(",") if g.strip()]
        if token in tokens:
            raise UsageError(f"token file {path} line {n}: duplicate token")
        if not grants:
            raise UsageError(f"token file {path} line {n}: no namespaces")
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
        # A grant G covers doc ids equal to G or under "G/": `acme` covers `acme/faq.md` and
        # `acme/eu/x.md` but not `acmecorp/y.md`, so a prefix can never leak into a sibling.
        if self.grants is None:
            return True
        return any(doc_id == g or doc_id.startswith(g + "/") for g in self.grants)


def _authorize(request: Request, tokens: dict[str, list[str]] | None) -> Access | None:
    if tokens is None:
        return Access(None)
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return None
    presented = presented.strip().encode()
    found = None
    for token, grants in tokens.items():
        # compare against every token (no early exit) so timing does not reveal a prefix
        if hmac.compare_digest(token.encode(), presented):
            found = grants
    if found is None:
        return None
    return Access(None if "*" in found else tuple(found))


# -- catalog view for restricted tokens ----------------------------------------------------

class CatalogView:
    """Who owns which object and every stored chunk hash, rebuilt when the catalog changes.

    Store.lookup_chunk returns one hit per chain hash; when two namespaces store the same
    prefix, a restricted token needs the hit in *its* namespace, and objects must be matched
    to their owners. Both need a full scan, so it is cached per catalog generation."""

    def __init__(self, store: Store):
        dump = store.catalog_dump()  # public, deterministic; `created` is dropped, unused here
        self.owners: dict[str, set[str]] = {}
        self.chunks: dict[tuple[str, str, str], list[tuple[str, str, int]]] = {}
        current = {d["doc_id"]: d["doc_version"] for d in dump["docs"].values()
                   if dump["current"].get(d["doc_id"]) == d["doc_version"]}
        for d in dump["docs"].values():
            self.owners.setdefault(d["text_object"], set()).add(d["doc_id"])
        for v in dump["versions"].values():
            is_current = current.get(v["doc_id"]) == v["doc_version"]
            for c in v["chunks"]:
                self.owners.setdefault(c["object"], set()).add(v["doc_id"])
                hits = self.chunks.setdefault((v["fingerprint"], v["label"], c["chain_hash"]), [])
                hits.insert(0 if is_current else len(hits), (v["doc_id"], v["doc_version"], c["index"]))


class _State:
    def __init__(self, store: Store, tokens: dict[str, list[str]] | None, max_body: int):
        self.store, self.tokens, self.max_body = store, tokens, max_body
        self._view: CatalogView | None = None
        self._view_gen: object = None
        self._sizes: dict[tuple, list[int]] = {}  # (generation, grants) -> chunk sizes

    def view(self) -> CatalogView:
        gen = self._generation()
        if self._view is None or gen is None or gen != self._view_gen:
            self._view, self._view_gen = CatalogView(self.store), gen
        return self._view

    def chunk_sizes(self, access: Access) -> list[int]:
        # every lookup needs these; recomputing means parsing every version record
        gen = self._generation()
        key = (gen, access.grants)
        if gen is None or key not in self._sizes:
            versions = [v for v in self.store.list_versions() if access.sees(v.doc_id)]
            self._sizes = {k: v for k, v in self._sizes.items() if k[0] == gen}  # drop stale entries
            self._sizes[key] = _chunk_sizes(versions)
        return self._sizes[key]

    def _generation(self):
        # LMDB bumps last_txnid on every committed write txn: a cheap "catalog changed" check.
        # Store exposes no public counter, so this reads its environment; None = always rebuild.
        try:
            return self.store._env.info()["last_txnid"]
        except Exception:  # pragma: no cover - a Store without an LMDB env
            return None


# -- helpers ------------------------------------------------------------------------------

def _error(status: int, message: str, hint: str = "", headers: dict | None = None) -> JSONResponse:
    body = {"error": message, "status": status}
    if hint:
        body["hint"] = hint
    return JSONResponse(body, status_code=status, headers=headers)


def _not_found(what: str) -> JSONResponse:
    return _error(404, f"{what} is not in the store", "GET /v1/docs lists what this token can see")


def _record(obj) -> dict:
    d = dataclasses.asdict(obj)
    if hasattr(obj, "nbytes"):
        d["nbytes"] = obj.nbytes
    return d


def _version_summary(v) -> dict:
    return {"label": v.label, "parent": v.parent, "mode": v.mode, "recipe": v.recipe, "fingerprint": v.fingerprint,
            "n_chunks": len(v.chunks), "n_tokens": v.n_tokens, "nbytes": v.nbytes, "created": v.created}


def _chunk_sizes(versions) -> list[int]:
    # same rule as Store.chunk_sizes, but over the versions this token may see
    sizes = set()
    for v in versions:
        n = v.recipe.get("chunk_tokens") if isinstance(v.recipe, dict) else None
        if isinstance(n, int) and n > 0:
            sizes.add(n)
        elif v.chunks:
            sizes.add(v.chunks[0].token_end - v.chunks[0].token_start)
    return sorted(sizes)


def _raw_segments(request: Request, prefix: str) -> list[str]:
    """Path segments after ``prefix``, split BEFORE percent-decoding.

    Starlette routes on the decoded path, where an encoded "/" (%2F) in a doc id or label is
    indistinguishable from a separator; splitting the raw path keeps ids with "/" exact."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    raw = raw.decode("latin-1").split("?", 1)[0]
    rest = raw[raw.index(prefix) + len(prefix):] if prefix in raw else ""
    return [unquote(s) for s in rest.split("/")]


# -- object responses -----------------------------------------------------------------------

def _parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """One ``bytes=`` range -> (start, end exclusive); "unsatisfiable"; None = ignore the header.

    Multi-range and malformed headers are ignored (RFC 9110 lets a server answer 200)."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
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


def _etag_matches(header: str, etag: str) -> bool:
    if header.strip() == "*":
        return True
    tags = [t.strip() for t in header.split(",")]
    return any(t.removeprefix("W/") == etag for t in tags)  # If-None-Match uses weak comparison


class _FileSlice(Response):
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


# -- the application ------------------------------------------------------------------------

def create_app(store_root: str | os.PathLike, tokens: dict[str, list[str]] | None = None,
               *, max_body_bytes: int = MAX_BODY_BYTES, accel_prefix: str | None = None) -> Starlette:
    """The ASGI app serving ``store_root`` read-only. ``tokens``: token -> namespace grants
    (``["*"]`` = all); None = no authentication. Raises NotFoundError if there is no store."""
    if tokens is not None and not tokens:
        raise UsageError("an empty token table would refuse every request; pass tokens=None for no auth")
    store = Store(store_root, create=False)
    state = _State(store, tokens, max_body_bytes)

    def guarded(handler):
        async def endpoint(request: Request):
            access = _authorize(request, state.tokens)
            if access is None:
                return _error(401, "missing or unknown bearer token", "send `Authorization: Bearer TOKEN`",
                              headers={"WWW-Authenticate": 'Bearer realm="kdnctl"'})
            try:
                return await handler(request, access)
            except NotFoundError as exc:
                return _error(404, exc.message, exc.hint)
            except KdnError as exc:  # UsageError on bad ids etc.: the client's fault
                return _error(400, exc.message, exc.hint)
        return endpoint

    async def health(request: Request):
        return JSONResponse({"status": "ok", "auth": state.tokens is not None})

    async def list_docs(request: Request, access: Access):
        with_chunks = request.query_params.get("chunks") in ("1", "true", "yes")
        out = []
        for d in store.list_documents():
            if not access.sees(d.doc_id):
                continue
            versions = store.list_versions(d.doc_id)
            out.append({
                "document": _record(d),
                "doc_versions": [h.doc_version for h in store.document_history(d.doc_id)],
                "versions": [_record(v) if with_chunks else _version_summary(v) for v in versions],
                "nbytes": sum(v.nbytes for v in versions),
            })
        return JSONResponse({"documents": sorted(out, key=lambda e: e["document"]["doc_id"])})

    async def docs_path(request: Request, access: Access):
        seg = _raw_segments(request, "/v1/docs/")
        doc_version = request.query_params.get("doc_version") or None
        if len(seg) >= 3 and seg[-2] == "versions":  # /v1/docs/{doc}/versions/{label}
            doc_id, label = "/".join(seg[:-2]), seg[-1]
        elif len(seg) >= 2 and seg[-1] == "versions":  # /v1/docs/{doc}/versions
            doc_id, label = "/".join(seg[:-1]), None
        else:
            doc_id, label = "/".join(seg), ""
        if not doc_id or not access.sees(doc_id):
            return _not_found(f"document {doc_id!r}")
        if label:
            return JSONResponse(_record(store.get_version(doc_id, label, doc_version)))
        doc = store.get_document(doc_id, doc_version)
        if label is None:
            return JSONResponse({"versions": [_record(v) for v in store.list_versions(doc_id)]})
        return JSONResponse({
            "document": _record(doc),
            "history": [_record(h) for h in store.document_history(doc_id)],
            "versions": [_version_summary(v) for v in store.list_versions(doc_id)],
        })

    def find_chunk(access: Access, fingerprint: str, label: str, chain_hash: str):
        hit = store.lookup_chunk(fingerprint, label, chain_hash)
        if hit is None or access.sees(hit[0].doc_id):
            return hit
        # The store's preferred hit belongs to another namespace; look for one this token sees.
        for doc_id, dv, index in state.view().chunks.get((fingerprint, label, chain_hash), []):
            if access.sees(doc_id):
                rec = store.get_version(doc_id, label, dv)
                chunk = next((c for c in rec.chunks if c.index == index), None)
                if chunk is not None:
                    return rec, chunk
        return None

    async def chunk(request: Request, access: Access):
        seg = _raw_segments(request, "/v1/chunks/")
        if len(seg) != 3:
            return _error(404, "expected /v1/chunks/{fingerprint}/{label}/{chain_hash}")
        hit = find_chunk(access, *seg)
        if hit is None:
            return _not_found(f"chunk {seg[2][:16]}")
        return JSONResponse({"version": _record(hit[0]), "chunk": dataclasses.asdict(hit[1])})

    async def chunk_sizes(request: Request, access: Access):
        return JSONResponse({"chunk_sizes": state.chunk_sizes(access)})

    async def lookup(request: Request, access: Access):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > state.max_body:
            return _error(413, f"request body over {state.max_body} bytes")
        body = bytearray()
        async for part in request.stream():  # counted as it arrives: chunked bodies have no length
            body += part
            if len(body) > state.max_body:
                return _error(413, f"request body over {state.max_body} bytes")
        try:
            req = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not valid JSON ({exc})")
        if not isinstance(req, dict):
            return _error(400, "request body must be a JSON object")
        missing = [k for k in ("fingerprint", "label") if not isinstance(req.get(k), str) or not req.get(k)]
        if missing:
            return _error(400, f"missing or non-string field(s): {', '.join(missing)}")
        ids = req.get("token_ids")
        if ids is None and "text" in req:
            return _error(400, "the server has no tokenizer: send `token_ids` (the prompt tokenized with "
                               "the model whose fingerprint you pass), not `text`")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return _error(400, "`token_ids` must be a list of integers")
        sizes = req.get("chunk_tokens")
        if sizes is not None and (not isinstance(sizes, int) or isinstance(sizes, bool) or sizes < 1):
            return _error(400, "`chunk_tokens` must be a positive integer")
        fp, label = req["fingerprint"], req["label"]
        sizes = [sizes] if sizes else state.chunk_sizes(access)
        best: tuple[int, int | None, list] = (0, None, [])
        for n in sizes:  # the store may hold several chunkings; keep the longest match
            chain = []
            for h in iter_chain_hashes(ids, n, fp):  # lazy: stop hashing at the first miss
                hit = find_chunk(access, fp, label, h)
                if hit is None:
                    break
                rec, c = hit
                chain.append({"doc_id": rec.doc_id, "doc_version": rec.doc_version, **dataclasses.asdict(c)})
            matched = chain[-1]["token_end"] if chain else 0
            if matched > best[0]:
                best = (matched, n, chain)
        return JSONResponse({"matched_tokens": best[0], "chunk_tokens": best[1], "chunks": best[2]})

    async def objects(request: Request, access: Access):
        sha = request.path_params["sha"]
        # Only a bare hash names an object: "../catalog/data.mdb" and friends never reach the disk.
        if not _SHA_RE.match(sha):
            return _error(404, "no such object", "object ids are 64 lowercase hex characters")
        if not access.unrestricted and not any(access.sees(d) for d in state.view().owners.get(sha, ())):
            return _error(404, "no such object")  # same answer as a missing object: nothing leaks
        path = store.object_path(sha)
        try:
            st = path.stat()
        except FileNotFoundError:
            return _error(404, "no such object")
        etag = f'"{sha}"'
        headers = {"etag": etag, "cache-control": IMMUTABLE, "accept-ranges": "bytes",
                   "content-type": "application/octet-stream"}
        head = request.method == "HEAD"
        inm = request.headers.get("if-none-match")
        if inm is not None and _etag_matches(inm, etag):
            return Response(status_code=304, headers=headers)
        if accel_prefix is not None:  # nginx sends the bytes (ranges too): kdnctl/nginx.py
            from .nginx import accel_path

            headers.pop("content-type")
            return Response(status_code=200, headers={**headers, "x-accel-redirect": accel_path(sha, accel_prefix)})
        start, end, status = 0, st.st_size, 200
        rng = request.headers.get("range")
        if_range = request.headers.get("if-range")
        if rng is not None and (if_range is None or if_range.strip() == etag):
            parsed = _parse_range(rng, st.st_size)
            if parsed == "unsatisfiable":
                return Response(status_code=416, headers={**headers, "content-range": f"bytes */{st.st_size}"})
            if parsed is not None:
                start, end = parsed
                status = 206
                headers["content-range"] = f"bytes {start}-{end - 1}/{st.st_size}"
        return _FileSlice(path, start, end, status, headers, head)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        store.close()

    routes = [
        Route("/v1/health", health, methods=["GET"]),
        Route("/v1/docs", guarded(list_docs), methods=["GET"]),
        Route("/v1/docs/{rest:path}", guarded(docs_path), methods=["GET"]),
        Route("/v1/chunks/{rest:path}", guarded(chunk), methods=["GET"]),
        Route("/v1/chunk-sizes", guarded(chunk_sizes), methods=["GET"]),
        Route("/v1/lookup", guarded(lookup), methods=["POST"]),
        Route("/v1/objects/{sha:path}", guarded(objects), methods=["GET", "HEAD"]),
    ]

    async def not_found(request, exc):
        return _error(getattr(exc, "status_code", 404), getattr(exc, "detail", "not found") or "not found")

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.state.kdn = state
    return app


def _log_config(level: str) -> dict:
    # uvicorn's default sends the access log to stdout; keep stdout clean, everything on stderr.
    fmt = "%(asctime)s %(levelname)s %(message)s"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": fmt}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
        },
    }


def serve(store_root: str | os.PathLike, host: str = "127.0.0.1", port: int = 8700,
          token_file: str | os.PathLike | None = None, *, max_body_bytes: int = MAX_BODY_BYTES,
          access_log: bool = True, log_level: str = "info", graceful_timeout_s: float = 10.0,
          accel_prefix: str | None = None) -> None:
    """Run the server until SIGINT/SIGTERM; in-flight requests get ``graceful_timeout_s`` to finish."""
    import uvicorn

    tokens = load_tokens(token_file) if token_file else None
    app = create_app(store_root, tokens, max_body_bytes=max_body_bytes, accel_prefix=accel_prefix)
    if tokens is None and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving {store_root} on {host} without --token-file: anyone who can reach it can read it",
              file=sys.stderr)
    config = uvicorn.Config(app, host=host, port=port, log_config=_log_config(log_level), access_log=access_log,
                            timeout_graceful_shutdown=graceful_timeout_s, server_header=False)
    _server_class()(config).run()


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # SIGINT/SIGTERM is how a server is meant to stop: after the graceful shutdown exit 0
            # instead of letting uvicorn re-raise the signal (the CLI would report "interrupted").
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return Server
