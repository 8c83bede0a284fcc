"""Helpers of the size-budget end-to-end tests: a small store of trimmed example documents,
the fp16 size a budget is a fraction of, and RoPE written out from its definition."""

from __future__ import annotations

import torch

from conftest import EXAMPLES

from kdnctl.format.bundle import read_meta
from kdnctl.ingest.corpus import read_corpus
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.compress.sizing import fp16_bytes
from kdnctl.store import Store
from kdnctl.compress.refit import QUESTION_OFFSET, document_queries

DOCS = {"faq.md": 300, "meeting-notes-2026-03.txt": 220}  # document -> tokens kept


def trimmed_store(tmp_path_factory, lm, docs: dict[str, int] = DOCS) -> Store:
    """A store with the first tokens of each example document ingested in 128-token chunks."""
    docs_dir = tmp_path_factory.mktemp("docs")
    for name, n in docs.items():
        ids = lm.tokenizer((EXAMPLES / name).read_text(), add_special_tokens=False).input_ids[:n]
        (docs_dir / name).write_text(lm.tokenizer.decode(ids))
    corpus, _ = read_corpus([docs_dir])
    st = Store(tmp_path_factory.mktemp("store"))
    ingest_documents(st, lm, corpus, IngestOptions(chunk_tokens=128))
    return st


def fp16_size(st, doc: str) -> int:
    v = st.get_version(doc, "full")
    m = read_meta(st.read_object(v.chunks[0].object))["model"]
    return fp16_bytes(v.n_tokens, m["n_layers"], m["n_kv_heads"], m["head_dim"])


def role_width_nbytes(st, doc: str, label: str) -> int:
    """The stored bytes of a version had its ec code blobs given every frame of a role two bytes
    where any code needs two (width 2, what the scale is fitted on) instead of each frame its own
    width (width 3): the bytes the fit fills to the cap (the safetensors headers' offsets may
    print a digit longer or shorter: a few bytes per chunk)."""
    import zlib

    import numpy as np

    from kdnctl.format.bundle import decode_bundle

    v = st.get_version(doc, label)
    total = v.nbytes
    for c in v.chunks:
        for name, blob in decode_bundle(st.read_object(c.object)).tensors.items():
            raw = blob.numpy().tobytes()
            if not name.endswith(".codes") or raw[0] != 3:
                continue
            n = raw[1]
            sizes = np.frombuffer(raw, "<i4", n, 2).tolist()
            peaks = np.frombuffer(raw, "<i2", n, 2 + 4 * n).tolist()
            pos = 2 + 6 * n
            for size, peak in zip(sizes, peaks):
                radix = 2 * peak + 1
                if size and radix * radix > 256 and peak <= 127:  # one code per byte, in a byte: two bytes in width 2
                    data = np.frombuffer(zlib.decompress(raw[pos:pos + size], -15), np.int8).astype("<i2").tobytes()
                    z = zlib.compressobj(6, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
                    total += len(z.compress(data) + z.flush()) - size
                pos += size
    return total


def rope_by_hand(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotate-half RoPE of ``x [..., D]`` at ``pos [...]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[..., None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def assert_loads_as_decoded(lm, st, doc: str, label: str, by_hand) -> None:
    """The version loads locally with the logits of a decoder written in the test
    (``by_hand(bundle, layer, role)`` -> dense ``[H, T, D]``), differs from the full cache, and
    loads through a real loopback serve-files to the same logits as locally."""
    from httpkit import ThreadServer

    from kdnctl.format.bundle import decode_bundle
    from kdnctl.store.client import RemoteStore
    from kdnctl.engine.hf import LoadedContext, forward_suffix, load_document
    from kdnctl.ingest.prompting import PromptFormat

    suffix = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, "What is the return policy?")
    bundles = [decode_bundle(st.read_object(c.object)) for c in st.get_version(doc, label).chunks]
    layers = range(bundles[0].n_layers)
    keys = [torch.cat([by_hand(b, i, "keys") for b in bundles], 1)[None].to(lm.dtype) for i in layers]
    values = [torch.cat([by_hand(b, i, "values") for b in bundles], 1)[None].to(lm.dtype) for i in layers]
    ids = [int(t) for b in bundles for t in b.token_ids.tolist()]
    # a stored attention bias (steering, or heads masked off evicted rows) is added to the scores
    bias = {i: torch.cat([b.layer_bias(i).float() for b in bundles], 1) for i in layers
            if bundles[0].layer_bias(i) is not None}
    expected = forward_suffix(lm, LoadedContext(keys, values, int(bundles[-1].meta["token_end"]), ids, bias=bias),
                              suffix)[0]
    local = forward_suffix(lm, load_document(lm, st, doc, label), suffix)[0]
    torch.testing.assert_close(local, expected, rtol=1e-4, atol=1e-4)
    full = forward_suffix(lm, load_document(lm, st, doc, "full"), suffix)[0]
    assert (local - full).abs().max() > 1e-3  # the comparison can tell a lossy cache apart
    with ThreadServer(st.root) as srv:
        got = forward_suffix(lm, load_document(lm, RemoteStore(srv.url), doc, label), suffix)[0]
    assert torch.equal(got, local)


def layers_read_nearer(lm, full, a, b) -> int:
    """In how many layers the loaded cache ``a`` gives the document's own queries (placed after
    it, as the value refit places them) an attention output nearer the ``full`` cache's than ``b``
    does (squared error summed over KV heads and their query heads)."""
    queries, scales = document_queries(lm, full.token_ids, len(full.keys), full.next_position + QUESTION_OFFSET)
    nearer = 0
    for i in range(len(full.keys)):
        h = full.keys[i].shape[1]
        group = queries[i].shape[0] // h

        def err(ctx):
            total = 0.0
            for j in range(h):
                q = queries[i][j * group:(j + 1) * group].reshape(-1, full.keys[i].shape[-1])
                target = torch.softmax(q @ full.keys[i][0, j].float().T * scales[i], -1) @ full.values[i][0, j].float()
                got = torch.softmax(q @ ctx.keys[i][0, j].float().T * scales[i], -1) @ ctx.values[i][0, j].float()
                total += float((got - target).pow(2).sum())
            return total
        nearer += err(a) < err(b)
    return nearer
