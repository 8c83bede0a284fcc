"""The nginx hand-off, with REAL nginx: `kdnctl serve-files --emit-nginx-config` writes the
config, nginx proxies every request to kdnctl, and kdnctl answers allowed object downloads with
X-Accel-Redirect so nginx sends the bytes. Auth and namespaces stay kdnctl's: a token never gets
another namespace's object through nginx, and the internal location is unreachable directly.
Skips (with the reason) where nginx is not installed; scripts/install.sh installs it as root."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kdnctl.store.client import RemoteStore
from kdnctl.errors import NotFoundError
from kdnctl.server.nginx import link_query
from kdnctl.store import ChunkRef, DocumentRecord, Store, VersionRecord

REPO = Path(__file__).resolve().parent.parent
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/install.sh installs it "
                                "when run as root with apt-get)")
TOKENS = {"tok-acme": "acme", "tok-globex": "globex", "tok-all": "*"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _put_doc(st: Store, doc_id: str, payloads: list[bytes]) -> list[str]:
    chunks = [ChunkRef(i, st.put_object(p), i * 8, (i + 1) * 8, f"{doc_id}{i}".encode().hex().ljust(64, "0")[:64], len(p))
              for i, p in enumerate(payloads)]
    text = st.put_object(doc_id.encode())
    now = time.time()
    st.commit_document(DocumentRecord(doc_id, "v1", "0" * 64, "test", 8 * len(payloads), "fp-test", text, now),
                       VersionRecord(doc_id, "v1", "full", None, {}, "fp-test", chunks, now, 8 * len(payloads)))
    return [c.object for c in chunks]


def _wait(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 90
    while True:
        assert proc.poll() is None, f"{what} exited: {proc.communicate()[1]}"
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.TransportError:
            assert time.time() < deadline, f"{what} did not come up"
            time.sleep(0.1)


def _front(tmp_path_factory, *extra: str):
    """A store with two namespaces behind kdnctl serve-files + the nginx it configured."""
    root = tmp_path_factory.mktemp("store")
    with Store(root) as st, st.writer():
        acme = _put_doc(st, "acme/manual.md", [os.urandom(300_000), os.urandom(5_000)])
        globex = _put_doc(st, "globex/notes.txt", [os.urandom(200_000)])
    work = tmp_path_factory.mktemp("nginx")
    (work / "tokens").write_text("".join(f"{t} {ns}\n" for t, ns in TOKENS.items()))
    kport, nport = _port(), _port()
    conf = work / "nginx.conf"
    cmd = [sys.executable, "-m", "kdnctl.cli.app", "serve-files", "--port", str(kport), "--store", str(root),
           "--token-file", str(work / "tokens"), "--no-access-log", "--emit-nginx-config", str(conf),
           "--nginx-listen", f"127.0.0.1:{nport}", *extra]
    if os.geteuid() == 0:  # nginx would drop to `nobody`, who cannot read pytest's 0700 temp dirs
        cmd += ["--nginx-user", "root"]
    kd = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ng = None
    try:
        _wait(f"http://127.0.0.1:{kport}/v1/health", kd, "kdnctl serve-files")
        assert conf.is_file() and "internal;" in conf.read_text()
        ng = subprocess.Popen([NGINX, "-c", str(conf), "-g", "daemon off;"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        _wait(f"http://127.0.0.1:{nport}/v1/health", ng, "nginx")
        yield {"root": root, "acme": acme, "globex": globex, "nginx": f"http://127.0.0.1:{nport}",
               "kdnctl": f"http://127.0.0.1:{kport}", "conf": conf}
    finally:
        for p in (ng, kd):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM if p is kd else signal.SIGQUIT)
                p.communicate(timeout=30)


@pytest.fixture(scope="module")
def fronted(tmp_path_factory):
    yield from _front(tmp_path_factory)


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    if "secure_link" not in subprocess.run([NGINX, "-V"], capture_output=True, text=True).stderr:
        pytest.skip("this nginx is built without the secure_link module (--signed-links needs it)")
    yield from _front(tmp_path_factory, "--signed-links", "--link-ttl", "300")


def _get(url: str, path: str, token: str | None = None, **headers) -> httpx.Response:
    if token:
        headers["authorization"] = f"Bearer {token}"
    return httpx.get(url + path, headers=headers, timeout=30)


def _bytes(root: Path, sha: str) -> bytes:
    return (root / "objects" / sha[:2] / sha).read_bytes()


def test_nginx_sends_the_bytes_kdnctl_allows(fronted):
    sha = fronted["acme"][0]
    r = _get(fronted["nginx"], f"/v1/objects/{sha}", "tok-acme")
    assert r.status_code == 200 and r.content == _bytes(fronted["root"], sha)
    assert hashlib.sha256(r.content).hexdigest() == sha
    assert r.headers["etag"] == f'"{sha}"' and "immutable" in r.headers["cache-control"]
    assert r.headers.get_list("accept-ranges") == ["bytes"]  # nginx's own, not kdnctl's as well
    # ranges are served by nginx from the file
    r = _get(fronted["nginx"], f"/v1/objects/{sha}", "tok-acme", range="bytes=1000-1999")
    assert r.status_code == 206 and r.content == _bytes(fronted["root"], sha)[1000:2000]
    # kdnctl itself only hands off: no body, the internal path
    r = _get(fronted["kdnctl"], f"/v1/objects/{sha}", "tok-acme")
    assert r.status_code == 200 and r.content == b"" and r.headers["x-accel-redirect"] == f"/_kdn_objects/{sha[:2]}/{sha}"
    # listings still come from kdnctl, through nginx
    assert [d["document"]["doc_id"] for d in _get(fronted["nginx"], "/v1/docs", "tok-acme").json()["documents"]] == ["acme/manual.md"]


def test_namespaces_and_auth_hold_through_nginx(fronted):
    other = fronted["globex"][0]
    for path in (f"/v1/objects/{other}",):
        r = _get(fronted["nginx"], path, "tok-acme")
        assert r.status_code == 404 and len(r.content) < 1000 and "x-accel-redirect" not in r.headers
    assert _get(fronted["nginx"], f"/v1/objects/{other}", "tok-globex").content == _bytes(fronted["root"], other)
    assert _get(fronted["nginx"], f"/v1/objects/{other}", "tok-all").status_code == 200
    assert _get(fronted["nginx"], f"/v1/objects/{other}").status_code == 401
    assert _get(fronted["nginx"], f"/v1/objects/{other}", "wrong-token").status_code == 401
    # the internal location cannot be asked for directly, with or without a token
    for token in (None, "tok-acme", "tok-all"):
        assert _get(fronted["nginx"], f"/_kdn_objects/{other[:2]}/{other}", token).status_code == 404
    # a client cannot smuggle the hand-off header in: nginx only honours it from the upstream
    r = _get(fronted["nginx"], f"/v1/objects/{fronted['acme'][0]}", "tok-acme",
             **{"x-accel-redirect": f"/_kdn_objects/{other[:2]}/{other}"})
    assert r.content == _bytes(fronted["root"], fronted["acme"][0])


def test_other_namespaces_objects_stay_closed_however_asked(fronted):
    """HEAD, Range, If-None-Match with the right ETag, a resume-style If-Range: every way of
    asking for another namespace's object through nginx gets kdnctl's 404 and no byte of it."""
    other = fronted["globex"][0]
    secret = _bytes(fronted["root"], other)
    url = f"{fronted['nginx']}/v1/objects/{other}"
    hdr = {"authorization": "Bearer tok-acme"}
    asks = [httpx.head(url, headers=hdr), httpx.get(url, headers={**hdr, "range": "bytes=0-99"}),
            httpx.get(url, headers={**hdr, "if-none-match": f'"{other}"'}),
            httpx.get(url, headers={**hdr, "range": "bytes=10-", "if-range": f'"{other}"'}),
            httpx.get(f"{url}?x=1", headers=hdr), httpx.get(url.replace("/v1/", "/v1//"), headers=hdr)]
    for r in asks:
        assert r.status_code == 404 and secret[:64] not in r.content and "x-accel-redirect" not in r.headers, r


def test_verifying_client_through_nginx(fronted):
    with RemoteStore(fronted["nginx"], token="tok-acme") as remote:
        remote.list_versions()  # learns the BLAKE3 digests and sizes, as the loader does
        got = remote.fetch_objects(fronted["acme"])
        assert all(hashlib.sha256(got[s]).hexdigest() == s for s in fronted["acme"])
        assert remote._pool._idle  # keep-alive connections through nginx, reused
        with pytest.raises(NotFoundError):
            remote.read_object(fronted["globex"][0])


# -- signed links (--signed-links): nginx checks the link, kdnctl is not asked per object -------------

def _secret(conf: Path) -> str:
    return re.search(r'secure_link_md5 "\$secure_link_expires\$uri (\S+)";', conf.read_text()).group(1)


def test_signed_links_are_issued_only_for_the_tokens_own_objects(signed):
    url, root = signed["nginx"], signed["root"]
    rec = _get(url, "/v1/docs/acme%2Fmanual.md/versions/full", "tok-acme").json()
    assert set(rec["links"]) == set(signed["acme"])
    for sha, query in rec["links"].items():  # the link alone opens the object, through nginx only
        r = httpx.get(f"{url}/v1/objects/{sha}?{query}")
        assert r.status_code == 200 and r.content == _bytes(root, sha) and r.headers["etag"] == f'"{sha}"'
        assert httpx.get(f"{signed['kdnctl']}/v1/objects/{sha}?{query}").status_code == 401  # kdnctl wants a token
    # another namespace's record is not answered, so no link for its objects exists ...
    assert _get(url, "/v1/docs/globex%2Fnotes.txt/versions/full", "tok-acme").status_code == 404
    other, mine = signed["globex"][0], signed["acme"][0]
    # ... and none can be made from one of ours: moved to another object, altered, or unsigned
    query = rec["links"][mine]
    e, sig = re.match(r"e=(\d+)&s=(.+)$", query).groups()
    assert httpx.get(f"{url}/v1/objects/{other}?{query}").status_code == 403
    assert httpx.get(f"{url}/v1/objects/{mine}?e={int(e) + 1}&s={sig}").status_code == 403
    assert httpx.get(f"{url}/v1/objects/{other}?e={e}").status_code == 401  # no signature: kdnctl, no token
    assert _get(url, f"/v1/objects/{other}?e={e}", "tok-acme").status_code == 404
    # an expired link, correctly signed, is refused with 410
    stale = link_query(mine, _secret(signed["conf"]), int(time.time()) - 1)
    assert httpx.get(f"{url}/v1/objects/{mine}?{stale}").status_code == 410
    fresh = link_query(mine, _secret(signed["conf"]), int(time.time()) + 60)
    assert httpx.get(f"{url}/v1/objects/{mine}?{fresh}").content == _bytes(root, mine)
    assert signed["conf"].stat().st_mode & 0o077 == 0  # the config holds the secret: owner only


def test_verifying_client_uses_signed_links_and_falls_back(signed):
    with RemoteStore(signed["nginx"], token="tok-acme") as remote:
        remote.get_version("acme/manual.md")
        assert set(remote._links) == set(signed["acme"])
        got = remote.fetch_objects(signed["acme"])
        assert all(hashlib.sha256(got[s]).hexdigest() == s for s in signed["acme"])
        sha = signed["acme"][0]
        remote._links[sha] = ("e=9999999999&s=forged", 9999999999)  # a stale secret after a restart
        assert remote.read_object(sha) == _bytes(signed["root"], sha) and sha not in remote._links
        with pytest.raises(NotFoundError):
            remote.read_object(signed["globex"][0])
