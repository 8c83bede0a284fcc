"""Bundles written by an earlier kdnctl (tests/fixtures/bundles_v1, made by
tests/fixtures/make_bundles_v1.py before the versions.py / allocator refactor) must still decode,
load into the engine with the same logits, and be what today's code writes for the same steps."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kdnctl.format.bundle import QUERY_ENERGY, decode_bundle
from kdnctl.store import ChunkRef, DocumentRecord, Store, VersionRecord
from kdnctl.quant import layer_kv

FIXTURE = Path(__file__).parent / "fixtures" / "bundles_v1"
MANIFEST = json.loads((FIXTURE / "manifest.json").read_text())


def _version(d: dict) -> VersionRecord:
    return VersionRecord(**{**d, "chunks": [ChunkRef(**c) for c in d["chunks"]]})


def _fixture_store(root: Path) -> Store:
    store = Store(root)
    with store.writer():
        for p in FIXTURE.iterdir():
            if p.name != "manifest.json":
                assert store.put_object(p.read_bytes()) == p.name
        versions = [_version(v) for v in MANIFEST["versions"]]
        full = next(v for v in versions if v.label == "full")
        store.commit_document(DocumentRecord(**MANIFEST["document"]), full)
        for v in versions:
            if v.label != "full":
                store.commit_version(v)
    return store


def _same_model(tiny_lm) -> None:
    if tiny_lm.fingerprint != MANIFEST["fingerprint"]:  # torch/transformers init changed the random weights
        pytest.skip("the tiny random model differs from the one the fixture was made with")


def test_v1_bundles_decode():
    labels = set()
    for v in MANIFEST["versions"]:
        labels.add(v["label"])
        for c in v["chunks"]:
            data = (FIXTURE / c["object"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == c["object"]
            b = decode_bundle(data, expect_fingerprint=MANIFEST["fingerprint"])
            assert (b.meta["token_start"], b.meta["token_end"]) == (c["token_start"], c["token_end"])
            for i in range(b.n_layers):
                k, val = layer_kv(b, i)
                assert k.shape == val.shape == (2, b.layer_len(i), 16)
                assert torch.isfinite(k.float()).all()
    assert labels == {"full", "kvcrush-int4", "pyramid", "int8", "mixed", "steer-bias", "steer-reprefill"}


def test_v1_bundles_load_with_same_logits(tiny_lm, tmp_path):
    _same_model(tiny_lm)
    gen = _generator()
    store = _fixture_store(tmp_path / "store")
    for label, want in MANIFEST["suffix_logits"].items():
        got = gen.suffix_logits(tiny_lm, store, label)
        assert got == pytest.approx(want, abs=1e-4), label


def _generator():
    spec = importlib.util.spec_from_file_location("make_bundles_v1", FIXTURE.parent / "make_bundles_v1.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_todays_code_writes_the_same_tensors(tiny_lm, tmp_path, monkeypatch):
    """Re-run the fixture's steps with today's code: every chunk's tensors are bit-identical and
    its metadata equal except the tool version (and the recipe's spelling of an allocator)."""
    _same_model(tiny_lm)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    gen = _generator()
    store = Store(tmp_path / "new")
    gen.write_versions(store, tiny_lm)
    old = {v["label"]: v for v in MANIFEST["versions"]}
    new = {v.label: v for v in store.list_versions(gen.DOC)}
    assert set(new) == set(old)
    for label, v in new.items():
        assert [(c.index, c.token_start, c.token_end, c.chain_hash) for c in v.chunks] == \
            [(c["index"], c["token_start"], c["token_end"], c["chain_hash"]) for c in old[label]["chunks"]], label
        for c, oc in zip(v.chunks, old[label]["chunks"]):
            a = decode_bundle(store.read_object(c.object))
            b = decode_bundle((FIXTURE / oc["object"]).read_bytes())
            # 1.12: an ingest chunk carries its squared queries too (compress's key weights), and a
            # bias edit keeps its source's tensors
            assert (QUERY_ENERGY in a.tensors) == (label in ("full", "steer-bias")), label
            assert sorted(set(a.tensors) - {QUERY_ENERGY}) == sorted(b.tensors), label
            for name in b.tensors:
                x, y = a.tensors[name], b.tensors[name]
                if x.is_floating_point():  # the prefill's attention pass changed its summation order
                    assert torch.allclose(x.float(), y.float(), atol=1e-4, rtol=1e-3), (label, name)
                elif name.endswith(".q"):  # quantized codes of those values: a rare flip at a rounding tie
                    assert x.shape == y.shape and (x != y).sum().item() <= 0.05 * x.numel(), (label, name)
                else:
                    assert torch.equal(x, y), (label, name)
            # 1.1 readers read 1.0 (test above); today's bundles also name their text (rebuild-catalog reads it)
            drop = {"tool_version", "recipe", "format_version", "content_sha256", "text_object"}
            assert a.meta["text_object"] == a.meta["content_sha256"] and len(a.meta["text_object"]) == 64
            assert {k: x for k, x in a.meta.items() if k not in drop} == {k: x for k, x in b.meta.items() if k not in drop}
