"""`kdnctl serve-files` / RemoteStore / `kdnctl pull` against REAL uvicorn servers on loopback.

One store is ingested with the real model (four short documents, 64-token chunks) and served
twice: in-process without auth, and as a `kdnctl serve-files` subprocess with a token file.
Tests that damage or restart a server work on a copy of the store."""

from __future__ import annotations

import hashlib
import http.client
import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import EXAMPLES, REPO, damage_object, run_cli
from httpkit import ThreadServer, free_port

from kdnctl.ingest.chunking import chain_hashes
from kdnctl.store.client import RemoteStore
from kdnctl.ingest.corpus import read_corpus
from kdnctl.errors import NotFoundError, RemoteError, StoreCorruptError, UsageError
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.ingest.prompting import PromptFormat
from kdnctl.server import load_tokens
from kdnctl.store import Store

pytestmark = pytest.mark.model
CHUNK = 64
TOKENS = {"tok-all": "*", "tok-acme": "acme", "tok-globex": "globex"}
ACME, GLOBEX = ["acme/faq.md", "acme/manual.md"], ["globex/manual-copy.md", "globex/notes.txt"]


def _cut(lm, name: str, n: int) -> str:
    ids = lm.tokenizer((EXAMPLES / name).read_text(), add_special_tokens=False).input_ids[:n]
    return lm.tokenizer.decode(ids)


@pytest.fixture(scope="module")
def served(tmp_path_factory, lm):
    """(store root, {doc_id: token ids as ingested}). globex/manual-copy.md has the same text as
    acme/manual.md, so both namespaces hold the same chain hashes (different objects)."""
    docs_dir = tmp_path_factory.mktemp("serve-docs")
    manual = _cut(lm, "zephyr-x200-manual.md", 160)
    texts = {"acme/manual.md": manual, "acme/faq.md": _cut(lm, "faq.md", 100),
             "globex/notes.txt": _cut(lm, "meeting-notes-2026-03.txt", 120), "globex/manual-copy.md": manual}
    for doc_id, text in texts.items():
        (docs_dir / doc_id).parent.mkdir(parents=True, exist_ok=True)
        (docs_dir / doc_id).write_text(text)
    docs, skipped = read_corpus([docs_dir])
    assert not skipped and sorted(d.doc_id for d in docs) == sorted(texts)
    root = tmp_path_factory.mktemp("serve-store")
    with Store(root) as st:
        ingest_documents(st, lm, docs, IngestOptions(chunk_tokens=CHUNK))
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    ids = {d.doc_id: fmt.document_ids(lm.tokenizer, d.text)[0] for d in docs}
    return root, ids


