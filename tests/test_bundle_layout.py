"""Cached bundle layouts (kdnctl/format/layout.py): a tensor index seen before skips its
index-only work, and every check still runs on every bundle (meta fields, tensor contents)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save as st_save
from test_bundle import INVALID, L, dense_tensors, meta, pruned_tensors

from kdnctl.format import layout as bundle_layout
from kdnctl.format.bundle import DIGEST_KEY, META_KEY, _canonical_header, decode_bundle, header_digest
from kdnctl.errors import BundleFormatError


def canon(m, t) -> bytes:
    """Canonical bytes (metadata first, index by offset) with a correct header digest, but
    without the writer's validation: what a damaged or hostile writer could store."""
    t = {k: v.contiguous() for k, v in t.items()}
    mj = json.dumps(m, sort_keys=True, separators=(",", ":"))
    return _canonical_header(st_save(t, metadata={META_KEY: mj, DIGEST_KEY: header_digest(mj, t)}))


def test_canonical_bundles_take_the_cache_and_decode_identically():
    bundle_layout.clear()
    data = canon(meta(), dense_tensors())
    assert bundle_layout.parse_head_cached(data, len(data)) is not None
    first, again = decode_bundle(data), decode_bundle(canon(meta(chunk_index=1), dense_tensors(seed=3)))
    assert len(bundle_layout._CACHE) == 1  # one index, two bundles
    assert again.meta["chunk_index"] == 1 and first.meta == meta() | {"created": first.meta["created"]}
    for name, t in dense_tensors(seed=3).items():
        assert torch.equal(again.tensors[name], t), name


@pytest.mark.parametrize("name,mutate,message", INVALID, ids=[c[0] for c in INVALID])
def test_every_check_still_runs_with_the_layout_cached(name, mutate, message):
    bundle_layout.clear()
    decode_bundle(canon(meta(), dense_tensors()))  # caches the index and a passing meta signature
    m, t = meta(), dense_tensors()
    mutate(m, t)
    with pytest.raises(BundleFormatError, match=message):
        decode_bundle(canon(m, t))


def test_contents_are_checked_per_bundle():
    bundle_layout.clear()
    pm = meta(label="kv50", parent="full", mode="prefix")
    decode_bundle(canon(pm, pruned_tensors()))
    t = pruned_tensors()
    t["layers.0.positions"] = torch.tensor([[12, 10, 14], [11, 12, 13], [10, 11, 14]])
    with pytest.raises(BundleFormatError, match=r"layers\.0\.positions are not strictly ascending"):
        decode_bundle(canon(pm, t))
    t["layers.0.positions"] = torch.tensor([[-3, 10, 14], [11, 12, 13], [10, 11, 14]])
    with pytest.raises(BundleFormatError, match="negative positions"):
        decode_bundle(canon(pm, t))
    decode_bundle(canon(pm, pruned_tensors()))  # the cached layout still accepts a good one


def test_stored_quantized_shapes_are_checked_per_bundle():
    bundle_layout.clear()
    quant = pytest.importorskip("kdnctl.quant")
    dense = dense_tensors()
    t = {k: v for k, v in dense.items() if not k.endswith((".keys", ".values"))}
    for i in range(L):
        q, qmeta = quant.get_quantizer("int8").quantize_layer(dense[f"layers.{i}.keys"], dense[f"layers.{i}.values"])
        t.update({f"layers.{i}.{name}": tensor for name, tensor in q.items()})
    assert "layers.1.keys.shape" in t
    qm = meta(quant=qmeta, label="int8")
    decode_bundle(canon(qm, t))
    bad = dict(t)
    bad["layers.1.keys.shape"] = torch.tensor([3, 5, 8])
    with pytest.raises(BundleFormatError, match=r"layers\.1\.keys\.shape is \[3, 5, 8\], expected \[3, 5, 4\]"):
        decode_bundle(canon(qm, bad))


def test_unusual_headers_take_the_general_path():
    data = canon(meta(), dense_tensors())
    n = int.from_bytes(data[:8], "little")
    text, payload = data[8 : 8 + n].decode().rstrip(" "), data[8 + n :]

    def with_header(h: str) -> bytes:
        h += " " * (-len(h) % 8)
        return len(h).to_bytes(8, "little") + h.encode() + payload

    # whitespace after the opening brace (valid JSON, not kdnctl's canonical form)
    other = with_header("{ " + text[1:])
    assert bundle_layout.parse_head_cached(other, len(other)) is None
    assert decode_bundle(other).meta == decode_bundle(data).meta
    # a second "__metadata__" entry (a full JSON parse keeps the last one): never cached
    other = with_header(text[:-1] + ',"__metadata__":{}}')
    assert bundle_layout.parse_head_cached(other, len(other)) is None
    with pytest.raises(BundleFormatError):
        decode_bundle(other)
    # truncated payload: the general path reports it
    with pytest.raises(BundleFormatError, match="truncated"):
        decode_bundle(data[:-8])
