"""The serve-files ASGI app (API reference: docs/serve-files.md).

- read-only: the server opens the store once, never takes the writer lock, and only issues
  LMDB read transactions, so `kdnctl ingest`/`compress` keep working next to it;
- objects are immutable and content-addressed, so they are served with a strong ETag (the
  hash) and a one-year immutable Cache-Control; any CDN or proxy in front may cache them;
- namespaces: a restricted token only ever sees documents inside its grants. Chunk lookups
  filter catalog KEYS by namespace before any record is read, so a chain hash stored only in
  another namespace takes the same path as an absent one (no timing side channel), and an
  invisible document answers exactly like a missing one (404, same message).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..ingest.chunking import iter_chain_hashes
from ..errors import KdnError, NotFoundError, UsageError
from ..store import SEP, Store, chunk_sizes_of, is_sha
from .auth import Access, authorize
from .http import IMMUTABLE, FileSlice, error, etag_matches, not_found, parse_range, raw_segments
from .limits import Limits

MAX_BODY_BYTES = 4 << 20  # a lookup of ~500k token ids; anything larger is not a prompt
MAX_FIELD_BYTES = 256  # fingerprint / label in a lookup
LINK_TTL_S = 600  # signed object links (behind nginx) stay valid this long


class _State:
    """Per-catalog-generation caches: object owners (for restricted tokens) and chunk sizes."""

    def __init__(self, store: Store, tokens: dict[str, list[str]] | None, max_body: int, limits: Limits):
        self.store, self.tokens, self.max_body, self.limits = store, tokens, max_body, limits
        self._owners: dict[str, set[str]] | None = None
        self._owners_gen: int | None = None
        self._sizes: dict[tuple, list[int]] = {}  # (generation, grants) -> chunk sizes

    def owners(self) -> dict[str, set[str]]:
        """object sha -> doc ids that use it, rebuilt when the catalog changes."""
        gen = self.store.generation
        if self._owners is None or gen != self._owners_gen:
            owners: dict[str, set[str]] = {}
            for d in self.store.list_documents():
                for h in self.store.document_history(d.doc_id):
                    owners.setdefault(h.text_object, set()).add(h.doc_id)
            from ..store.bases import basis_records

            model_basis = {b.fingerprint: b.object for b in basis_records(self.store)}
            for v in self.store.all_versions():
                for c in v.chunks:
                    owners.setdefault(c.object, set()).add(v.doc_id)
                if v.fingerprint in model_basis:  # whoever reads a model's documents may read its key basis
                    owners.setdefault(model_basis[v.fingerprint], set()).add(v.doc_id)
            self._owners, self._owners_gen = owners, gen
        return self._owners

    def chunk_sizes(self, access: Access) -> list[int]:
        # every lookup needs these; recomputing means parsing every version record
        gen = self.store.generation
        key = (gen, access.grants)
        if key not in self._sizes:
            versions = [v for v in self.store.list_versions() if access.sees(v.doc_id)]
            self._sizes = {k: v for k, v in self._sizes.items() if k[0] == gen}  # drop stale entries
            self._sizes[key] = chunk_sizes_of(versions)
        return self._sizes[key]


def _record(obj) -> dict:
    d = dataclasses.asdict(obj)
    if hasattr(obj, "nbytes"):
        d["nbytes"] = obj.nbytes
    return d


def _version_summary(v) -> dict:
    return {"label": v.label, "parent": v.parent, "mode": v.mode, "recipe": v.recipe, "fingerprint": v.fingerprint,
            "n_chunks": len(v.chunks), "n_tokens": v.n_tokens, "nbytes": v.nbytes, "created": v.created}


def _field_ok(value) -> bool:
    if not isinstance(value, str) or not value or SEP in value:
        return False
    try:
        return len(value.encode("utf-8")) <= MAX_FIELD_BYTES
    except UnicodeEncodeError:  # a lone surrogate ("\ud800") parses as JSON but is no text
        return False


def find_chunk(store: Store, access: Access, fingerprint: str, label: str, chain_hash: str):
    """The chunk this token may see, or None. Namespaces are filtered on catalog keys before any
    record is read: "stored in another namespace" and "absent" take the same path."""
    hits = store.chunk_hits(fingerprint, label, chain_hash, visible=access.filter)
    return hits[0] if hits else None


def create_app(store_root: str | os.PathLike, tokens: dict[str, list[str]] | None = None,
               *, max_body_bytes: int = MAX_BODY_BYTES, limits: Limits | None = None,
               accel_prefix: str | None = None, link_secret: str | None = None,
               link_ttl_s: int = LINK_TTL_S) -> Starlette:
    """The ASGI app serving ``store_root`` read-only. ``tokens``: token -> namespace grants
    (``["*"]`` = all); None = no authentication. Raises NotFoundError if there is no store.

    ``link_secret`` (behind the nginx config written with the same secret, kdnctl/server/nginx.py):
    every version record answered to a token carries ``links``, a signed query string per
    chunk object valid ``link_ttl_s`` seconds, so nginx sends those objects without asking
    kdnctl again. Only records the token may see are answered, so only its own objects get
    links."""
    if tokens is not None and not tokens:
        raise UsageError("an empty token table would refuse every request; pass tokens=None for no auth")
    store = Store(store_root, create=False)
    state = _State(store, tokens, max_body_bytes, limits or Limits())

    def vrecord(v) -> dict:
        d = _record(v)
        if link_secret:
            from .nginx import link_query

            expires = int(time.time()) + int(link_ttl_s)
            d["links"] = {c.object: link_query(c.object, link_secret, expires) for c in v.chunks}
        return d

    def guarded(handler):
        async def endpoint(request: Request):
            access = authorize(request, state.tokens)
            if access is None:
                return error(401, "missing or unknown bearer token", "send `Authorization: Bearer TOKEN`",
                             headers={"WWW-Authenticate": 'Bearer realm="kdnctl"'})
            try:
                return await handler(request, access)
            except NotFoundError as exc:
                return error(404, exc.message, exc.hint)
            except UsageError as exc:  # bad ids etc.: the client's fault
                return error(400, exc.message, exc.hint)
            except KdnError as exc:  # a damaged store: the server's fault, said plainly
                return error(500, exc.message, exc.hint)
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
                "versions": [vrecord(v) if with_chunks else _version_summary(v) for v in versions],
                "nbytes": sum(v.nbytes for v in versions),
            })
        return JSONResponse({"documents": sorted(out, key=lambda e: e["document"]["doc_id"])})

    async def docs_path(request: Request, access: Access):
        seg = raw_segments(request, "/v1/docs/")
        doc_version = request.query_params.get("doc_version") or None
        if len(seg) >= 3 and seg[-2] == "versions":  # /v1/docs/{doc}/versions/{label}
            doc_id, label = "/".join(seg[:-2]), seg[-1]
        elif len(seg) >= 2 and seg[-1] == "versions":  # /v1/docs/{doc}/versions
            doc_id, label = "/".join(seg[:-1]), None
        else:
            doc_id, label = "/".join(seg), ""
        if not doc_id or not access.sees(doc_id):
            return not_found(f"document {doc_id!r}")
        if label:
            return JSONResponse(vrecord(store.get_version(doc_id, label, doc_version)))
        doc = store.get_document(doc_id, doc_version)
        if label is None:
            return JSONResponse({"versions": [vrecord(v) for v in store.list_versions(doc_id)]})
        return JSONResponse({
            "document": _record(doc),
            "history": [_record(h) for h in store.document_history(doc_id)],
            "versions": [_version_summary(v) for v in store.list_versions(doc_id)],
        })

    async def chunk(request: Request, access: Access):
        seg = raw_segments(request, "/v1/chunks/")
        if len(seg) != 3:
            return error(404, "expected /v1/chunks/{fingerprint}/{label}/{chain_hash}")
        hit = find_chunk(store, access, *seg)
        if hit is None:
            return not_found(f"chunk {seg[2][:16]}")
        return JSONResponse({"version": vrecord(hit[0]), "chunk": dataclasses.asdict(hit[1])})

    async def chunk_sizes(request: Request, access: Access):
        return JSONResponse({"chunk_sizes": state.chunk_sizes(access)})

    async def read_body(request: Request) -> bytes | Response:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > state.max_body:
            return error(413, f"request body over {state.max_body} bytes")
        body = bytearray()
        try:
            with anyio.fail_after(state.limits.body_timeout_s):  # a slow body must not hold a worker
                async for part in request.stream():  # counted as it arrives: chunked bodies have no length
                    body += part
                    if len(body) > state.max_body:
                        return error(413, f"request body over {state.max_body} bytes")
        except TimeoutError:
            return error(408, f"request body not received within {state.limits.body_timeout_s:g}s")
        except ClientDisconnect:
            return error(400, "client disconnected while sending the body")
        return bytes(body)

    async def lookup(request: Request, access: Access):
        body = await read_body(request)
        if isinstance(body, Response):
            return body
        try:
            req = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:120]
            return error(400, f"request body is not valid JSON ({why})")
        if not isinstance(req, dict):
            return error(400, "request body must be a JSON object")
        bad = [k for k in ("fingerprint", "label") if not _field_ok(req.get(k))]
        if bad:
            return error(400, f"missing or invalid field(s): {', '.join(bad)} (non-empty UTF-8 strings, "
                              f"at most {MAX_FIELD_BYTES} bytes)")
        ids = req.get("token_ids")
        if ids is None and "text" in req:
            return error(400, "the server has no tokenizer: send `token_ids` (the prompt tokenized with "
                              "the model whose fingerprint you pass), not `text`")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and -(1 << 63) <= t < 1 << 63 for t in ids):
            return error(400, "`token_ids` must be a list of integers (64-bit)")
        sizes = req.get("chunk_tokens")
        if sizes is not None and (not isinstance(sizes, int) or isinstance(sizes, bool) or sizes < 1):
            return error(400, "`chunk_tokens` must be a positive integer")
        fp, label = req["fingerprint"], req["label"]
        sizes = [sizes] if sizes else state.chunk_sizes(access)
        best: tuple[int, int | None, list] = (0, None, [])
        for n in sizes:  # the store may hold several chunkings; keep the longest match
            chain = []
            for h in iter_chain_hashes(ids, n, fp):  # lazy: stop hashing at the first miss
                hit = find_chunk(store, access, fp, label, h)
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
        if not is_sha(sha):
            return error(404, "no such object", "object ids are 64 lowercase hex characters")
        if not access.unrestricted and not any(access.sees(d) for d in state.owners().get(sha, ())):
            return error(404, "no such object")  # same answer as a missing object: nothing leaks
        path = store.object_path(sha)
        try:
            st = path.stat()
        except FileNotFoundError:
            return error(404, "no such object")
        etag = f'"{sha}"'
        headers = {"etag": etag, "cache-control": IMMUTABLE, "accept-ranges": "bytes",
                   "content-type": "application/octet-stream"}
        head = request.method == "HEAD"
        inm = request.headers.get("if-none-match")
        if inm is not None and etag_matches(inm, etag):
            return Response(status_code=304, headers=headers)
        if accel_prefix is not None:  # nginx sends the bytes (ranges too): kdnctl/server/nginx.py
            from .nginx import accel_path

            for name in ("content-type", "accept-ranges"):  # nginx sets both for the file it sends
                headers.pop(name)
            return Response(status_code=200, headers={**headers, "x-accel-redirect": accel_path(sha, accel_prefix)})
        start, end, status = 0, st.st_size, 200
        rng = request.headers.get("range")
        if_range = request.headers.get("if-range")
        if rng is not None and (if_range is None or if_range.strip() == etag):
            parsed = parse_range(rng, st.st_size)
            if parsed == "unsatisfiable":
                return Response(status_code=416, headers={**headers, "content-range": f"bytes */{st.st_size}"})
            if parsed is not None:
                start, end = parsed
                status = 206
                headers["content-range"] = f"bytes {start}-{end - 1}/{st.st_size}"
        return FileSlice(path, start, end, status, headers, head)

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

    async def not_found_handler(request, exc):
        return error(getattr(exc, "status_code", 404), getattr(exc, "detail", "not found") or "not found")

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: not_found_handler, 405: not_found_handler})
    app.state.kdn = state
    return app
