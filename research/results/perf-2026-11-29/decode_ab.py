"""The batch ec decoder of two checkouts on the same stored version, alternated in one shell
loop (see README.md here): wall and CPU seconds (all threads) of ``ec_batch.decode_into``.

    PYTHONPATH=<checkout> python research/results/perf-2026-11-29/decode_ab.py STORE LABEL
"""
import statistics
import sys
import time
from pathlib import Path

import torch

from kdnctl.bundle import decode_bundle
from kdnctl.quant import ec_batch
from kdnctl.store import Store

torch.set_num_threads(1)
store = Store(Path(sys.argv[1]))
doc = store.list_documents()[0].doc_id
version = store.get_version(doc, "default")
bundles = [decode_bundle(bytes(store.read_object(c.object))) for c in version.chunks]
n_layers, q = bundles[0].n_layers, bundles[0].meta["quant"]
n_tokens = sum(b.n_tokens for b in bundles)
out = tuple(torch.empty(n_layers, q["n_heads"], n_tokens, q["head_dim"]) for _ in range(2))
starts = [sum(b.layer_len(0) for b in bundles[:i]) for i in range(len(bundles))]
gb = 2 * out[0].numel() * 4 / 1e9
assert ec_batch.eligible(bundles, n_layers, q, out)
for w in (1, 2):
    ec_batch.decode_into(out, bundles, starts, q, workers=w)
    wall, cpu = [], []
    for _ in range(7):
        t, c = time.perf_counter(), time.process_time()
        ec_batch.decode_into(out, bundles, starts, q, workers=w)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    mw, mc = statistics.median(wall), statistics.median(cpu)
    print(f"| {sys.argv[2]} | {n_tokens} | {w} | {mw:.4f} | {gb / mw:.2f} | {mc:.4f} | {gb / mc:.2f} |", flush=True)
