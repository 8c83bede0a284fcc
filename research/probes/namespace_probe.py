"""Namespace probe timing: is "stored in another namespace" distinguishable from "absent"?

    python bench/namespace_probe.py [--docs 200] [--samples 3000]

One run, one store (``--docs`` documents in each of two namespaces, tiny real bundles):
1. in-process, the lookup a restricted token makes (``find_chunk``) for a chain hash stored only
   in the other namespace vs one stored nowhere, interleaved, medians compared; and the same
   for the lookup serve-files made before issue 10 (find any hit, then check the namespace),
   as the same-run baseline;
2. over HTTP on loopback (real uvicorn), GET /v1/chunks/... with namespace A's token for both
   kinds of hash, interleaved.
Prints medians (µs), the other/absent ratio, and the median (and quartiles) of the paired
difference between adjacent samples, the estimate least disturbed by other load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
from httpkit import ThreadServer  # noqa: E402
from storekit import FP, add_doc, chain  # noqa: E402

from kdnctl.server import Access, find_chunk  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def old_find_chunk(store: Store, access: Access, fp: str, label: str, h: str):
    """serve-files before issue 10: the store's preferred hit, THEN the namespace check."""
    hit = store.lookup_chunk(fp, label, h)
    if hit is None or access.sees(hit[0].doc_id):
        return hit
    return None


def interleaved(fn_a, fn_b, samples: int) -> tuple[float, float, float, float, float]:
    """Medians of a and b, then the median and quartiles of the PAIRED difference a_i - b_i
    (adjacent samples, order alternating), which cancels drift from other load on the machine."""
    a, b = [], []
    for i in range(samples):
        for fn, out in ((fn_a, a), (fn_b, b)) if i % 2 else ((fn_b, b), (fn_a, a)):
            t = time.perf_counter_ns()
            fn()
            out.append(time.perf_counter_ns() - t)
    d = sorted((x - y) / 1000 for x, y in zip(a, b))
    q1, q3 = d[len(d) // 4], d[3 * len(d) // 4]
    return statistics.median(a) / 1000, statistics.median(b) / 1000, statistics.median(d), q1, q3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--samples", type=int, default=3000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "kdn"
        with Store(root) as st:
            for i in range(args.docs):
                add_doc(st, f"acme/a{i}.md", f"acme {i}".encode(), (f"a{i}".encode(),) * 4, salt=f"acme{i}")
                add_doc(st, f"globex/b{i}.md", f"globex {i}".encode(), (f"b{i}".encode(),) * 4, salt=f"globex{i}")
        other, absent = chain(1, "globex7"), "ab" * 32
        acme = Access(("acme",))
        rows = []
        with Store(root, create=False) as st:
            assert find_chunk(st, acme, FP, "full", other) is None and old_find_chunk(st, acme, FP, "full", other) is None
            for name, fn in (("find_chunk (now)", find_chunk), ("lookup then check (before)", old_find_chunk)):
                rows.append((name, *interleaved(lambda: fn(st, acme, FP, "full", other),
                                                lambda: fn(st, acme, FP, "full", absent), args.samples)))
        tokens = {"tok-a": ["acme"]}
        with ThreadServer(root, tokens=tokens) as srv, httpx.Client(base_url=srv.url,
                                                                     headers={"authorization": "Bearer tok-a"}) as c:
            def probe(h):
                r = c.get(f"/v1/chunks/{FP}/full/{h}")
                assert r.status_code == 404
            rows.append(("GET /v1/chunks over HTTP (now)",
                         *interleaved(lambda: probe(other), lambda: probe(absent), max(200, args.samples // 5))))
    print(f"{args.docs} documents per namespace, {args.samples} interleaved samples (HTTP: {max(200, args.samples // 5)})")
    print("| path | other namespace, median µs | absent, median µs | other/absent | paired difference, median [IQR] µs |")
    print("|---|---|---|---|---|")
    for name, o, a, d, q1, q3 in rows:
        print(f"| {name} | {o:.1f} | {a:.1f} | {o / a:.3f} | {d:+.1f} [{q1:+.1f}, {q3:+.1f}] |")


if __name__ == "__main__":
    main()