def start_cli_server(root, port, token_file=None) -> subprocess.Popen:
    """`kdnctl serve-files` as a real subprocess; returns once /v1/health answers."""
    cmd = [sys.executable, "-m", "kdnctl.cli.app", "serve-files", "--port", str(port), "--store", str(root)]
    if token_file:
        cmd += ["--token-file", str(token_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.time() + 60
    while True:
        assert proc.poll() is None, f"serve-files exited: {proc.communicate()[1]}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "serve-files did not come up"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def open_url(served):
    srv = ThreadServer(served[0])
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    (d / "server.tokens").write_text("# token namespaces\n" + "".join(f"{t} {ns}\n" for t, ns in TOKENS.items()))
    for t in TOKENS:
        (d / t).write_text(t + "\n")
    return d


@pytest.fixture(scope="module")
def auth_server(served, token_files):
    """(url, proc) of `kdnctl serve-files --token-file` in a subprocess; stopped with SIGTERM."""
    port = free_port()
    proc = start_cli_server(served[0], port, token_files / "server.tokens")
    yield f"http://127.0.0.1:{port}", proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def _objects(root) -> list[str]:
    with Store(root, create=False) as st:
        shas = {d.text_object for d in st.list_documents()}
        shas |= {c.object for v in st.list_versions() for c in v.chunks}
    return sorted(shas)


def _file(root, sha) -> bytes:
    return (root / "objects" / sha[:2] / sha).read_bytes()


def _raw_get(url, path, headers=None) -> tuple[int, bytes]:
    """http.client sends the path byte-for-byte (httpx would normalise "../")."""
    conn = http.client.HTTPConnection(url.split("//")[1], timeout=10)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


# -- metadata -------------------------------------------------------------------------------

def test_listing_and_metadata_match_the_store(served, open_url):
    root, _ = served
    body = httpx.get(f"{open_url}/v1/docs").json()
    assert [e["document"]["doc_id"] for e in body["documents"]] == sorted(ACME + GLOBEX)
    remote = RemoteStore(open_url)
    with Store(root, create=False) as st:
        for e in body["documents"]:
            doc_id = e["document"]["doc_id"]
            v = st.get_version(doc_id)
            assert e["doc_versions"] == [v.doc_version]
            assert e["versions"][0]["label"] == "full" and e["versions"][0]["n_chunks"] == len(v.chunks)
            assert e["versions"][0]["nbytes"] == v.nbytes == e["nbytes"]
            assert remote.get_version(doc_id) == v
            assert remote.get_version(doc_id, "full", v.doc_version) == v  # ?doc_version=
            assert remote.get_document(doc_id) == st.get_document(doc_id)
            assert remote.document_history(doc_id) == st.document_history(doc_id)
            assert remote.list_versions(doc_id) == st.list_versions(doc_id)
        assert sorted(remote.list_versions(), key=lambda v: v.doc_id) == sorted(st.list_versions(), key=lambda v: v.doc_id)
        assert remote.list_documents() == sorted(st.list_documents(), key=lambda d: d.doc_id)
        assert remote.chunk_sizes() == st.chunk_sizes() == [CHUNK]
    assert len(remote.get_version("acme/manual.md").chunks) >= 3
    # ids are %-encoded by the client; a human may also type the slash
    assert httpx.get(f"{open_url}/v1/docs/acme/manual.md/versions/full").json()["label"] == "full"
    for path, what in [("/v1/docs/acme/nope.md", "document 'acme/nope.md'"),
                       ("/v1/docs/acme/manual.md/versions/nope", "no version labelled 'nope'"),
                       ("/v1/docs/acme/manual.md?doc_version=0000", "version 0000")]:
        r = httpx.get(open_url + path)
        assert r.status_code == 404 and what in r.json()["error"], r.text
    with pytest.raises(NotFoundError, match="no version labelled"):
        remote.get_version("acme/manual.md", "nope")
    assert remote.document_history("nope") == [] and remote.list_versions("nope") == []
    assert httpx.get(f"{open_url}/v1/health").json()["status"] == "ok"


# -- objects --------------------------------------------------------------------------------

def test_full_ranged_head_and_conditional_downloads(served, open_url):
    root, _ = served
    sha = max(_objects(root), key=lambda s: len(_file(root, s)))
    data = _file(root, sha)
    url, n = f"{open_url}/v1/objects/{sha}", len(data)
    r = httpx.get(url)
    assert r.status_code == 200 and r.content == data
    assert r.headers["etag"] == f'"{sha}"' and r.headers["accept-ranges"] == "bytes"
    assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert int(r.headers["content-length"]) == n
    for rng, (s, e) in {"bytes=0-99": (0, 100), "bytes=1000-": (1000, n), "bytes=-777": (n - 777, n),
                        f"bytes={n // 2}-{n // 2 + 4095}": (n // 2, n // 2 + 4096), f"bytes=5-{10 * n}": (5, n)}.items():
        r = httpx.get(url, headers={"range": rng})
        assert r.status_code == 206, rng
        assert r.content == data[s:e] and r.headers["content-range"] == f"bytes {s}-{e - 1}/{n}"
    for rng in (f"bytes={n}-", f"bytes={n + 10}-{n + 20}", "bytes=-0"):
        r = httpx.get(url, headers={"range": rng})
        assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{n}", rng
    for ignored in ("bytes=0-1,5-6", "bytes=9-2", "lines=1-2"):  # multi-range / malformed: full body
        r = httpx.get(url, headers={"range": ignored})
        assert r.status_code == 200 and r.content == data
    r = httpx.get(url, headers={"range": "bytes=0-9", "if-range": '"other"'})  # stale If-Range: full
    assert r.status_code == 200 and len(r.content) == n
    h = httpx.head(url)
    assert h.status_code == 200 and h.content == b"" and int(h.headers["content-length"]) == n
    assert h.headers["etag"] == f'"{sha}"'
    for inm in (f'"{sha}"', f'"x", W/"{sha}"', "*"):
        r = httpx.get(url, headers={"if-none-match": inm})
        assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == f'"{sha}"'
    assert httpx.get(url, headers={"if-none-match": '"other"'}).status_code == 200
    assert httpx.get(f"{open_url}/v1/objects/{'0' * 64}").status_code == 404


def test_path_traversal_and_bad_object_ids_are_404(served, open_url):
    root, _ = served
    sha = _objects(root)[0]
    assert (root / "catalog" / "data.mdb").is_file()
    for path in ["/v1/objects/../catalog/data.mdb", "/v1/objects/..%2fcatalog%2fdata.mdb",
                 "/v1/objects/%2e%2e%2fcatalog%2fdata.mdb", "/v1/objects/%2E%2E/%2E%2E/write.lock",
                 "/v1/objects/..%252fcatalog%252fdata.mdb", f"/v1/objects/{sha[:2]}/{sha}",
                 f"/v1/objects/{sha.upper()}", f"/v1/objects/{sha[:63]}", f"/v1/objects/{sha}/",
                 f"/v1/objects/{sha}%00", "/v1/objects/%2fetc%2fpasswd", "/v1/objects/"]:
        status, body = _raw_get(open_url, path)
        assert status == 404, path
        assert b"SQLite" not in body and len(body) < 400 and "error" in json.loads(body), path


def test_bad_requests(served, open_url):
    _, ids = served
    url = f"{open_url}/v1/lookup"
    cases = [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"\xff\xfe", "not valid JSON"),
             (b'{"label": "full", "token_ids": [1]}', "fingerprint"),
             (b'{"fingerprint": "f", "label": "full", "token_ids": [1, "x"]}', "list of integers"),
             (b'{"fingerprint": "f", "label": "full", "token_ids": [1], "chunk_tokens": 0}', "chunk_tokens"),
             (b'{"fingerprint": "f", "label": "full", "text": "hello"}', "token_ids")]
    for body, msg in cases:
        r = httpx.post(url, content=body)
        assert r.status_code == 400 and msg in r.json()["error"], (body, r.text)
    big = b'{"fingerprint": "f", "label": "full", "token_ids": [' + b"1, " * (2 << 20) + b"1]}"
    assert httpx.post(url, content=big).status_code == 413
    assert httpx.post(url, content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)])).status_code == 413
    assert httpx.get(url).status_code == 405
    assert httpx.get(f"{open_url}/v1/nothing").status_code == 404


