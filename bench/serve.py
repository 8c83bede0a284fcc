"""Benchmark `kdnctl serve-files`: bundle download throughput and latency, next to nginx.

    .venv/bin/python bench/serve.py [--store PATH] [--clients 1,8,32] [--seconds 5]

Without --store a synthetic store is built: N objects the size of one 256-token SmolLM2 fp32
chunk (11.8 MB), committed as one document, so the server sees a realistic catalog. Each
client is a thread with its own keep-alive connection that downloads objects back to back
(round robin, different start per client) for --seconds; latency is request to last byte.
The benchmark client does not hash (it measures the server); one extra row shows the real
engine path, RemoteStore.fetch_objects, which verifies every object.

nginx (Debian package `nginx` or `nginx-light`), when installed, serves the same objects
directory on another loopback port in the same run, with sendfile; access logs are off on
both servers. With nginx present a third server is measured: kdnctl's production path,
`kdnctl serve-files --emit-nginx-config` behind the nginx it configures, where kdnctl checks
auth, namespace and object ownership (a restricted token is used) and nginx sends the bytes
(X-Accel-Redirect). Prints a markdown table and each server's MB/s as a share of nginx's.
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

from kdnctl.client import RemoteStore  # noqa: E402
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


def start_accel(root: Path, work: Path) -> tuple[subprocess.Popen, int, subprocess.Popen] | None:
    """kdnctl serve-files with a restricted token file + the nginx config it emits."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        return None
    kport, nport = free_port(), free_port()
    (work / "tokens").write_text(f"{TOKEN} bench\n")
    conf = work / "nginx.conf"
    cmd = [sys.executable, "-m", "kdnctl.cli.app", "serve-files", "--port", str(kport), "--store", str(root),
           "--no-access-log", "--token-file", str(work / "tokens"), "--emit-nginx-config", str(conf),
           "--nginx-listen", f"127.0.0.1:{nport}"]
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


def download(conn: http.client.HTTPConnection, sha: str, buf: bytearray, headers: dict | None = None) -> int:
    conn.request("GET", f"/v1/objects/{sha}", headers=headers or {})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status} for {sha[:12]}")
    view, total = memoryview(buf), 0
    while True:
        n = resp.readinto(view)
        if not n:
            return total
        total += n


def run_level(port: int, objects: list[str], clients: int, seconds: float, headers: dict | None = None) -> dict:
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
            got += download(conn, objects[k % len(objects)], buf, headers)
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


def verified_fetch(url: str, objects: list[str], workers: int) -> float:
    remote = RemoteStore(url, max_workers=workers)
    remote.list_versions()  # what an engine does first: the version names the objects (and their BLAKE3)
    t = time.perf_counter()
    total = sum(len(d) for d in remote.fetch_objects(objects).values())
    return total / (time.perf_counter() - t) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", type=Path, help="serve this store (default: a synthetic one)")
    ap.add_argument("--objects", type=int, default=16, help="synthetic objects")
    ap.add_argument("--object-bytes", type=int, default=CHUNK_BYTES)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=3.0, help="per server, concurrency level and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory(prefix="kdn-bench-") as tmp:
        tmp = Path(tmp)
        if args.store:
            root, objects = args.store.resolve(), store_objects(args.store)
        else:
            root = tmp / "store"
            objects = build_store(root, args.objects, args.object_bytes)
        size = sum((root / "objects" / s[:2] / s).stat().st_size for s in objects) / len(objects)
        servers = {"kdnctl serve-files": start_kdnctl(root)}
        (tmp / "nginx").mkdir()
        (tmp / "accel").mkdir()
        ng = start_nginx(root, tmp / "nginx")
        extra = []
        auth = {"kdnctl + nginx (X-Accel-Redirect, token checked)": {"authorization": f"Bearer {TOKEN}"}}
        if ng:
            servers["nginx"] = ng
            accel = start_accel(root, tmp / "accel")
            servers["kdnctl + nginx (X-Accel-Redirect, token checked)"] = accel[:2]
            extra.append(accel[2])
        else:
            print("nginx is absent (install the Debian package `nginx` to compare); kdnctl only\n", file=sys.stderr)
        rows, mbps = [], {}
        try:
            for rnd in range(args.rounds):  # interleaved rounds: load changes hit every server alike
                for name, (proc, port) in servers.items():
                    run_level(port, objects, 1, 0.5, auth.get(name))  # warm page cache and connections
                    for c in levels:
                        r = run_level(port, objects, c, args.seconds, auth.get(name))
                        mbps.setdefault((name, c), []).append(r["mbps"])
                        if rnd == args.rounds - 1:
                            r["mbps"] = statistics.median(mbps[(name, c)])
                            rows.append((name, c, r))
            port = servers["kdnctl serve-files"][1]
            vrows = []
            for w in (8,):
                vrows.append((w, verified_fetch(f"http://127.0.0.1:{port}", objects, w)))
        finally:
            for proc, _ in servers.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
            for proc in extra:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    print(f"{len(objects)} objects of {size / 1e6:.1f} MB, loopback, {os.cpu_count()} CPU cores, "
          f"{args.seconds:g} s per row\n")
    ref = {c: r["mbps"] for name, c, r in rows if name == "nginx"}
    print(f"MB/s: median of {args.rounds} interleaved rounds; latency from the last round\n")
    print("| server | concurrent clients | MB/s | share of nginx | p50 ms | p99 ms | downloads |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, c, r in rows:
        share = f"{100 * r['mbps'] / ref[c]:.0f}%" if c in ref else ""
        print(f"| {name} | {c} | {r['mbps']:,.0f} | {share} | {r['p50']:.1f} | {r['p99']:.1f} | {r['n']} |")
    for w, v in vrows:
        print(f"| kdnctl RemoteStore.fetch_objects (verified) | {w} workers | {v:,.0f} | | | | {len(objects)} |")


if __name__ == "__main__":
    main()
