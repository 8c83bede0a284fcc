"""Benchmark `kdnctl serve-files`: bundle download throughput and latency, next to nginx.

    .venv/bin/python bench/serve.py [--store PATH] [--clients 1,8,32] [--seconds 1] [--rounds 7]

Without --store a synthetic store is built: N objects the size of one 256-token SmolLM2 fp32
chunk (11.8 MB), committed as one document, so the server sees a realistic catalog. Each
client is a thread with its own keep-alive connection that downloads objects back to back
(round robin, different start per client) for --seconds; latency is request to last byte.
The benchmark client does not hash (it measures the server).

nginx (Debian package `nginx` or `nginx-light`), when installed, serves the same objects
directory on another loopback port in the same run, with sendfile; access logs are off on
both servers. With nginx present a third server is measured: kdnctl's production path,
`kdnctl serve-files --emit-nginx-config` behind the nginx it configures, where kdnctl checks
auth, namespace and object ownership (a restricted token is used) and nginx sends the bytes
(X-Accel-Redirect). Where nginx has the secure_link module a fourth: the same with
`--signed-links`, where the version listing (answered by kdnctl to the token) carries a signed
link per object and nginx checks the link and sends the file without asking kdnctl; the
load clients read the listing once, as the verifying client does. Rounds are interleaved (each round runs every server at every level, in
an order rotated per round) and each server's share of nginx is the median of per-round
ratios against that round's nginx run: on a shared machine the load from other jobs moves
both sides of a pair alike.

A second table measures the client in the same rounds, against the fastest production path
present (signed links, else X-Accel): a raw download with no check (into one reused buffer:
the transport's ceiling; into a new buffer per object, all kept: what any client that hands
the bytes on pays), and the verifying
client (`RemoteStore.fetch_objects`, every byte checked against the BLAKE3 the version
listing records) at 1 and 4 parallel downloads: into pooled memory an earlier fetch of the
process released (a process that loads repeatedly), and with the pool emptied first (fresh
memory: a process's first fetch). The load average is printed with the table.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kdnctl.store.client import RemoteStore  # noqa: E402
from kdnctl.store import ChunkRef, DocumentRecord, Store, VersionRecord  # noqa: E402

CHUNK_BYTES = 256 * 46_080  # one 256-token chunk of SmolLM2-135M KV in fp32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_store(root: Path, n: int, size: int) -> list[str]:
    fp = "bench" + "0" * 11
    with Store(root) as st, st.writer():  # doc id in namespace `bench` (the x-accel token's grant)
        chunks = []
        for i in range(n):
            data = os.urandom(size)
            chunks.append(ChunkRef(i, st.put_object(data), i * 256, (i + 1) * 256, f"{i:064x}", size))
        text = st.put_object(b"synthetic benchmark document")
        now = time.time()
        st.commit_document(DocumentRecord("bench/doc", "v1", "0" * 64, "bench", n * 256, fp, text, now),
                           VersionRecord("bench/doc", "v1", "full", None, {"chunk_tokens": 256}, fp, chunks, now, n * 256))
    return [c.object for c in chunks]


def store_objects(root: Path) -> list[str]:
    with Store(root, create=False) as st:
        return sorted({c.object for v in st.list_versions() for c in v.chunks})


def wait_up(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited: {proc.communicate()[1]}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            if time.time() > deadline:
                raise SystemExit(f"{what} did not start")
            time.sleep(0.1)


def start_kdnctl(root: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "kdnctl.cli.app", "serve-files", "--port", str(port), "--store", str(root),
           "--no-access-log"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_up(f"http://127.0.0.1:{port}/v1/health", proc, "kdnctl serve-files")
    return proc, port


def start_accel(root: Path, work: Path, signed: bool = False) -> tuple[subprocess.Popen, int, subprocess.Popen] | None:
    """kdnctl serve-files with a restricted token file + the nginx config it emits (with
    ``signed``: --signed-links, nginx checks links from the version listing)."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        return None
    kport, nport = free_port(), free_port()
    (work / "tokens").write_text(f"{TOKEN} bench\n")
    conf = work / "nginx.conf"
    cmd = [sys.executable, "-m", "kdnctl.cli.app", "serve-files", "--port", str(kport), "--store", str(root),
           "--no-access-log", "--token-file", str(work / "tokens"), "--emit-nginx-config", str(conf),
           "--nginx-listen", f"127.0.0.1:{nport}"] + (["--signed-links"] if signed else [])
    if os.geteuid() == 0:
        cmd += ["--nginx-user", "root"]
    kd = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_up(f"http://127.0.0.1:{kport}/v1/health", kd, "kdnctl serve-files (x-accel)")
    ng = subprocess.Popen([binary, "-c", str(conf), "-g", "daemon off;"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wait_up(f"http://127.0.0.1:{nport}/v1/health", ng, "nginx (x-accel)")
    return ng, nport, kd


TOKEN = "bench-token"


def start_nginx(root: Path, work: Path) -> tuple[subprocess.Popen, int] | None:
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        return None
    port = free_port()
    for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (work / d).mkdir(exist_ok=True)
    user = "user root;" if os.geteuid() == 0 else ""  # workers must read the (0700) temp store
    conf = work / "nginx.conf"
    conf.write_text(f"""
{user}
daemon off;
worker_processes auto;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  sendfile on; tcp_nopush on; keepalive_requests 100000;
  client_body_temp_path {work}/body; proxy_temp_path {work}/proxy; fastcgi_temp_path {work}/fastcgi;
  uwsgi_temp_path {work}/uwsgi; scgi_temp_path {work}/scgi;
  default_type application/octet-stream;
  server {{
    listen 127.0.0.1:{port};
    root {root};
    location ~ "^/v1/objects/(?<fan>[0-9a-f]{{2}})(?<rest>[0-9a-f]{{62}})$" {{
      add_header Cache-Control "public, max-age=31536000, immutable";
      try_files /objects/$fan/$fan$rest =404;
    }}
    location = /health {{ return 200 "ok"; }}
  }}
}}
""")
    proc = subprocess.Popen([binary, "-c", str(conf), "-p", str(work)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wait_up(f"http://127.0.0.1:{port}/health", proc, "nginx")
    return proc, port


def signed_links(port: int) -> dict[str, str]:
    """sha -> signed query string, from the version listing (what a client reads first)."""
    rec = httpx.get(f"http://127.0.0.1:{port}/v1/docs/bench%2Fdoc/versions/full",
                    headers={"authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    return rec["links"]


def objpath(sha: str, links: dict | None) -> str:
    return f"/v1/objects/{sha}?{links[sha]}" if links else f"/v1/objects/{sha}"


def download(conn: http.client.HTTPConnection, sha: str, buf: bytearray, headers: dict | None = None,
             links: dict | None = None) -> int:
    conn.request("GET", objpath(sha, links), headers=headers or {})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status} for {sha[:12]}")
    view, total = memoryview(buf), 0
    while True:
        n = resp.readinto(view)
        if not n:
            return total
        total += n


def run_level(port: int, objects: list[str], clients: int, seconds: float, headers: dict | None = None,
              links: dict | None = None) -> dict:
    latencies: list[float] = []
    nbytes = [0]
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        buf = bytearray(1 << 20)
        start.wait()
        deadline = time.perf_counter() + seconds
        k, mine, got = i, [], 0
        while time.perf_counter() < deadline or not mine:
            t = time.perf_counter()
            got += download(conn, objects[k % len(objects)], buf, headers, links)
            mine.append(time.perf_counter() - t)
            k += 1
        conn.close()
        with lock:
            latencies.extend(mine)
            nbytes[0] += got

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"mbps": nbytes[0] / wall / 1e6, "p50": statistics.median(lat) * 1e3,
            "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3, "n": len(lat)}


def raw_fetch(port: int, objects: list[str], workers: int, headers: dict | None, keep: bool,
              links: dict | None = None) -> float:
    """Baselines for the verifying client, no check: each worker downloads its share over one
    keep-alive connection. ``keep``: every object into its own new buffer, kept to the end (what
    any client that hands the bytes on pays: fresh memory); else into one reused buffer (the
    transport's ceiling)."""
    from kdnctl.store.fastread import new_buffer

    kept: list = []
    totals: list[int] = []

    def worker(mine: list[str]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        scratch = bytearray(1 << 20)
        for sha in mine:
            conn.request("GET", objpath(sha, links), headers=headers or {})
            resp = conn.getresponse()
            size = int(resp.getheader("content-length"))
            buf = new_buffer(size) if keep else scratch
            view, got = memoryview(buf), 0
            while got < size:
                n = resp.readinto(view[got:] if keep else view)
                if not n:
                    raise RuntimeError("short body")
                got += n
            if keep:
                kept.append(buf)
            totals.append(got)
        conn.close()

    t = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(objects[i::workers],)) for i in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(totals) / (time.perf_counter() - t) / 1e6


def verified_fetch(url: str, objects: list[str], workers: int, token: str | None, cold: bool = False) -> float:
    """The engine's path: RemoteStore learns each object's BLAKE3 from the version listing (as
    load_document does), then downloads and checks every byte; all objects kept to the end.
    Downloads land in pooled memory that earlier fetches of this process released
    (kdnctl/store/arena.py); ``cold``: the pool emptied first (a process's first fetch: fresh memory)."""
    from kdnctl.store.arena import FETCH_POOL

    with RemoteStore(url, token=token, max_workers=workers) as remote:
        remote.list_versions()
        remote.fetch_objects(objects[:1])  # connections up, as for the raw rows
        if cold:
            FETCH_POOL.clear()
        t = time.perf_counter()
        got = remote.fetch_objects(objects)
        wall = time.perf_counter() - t
        return sum(len(d) for d in got.values()) / wall / 1e6


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", type=Path, help="serve this store (default: a synthetic one)")
    ap.add_argument("--objects", type=int, default=16, help="synthetic objects")
    ap.add_argument("--object-bytes", type=int, default=CHUNK_BYTES)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=1.0, help="per server, concurrency level and round")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (medians)")
    ap.add_argument("--workers", default="1,4", help="verifying-client parallel downloads")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    load0 = loadavg()
    with tempfile.TemporaryDirectory(prefix="kdn-bench-") as tmp:
        tmp = Path(tmp)
        if args.store:
            root, objects = args.store.resolve(), store_objects(args.store)
        else:
            root = tmp / "store"
            objects = build_store(root, args.objects, args.object_bytes)
        sizes = [(root / "objects" / s[:2] / s).stat().st_size for s in objects]
        size = sum(sizes) / len(objects)
        servers = {SERVE: start_kdnctl(root)}
        (tmp / "nginx").mkdir()
        (tmp / "accel").mkdir()
        ng = start_nginx(root, tmp / "nginx")
        extra = []
        auth = {ACCEL: {"authorization": f"Bearer {TOKEN}"}, SIGNED: {"authorization": f"Bearer {TOKEN}"}}
        links: dict = {}
        if ng:
            servers[NGINX] = ng
            accel = start_accel(root, tmp / "accel")
            servers[ACCEL] = accel[:2]
            extra.append(accel[2])
            if "secure_link" in subprocess.run([ng[0].args[0], "-V"], capture_output=True, text=True).stderr:
                (tmp / "signed").mkdir()
                sig = start_accel(root, tmp / "signed", signed=True)
                servers[SIGNED] = sig[:2]
                extra.append(sig[2])
                links[SIGNED] = signed_links(sig[1])
        else:
            print("nginx is absent (install the Debian package `nginx` to compare); kdnctl only\n", file=sys.stderr)
        mbps: dict = {}
        shares: dict = {}
        last: dict = {}
        client: dict = {}
        names = list(servers)
        try:
            for name in names:  # warm page cache and connections
                run_level(servers[name][1], objects, 1, 0.3, auth.get(name), links.get(name))
            for rnd in range(args.rounds):
                # interleaved rounds, server order rotated every round: a load change from other
                # jobs hits every server alike, and no server always runs first
                for c in levels:
                    got = {}
                    for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                        r = run_level(servers[name][1], objects, c, args.seconds, auth.get(name), links.get(name))
                        got[name] = r["mbps"]
                        mbps.setdefault((name, c), []).append(r["mbps"])
                        last[(name, c)] = r
                    for name in names:  # paired: each round's share against the same round's nginx
                        if NGINX in got:
                            shares.setdefault((name, c), []).append(got[name] / got[NGINX])
                # the client: raw downloads (no check) and the verifying client, same round
                target = next(n for n in (SIGNED, ACCEL, SERVE) if n in servers)
                port, hdr, lk = servers[target][1], auth.get(target), links.get(target)
                tok = TOKEN if target != SERVE else None
                for w in workers:
                    client.setdefault(("raw, one reused buffer (no check)", w), []).append(
                        raw_fetch(port, objects, w, hdr, keep=False, links=lk))
                    client.setdefault(("raw, a new buffer per object, kept (no check)", w), []).append(
                        raw_fetch(port, objects, w, hdr, keep=True, links=lk))
                    client.setdefault(("RemoteStore.fetch_objects, fresh memory (every byte checked)", w),
                                      []).append(verified_fetch(f"http://127.0.0.1:{port}", objects, w, tok, cold=True))
                    client.setdefault(("RemoteStore.fetch_objects (every byte checked)", w), []).append(
                        verified_fetch(f"http://127.0.0.1:{port}", objects, w, tok))
        finally:
            for proc, _ in servers.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
            for proc in extra:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    med = statistics.median
    print(f"{len(objects)} objects of {size / 1e6:.1f} MB, loopback, {os.cpu_count()} CPU cores, "
          f"{args.seconds:g} s per row and round, {args.rounds} interleaved rounds; "
          f"load average {load0} at start, {loadavg()} at end\n")
    print("MB/s: median over rounds; share of nginx: median of the per-round ratios (each round's "
          "nginx run is its pair); latency from the last round\n")
    print("| server | concurrent clients | MB/s | share of nginx | share range | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        for c in levels:
            r, sh = last[(name, c)], shares.get((name, c))
            share = f"{100 * med(sh):.0f}%" if sh else ""
            rng = f"{100 * min(sh):.0f}-{100 * max(sh):.0f}%" if sh and name != NGINX else ""
            print(f"| {name} | {c} | {med(mbps[(name, c)]):,.0f} | {share} | {rng} | {r['p50']:.1f} | {r['p99']:.1f} |")
    print(f"\nClient, downloading all {len(objects)} objects from `{target}`, the same rounds "
          "(MB/s, median over rounds; share of the raw download into new buffers):\n")
    print("| client | parallel downloads | MB/s | share of raw (new buffers) |")
    print("|---|---:|---:|---:|")
    for (what, w), vals in client.items():
        base = med(client[("raw, a new buffer per object, kept (no check)", w)])
        print(f"| {what} | {w} | {med(vals):,.0f} | {100 * med(vals) / base:.0f}% |")


SERVE = "kdnctl serve-files"
NGINX = "nginx"
ACCEL = "kdnctl + nginx (X-Accel-Redirect, token checked)"
SIGNED = "kdnctl + nginx (--signed-links, token checked at the listing)"


if __name__ == "__main__":
    main()
