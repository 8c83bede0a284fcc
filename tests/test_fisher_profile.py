"""The model's Fisher profile: measured once on the store's documents, recorded in the catalog, and
what every later compress of that model scales its layers' steps by, without a probe of its own."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from kdnctl.allocate import fisher_profile as fpro
from kdnctl.allocate import layer_fisher as lf

DOCS = {"faq.md": 200, "lab-protocol.rst": 150, "meeting-notes-2026-03.txt": 170}


@pytest.fixture
def store(tiny_lm, tmp_path_factory):
    from budgetkit import trimmed_store

    return trimmed_store(tmp_path_factory, tiny_lm, DOCS)


def _count_probes(monkeypatch) -> list:
    calls = []
    real = lf.channel_fisher

    def counting(*a, **k):
        calls.append(a[4])  # the probe's start
        return real(*a, **k)

    monkeypatch.setattr(lf, "channel_fisher", counting)
    return calls


def _compress(st, lm, doc, budget=0.25, **kw):
    from kdnctl.compress.document import CompressRecipe, compress_document

    with st.writer():
        return compress_document(st, doc, CompressRecipe(budget=budget, **kw), lm=lm)


def test_profile_is_the_mean_of_each_documents_normalised_estimate(tiny_lm, store):
    from kdnctl.compress.layer_profile import calibration_versions, samples

    versions = calibration_versions(store, tiny_lm.fingerprint)
    assert [v.doc_id for v in versions] == sorted(DOCS)  # by document id
    got, n = fpro.calibrate(tiny_lm, samples(store, versions))
    assert n == len(DOCS)
    want = []
    for ids, header, keys, values, start in samples(store, versions):
        assert start == len(ids) and header > 0 and keys[0].shape[1] == len(ids)
        f = lf.channel_fisher(tiny_lm, keys, values, lf.probe_ids(tiny_lm, ids, header), start, torch.ones(len(ids)))
        x = torch.stack([torch.stack([k, v]) for k, v in f]).double()
        want.append(x / x.sum())
    assert got.dtype == torch.float32 and list(got.shape) == list(want[0].shape)
    torch.testing.assert_close(got, (sum(want) / len(want)).float(), rtol=1e-6, atol=0)
    # a document's share does not depend on its length: each counts the same
    assert not torch.allclose(got, want[0].float(), rtol=1e-3)


def test_samples_stop_at_the_calibration_length(tiny_lm, store):
    from kdnctl.compress.layer_profile import calibration_versions, samples

    versions = calibration_versions(store, tiny_lm.fingerprint)
    (ids, header, keys, values, start), = samples(store, versions[:1], max_tokens=150)
    assert len(ids) == 150 == keys[0].shape[1] == values[-1].shape[1] == start
    full = store.get_version(versions[0].doc_id, "full")
    assert ids == [t for c in full.chunks[:2] for t in _token_ids(store, c)][:150]


def _token_ids(store, c):
    from kdnctl.format.bundle import decode_bundle

    return decode_bundle(store.read_object(c.object)).token_ids.tolist()


def test_first_compress_measures_and_records_it_later_ones_run_no_probe(tiny_lm, store, monkeypatch, capfd):
    from kdnctl.store.profiles import profile_record

    calls = _count_probes(monkeypatch)
    assert profile_record(store, tiny_lm.fingerprint) is None
    _compress(store, tiny_lm, "lab-protocol.rst")
    assert len(calls) == len(DOCS)  # one probe per calibration document, none for the compress itself
    assert "Fisher profile measured on 3 document(s) of this store" in capfd.readouterr().err
    rec = profile_record(store, tiny_lm.fingerprint)
    assert rec is not None and rec.source.startswith("measured on 3 document(s)")
    calls.clear()
    for doc in ("faq.md", "meeting-notes-2026-03.txt"):
        _compress(store, tiny_lm, doc)
    assert calls == []
    assert store.verify() == []


def test_compress_scales_steps_by_the_profile(tiny_lm, store, monkeypatch):
    """The multipliers a compress applies are the profile's: a profile that puts all of layer 0's
    damage on its keys gives those keys the finest multiplier and every other layer and role the
    same one."""
    from kdnctl.compress.layer_profile import calibration_versions, samples
    from kdnctl.compress.stages.quantize import Quantize
    from kdnctl.store.profiles import commit_profile

    (_, _, keys, _, _), = samples(store, calibration_versions(store, tiny_lm.fingerprint)[:1], max_tokens=8)
    profile = torch.full((len(keys), 2, *keys[0].shape[::2]), 1e-3)
    profile[0, 0] = 10.0
    with store.writer():
        commit_profile(store, tiny_lm.fingerprint, fpro.encode(profile), "test")
    seen = []
    real = Quantize.run

    def spy(self, job):
        real(self, job)
        seen.append(job.mult.clone())

    monkeypatch.setattr(Quantize, "run", spy)
    calls = _count_probes(monkeypatch)
    _compress(store, tiny_lm, "faq.md")
    assert calls == [] and len(seen) == 1
    mult = seen[0]
    assert float(mult[0, 0]) == pytest.approx(mult.min()) and float(mult[0, 0]) < float(mult[1:].min())


def test_without_a_profile_each_document_runs_its_own_probe(tiny_lm, store, monkeypatch):
    """A recipe with the even split wants no profile and records none; the document's own estimate
    is what the quantize stage falls back to where no profile is given."""
    from kdnctl.compress.document import CompressRecipe
    from kdnctl.compress.layer_profile import ensure_profile, wants_profile
    from kdnctl.store.profiles import profile_record

    calls = _count_probes(monkeypatch)
    assert not wants_profile(CompressRecipe(budget=0.25, layers="even"))
    assert wants_profile(CompressRecipe(budget=0.25)) and wants_profile(CompressRecipe(budget=0.083))
    assert not wants_profile(CompressRecipe(budget=0.083, quant="ec", keep=0.5, backfill="12-23"))
    _compress(store, tiny_lm, "faq.md", layers="even")
    assert calls == [] and profile_record(store, tiny_lm.fingerprint) is None
    assert ensure_profile(store, tiny_lm, wanted=False) is None


def test_same_documents_same_profile_also_after_rebuild_catalog(tiny_lm, store, tmp_path_factory):
    from budgetkit import trimmed_store

    from kdnctl.ingest.rebuild import rebuild_catalog
    from kdnctl.store import Store
    from kdnctl.store.profiles import profile_record

    _compress(store, tiny_lm, "faq.md")
    first = profile_record(store, tiny_lm.fingerprint).data
    other = trimmed_store(tmp_path_factory, tiny_lm, DOCS)
    _compress(other, tiny_lm, "lab-protocol.rst")
    assert profile_record(other, tiny_lm.fingerprint).data == first
    root = store.root
    store.close()
    rebuild_catalog(root, tiny_lm, force=True)
    st = Store(root)
    assert profile_record(st, tiny_lm.fingerprint) is None  # not an object: the catalog alone held it
    _compress(st, tiny_lm, "lab-protocol.rst")
    assert profile_record(st, tiny_lm.fingerprint).data == first


def _put_meta(st, key: bytes, raw: bytes) -> None:
    with st.writer(), st._env.begin(write=True) as txn:
        txn.put(key, raw, db=st._db["meta"])


def test_damaged_profile_record_is_refused_and_verify_names_it(tiny_lm, store):
    from kdnctl.errors import StoreCorruptError
    from kdnctl.store import catalog as cat
    from kdnctl.store.profiles import _seal, profile_record

    _compress(store, tiny_lm, "faq.md")
    key = cat.key("fisher", tiny_lm.fingerprint)
    with store._env.begin() as txn:
        raw = bytes(txn.get(key, db=store._db["meta"]))
    d = json.loads(raw)
    data = base64.b64decode(d["profile"])
    bad_profile = fpro.encode(-fpro.decode(data, "x"))  # negative Fisher values
    bad_records = [raw.replace(b'"created":', b'"created": ', 1)[:-3] + b"}",  # not JSON / checksum
                   raw.replace(d["profile"][:8].encode(), b"AAAAAAAA", 1),  # the checksum no longer holds
                   _seal({k: v for k, v in d.items() if k != "_sum"} | {"profile": base64.b64encode(bad_profile).decode()})]
    for bad in bad_records:
        _put_meta(store, key, bad)
        with pytest.raises(StoreCorruptError):
            profile_record(store, tiny_lm.fingerprint)
        problems = store.verify()
        assert any("fisher" in p and "unreadable" in p for p in problems), problems
    _put_meta(store, key, raw)
    assert store.verify() == []


def test_profile_file_is_checked():
    from kdnctl.errors import BundleFormatError

    good = torch.rand(3, 2, 2, 4)
    torch.testing.assert_close(fpro.decode(fpro.encode(good), "p"), good)
    for bad in (b"not safetensors", fpro.encode(torch.rand(3, 3, 2, 4)), fpro.encode(torch.rand(3, 2, 4)),
                fpro.encode(torch.full((3, 2, 2, 4), float("nan")))):
        with pytest.raises(BundleFormatError):
            fpro.decode(bad, "p")
    with pytest.raises(BundleFormatError):  # a profile of another model's sizes
        fpro.check(good, 4, 2, 4, "p")