def test_lookup_by_token_ids(lm, served, open_url):
    root, ids = served
    with Store(root, create=False) as st:
        faq = st.get_version("acme/faq.md")
    body = httpx.post(f"{open_url}/v1/lookup", json={"fingerprint": lm.fingerprint, "label": "full",
                                                      "token_ids": ids["acme/faq.md"]}).json()
    assert body["matched_tokens"] == len(ids["acme/faq.md"]) == faq.n_tokens and body["chunk_tokens"] == CHUNK
    assert [(c["doc_id"], c["index"], c["object"], c["token_end"]) for c in body["chunks"]] == \
        [("acme/faq.md", c.index, c.object, c.token_end) for c in faq.chunks]
    # a prompt sharing the first 2.5 chunks, then diverging: the two full chunks match
    assert len(ids["acme/manual.md"]) > 2 * CHUNK + 20
    prompt = ids["acme/manual.md"][: 2 * CHUNK + 20] + [13, 13, 13]
    remote = RemoteStore(open_url)
    hit = remote.lookup_prefix(lm.fingerprint, "full", prompt)
    assert hit["matched_tokens"] == 2 * CHUNK and [c["index"] for c in hit["chunks"]] == [0, 1]
    assert {c["doc_id"] for c in hit["chunks"]} == {"acme/manual.md"}  # current, first in id order
    assert remote.lookup_prefix(lm.fingerprint, "other-label", prompt)["matched_tokens"] == 0
    assert remote.lookup_prefix("0" * 16, "full", prompt)["chunks"] == []
    h = chain_hashes(prompt, CHUNK, lm.fingerprint)
    ver, chunk = remote.lookup_chunk(lm.fingerprint, "full", h[1])
    assert ver.doc_id == "acme/manual.md" and chunk.index == 1
    assert remote.lookup_chunk(lm.fingerprint, "full", h[2]) is None


