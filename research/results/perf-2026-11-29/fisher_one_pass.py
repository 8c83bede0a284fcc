# The one-pass layer Fisher against the draw-then-backward it replaced, on a 2,042-token document
# (every token, and every third token as an eviction keeps): python research/results/perf-2026-11-29/fisher_one_pass.py
# (reads a store of one ingested document at /tmp/wt61p/store2, made by bench/ttft.py's corpus text)
import torch, time
from pathlib import Path
from kdnctl.model import load_model
from kdnctl.store import Store
from kdnctl.bundle import decode_bundle
from kdnctl.allocate import layer_fisher as lf
lm = load_model(device="cpu", dtype="float32")
store = Store(Path("/tmp/wt61p/store2"))
doc = store.list_documents()[0].doc_id
v = store.get_version(doc, "full")
bundles = [decode_bundle(store.read_object(c.object)) for c in v.chunks]
ids = [i for b in bundles for i in b.token_ids.tolist()]
L = bundles[0].n_layers
keys = [torch.cat([b.layer_kv(i)[0].float() for b in bundles], 1) for i in range(L)]
values = [torch.cat([b.layer_kv(i)[1].float() for b in bundles], 1) for i in range(L)]
T = keys[0].shape[1]
probe = lf.probe_ids(lm, ids, int(bundles[0].meta.get("header_tokens", 0)))
w = 0.25 ** torch.randint(0, 3, (T,)).float()
for rows in (None, torch.arange(0, T, 3)):
    k = keys if rows is None else [x[:, rows] for x in keys]
    vv = values if rows is None else [x[:, rows] for x in values]
    ww = w if rows is None else w[rows]
    y, s = lf._draws(lm, k, vv, probe, T, 0)
    want = lf.signed_fisher(lm, k, vv, probe, T, ww, y, s)
    got = lf.channel_fisher(lm, k, vv, probe, T, ww, 0)
    print("tokens", k[0].shape[1], "bitwise equal:", all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got)), flush=True)