# -- authentication and namespaces --------------------------------------------------------------

def test_token_file_parsing(tmp_path):
    f = tmp_path / "t"
    f.write_text("a  acme,globex/eu  # comment\n\nb *\n")
    assert load_tokens(f) == {"a": ["acme", "globex/eu"], "b": ["*"]}
    for bad in ("only-a-token\n", "a x\na y\n", "", "# nothing\n"):
        f.write_text(bad)
        with pytest.raises(UsageError):
            load_tokens(f)


def test_auth_and_namespaces(lm, served, auth_server):
    root, ids = served
    url, _ = auth_server
    assert httpx.get(f"{url}/v1/health").status_code == 200  # no data, no token needed
    objs = _objects(root)
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "tok-all"}, {"authorization": "Basic tok-all"}):
        for path in ("/v1/docs", "/v1/docs/acme/faq.md", f"/v1/objects/{objs[0]}", "/v1/chunk-sizes"):
            r = httpx.get(url + path, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), (headers, path)
        assert httpx.post(f"{url}/v1/lookup", headers=headers, json={}).status_code == 401
    with pytest.raises(RemoteError, match="refused") as exc:
        RemoteStore(url, token="nope").list_documents()
    assert "--token-file" in exc.value.hint

    everyone = RemoteStore(url, token="tok-all")
    assert [d.doc_id for d in everyone.list_documents()] == sorted(ACME + GLOBEX)
    with Store(root, create=False) as st:
        owned = {ns: set().union(*({st.get_document(d).text_object} | {c.object for c in st.get_version(d).chunks}
                                   for d in docs))
                 for ns, docs in (("acme", ACME), ("globex", GLOBEX))}
    for ns, mine, theirs in (("acme", ACME, GLOBEX), ("globex", GLOBEX, ACME)):
        token = f"tok-{ns}"
        remote = RemoteStore(url, token=token)
        hdr = {"authorization": f"Bearer {token}"}
        listing = httpx.get(f"{url}/v1/docs", headers=hdr).text
        assert [d.doc_id for d in remote.list_documents()] == mine
        assert all(t not in listing for t in theirs)
        assert {v.doc_id for v in remote.list_versions()} == set(mine)
        for doc_id in theirs:  # invisible answers exactly like missing
            r = httpx.get(f"{url}/v1/docs/{doc_id}", headers=hdr)
            assert r.status_code == 404 and r.json()["error"] == f"document {doc_id!r} is not in the store"
            for path in (f"/v1/docs/{doc_id}/versions/full", f"/v1/docs/{doc_id}/versions"):
                assert httpx.get(url + path, headers=hdr).status_code == 404
            with pytest.raises(NotFoundError):
                remote.get_version(doc_id)
        for sha in owned[ns]:
            assert httpx.head(f"{url}/v1/objects/{sha}", headers=hdr).status_code == 200
        other = "globex" if ns == "acme" else "acme"
        # the two manuals share their text object (same bytes): only objects owned solely by
        # the other namespace must be invisible
        assert owned[other] - owned[ns] and len(owned[other] & owned[ns]) == 1
        for sha in owned[other] - owned[ns]:
            assert httpx.get(f"{url}/v1/objects/{sha}", headers=hdr).status_code == 404
            assert httpx.head(f"{url}/v1/objects/{sha}", headers=hdr).status_code == 404
            assert not remote.has_object(sha)
        # lookups: the other namespace's private document never matches ...
        private = "globex/notes.txt" if ns == "acme" else "acme/faq.md"
        r = httpx.post(f"{url}/v1/lookup", headers=hdr,
                       json={"fingerprint": lm.fingerprint, "label": "full", "token_ids": ids[private]}).json()
        assert r == {"matched_tokens": 0, "chunk_tokens": None, "chunks": []}
        h0 = chain_hashes(ids[private], CHUNK, lm.fingerprint)[0]
        assert remote.lookup_chunk(lm.fingerprint, "full", h0) is None
        # ... and a prefix both namespaces store resolves to this token's own copy
        shared = remote.lookup_prefix(lm.fingerprint, "full", ids["acme/manual.md"])
        assert shared["matched_tokens"] == len(ids["acme/manual.md"])
        assert {c["doc_id"] for c in shared["chunks"]} == {"acme/manual.md" if ns == "acme" else "globex/manual-copy.md"}
        assert {c["object"] for c in shared["chunks"]} <= owned[ns]
    assert everyone.lookup_prefix(lm.fingerprint, "full", ids["globex/notes.txt"])["matched_tokens"] > 0


def test_ask_remote_matches_local(lm, served, auth_server, token_files):
    """`kdnctl ask --remote` (a real CLI run) answers exactly like a local ask of the same store
    (computed in-process with the session model, as ask_cmd does, to save a model load)."""
    from kdnctl.engine.hf import generate, load_document

    root, _ = served
    url, _ = auth_server
    question = "How long does it take to charge the battery?"
    suffix = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, question)
    with Store(root, create=False) as st:
        ctx = load_document(lm, st, "acme/manual.md", "full")
        local = generate(lm, ctx, suffix, max_new_tokens=16)
        nbytes = st.get_version("acme/manual.md").nbytes
    proc = run_cli("ask", "acme/manual.md", question, "--json", "--max-new-tokens", "16", "--remote", url,
                   "--token-file", token_files / "tok-acme", check=True)
    out = json.loads(proc.stdout)
    assert local.answer and out["answer"] == local.answer
    assert out["bundle_bytes"] == nbytes and out["context_tokens"] == ctx.n_tokens


# -- robustness ------------------------------------------------------------------------------------

def test_32_concurrent_clients_download_everything(served, open_url):
    root, _ = served
    objs = _objects(root)
    expected = {s: hashlib.sha256(_file(root, s)).hexdigest() for s in objs}
    remote = RemoteStore(open_url)
    errors, got = [], []

    def worker(i):
        try:
            order = objs[i % len(objs):] + objs[:i % len(objs)]
            for sha in order[: max(4, len(objs) // 3)]:  # every object many times over, ~3 GB less
                got.append((sha, hashlib.sha256(remote.read_object(sha)).hexdigest()))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert len(got) == 32 * max(4, len(objs) // 3) and all(expected[s] == h for s, h in got)
    assert {s for s, _ in got} == set(objs)
    fetched = RemoteStore(open_url).fetch_objects(objs, max_workers=16)
    assert {s: hashlib.sha256(d).hexdigest() for s, d in fetched.items()} == expected


def test_server_restarted_mid_download(tmp_path):
    """A 64 MB object; after the first block the server is killed and a new one started on the
    same port: the client resumes with Range from what it has and still verifies the hash.
    (64 MB: more than loopback socket buffers hold, so the kill really cuts the transfer.)"""
    root = tmp_path / "store"
    data = random.Random(7).randbytes(64 << 20)
    with Store(root) as st, st.writer():
        sha = st.put_object(data)
    port = free_port()
    procs = [start_cli_server(root, port)]
    remote = RemoteStore(f"http://127.0.0.1:{port}", retries=4)

    def break_once(_sha, received):
        if len(procs) == 1 and received < len(data):
            procs[0].kill()
            procs[0].communicate()
            procs.append(start_cli_server(root, port))

    remote.on_block = break_once
    try:
        assert remote.read_object(sha) == data
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.communicate(timeout=30)
    assert len(procs) == 2 and remote.stats["retries"] >= 1 and remote.stats["resumed"] >= 1
    assert remote.stats["bytes"] < 2 * len(data)  # resumed, not restarted from zero


def test_corrupted_object_on_the_server_is_refused(served, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(served[0], root)
    with Store(root, create=False) as st:
        ver = st.get_version("acme/manual.md")
    sha = ver.chunks[1].object
    damage_object(root, sha)
    srv = ThreadServer(root)
    try:
        cache = tmp_path / "cache"
        remote = RemoteStore(srv.url, cache_dir=cache)
        with pytest.raises(StoreCorruptError, match="corrupted"):
            remote.read_object(sha)
        with pytest.raises(StoreCorruptError):
            remote.fetch_objects([c.object for c in ver.chunks])
        assert not (cache / sha[:2] / sha).exists()
        good = ver.chunks[0].object
        assert remote.read_object(good) == _file(root, good) and (cache / good[:2] / good).is_file()
        before = dict(remote.stats)
        assert remote.read_object(good) == _file(root, good)
        assert remote.stats["requests"] == before["requests"] and remote.stats["cache_hits"] == before["cache_hits"] + 1
        (cache / good[:2] / good).write_bytes(b"damaged cache entry")  # re-fetched, not trusted
        assert remote.read_object(good) == _file(root, good)
    finally:
        srv.stop()


def test_pull_mirrors_into_a_store_that_verifies(served, auth_server, token_files, tmp_path):
    root, _ = served
    url, _ = auth_server
    local = tmp_path / "mirror"
    tok = ["--token-file", token_files / "tok-acme"]
    proc = run_cli("pull", url, *tok, "--json", store=local, check=True)
    report = json.loads(proc.stdout)
    assert report["pulled"] == ACME and report["objects"] > 0
    assert run_cli("verify", store=local).returncode == 0
    with Store(root, create=False) as src, Store(local, create=False) as dst:
        for doc_id in ACME:
            assert dst.get_document(doc_id) == src.get_document(doc_id)
            assert dst.list_versions(doc_id) == src.list_versions(doc_id)
        assert [d.doc_id for d in dst.list_documents()] == ACME  # globex stayed invisible
    again = json.loads(run_cli("pull", url, *tok, "--json", store=local, check=True).stdout)
    assert again["unchanged"] == ACME and again["objects"] == 0
    missing = run_cli("pull", url, "acme/faq.md", "--label", "nope", *tok, store=local)
    assert missing.returncode == 4 and "nope" in missing.stderr
    (tmp_path / "wrong").write_text("not-a-token\n")
    denied = run_cli("pull", url, "--token-file", tmp_path / "wrong", store=tmp_path / "m2")
    assert denied.returncode == 9 and "--token-file" in denied.stderr


def test_serve_files_graceful_shutdown_and_access_log(auth_server):
    url, proc = auth_server
    assert httpx.get(f"{url}/v1/docs", headers={"authorization": "Bearer tok-all"}).status_code == 200
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out == ""  # stdout stays clean: the log goes to stderr
    assert '"GET /v1/docs HTTP/1.1" 200' in err and "tok-all" not in err


def test_serve_files_needs_a_store(tmp_path):
    proc = run_cli("serve-files", "--port", str(free_port()), store=tmp_path / "none", own_process=True)
    assert proc.returncode == 4 and "no kdnctl store" in proc.stderr
