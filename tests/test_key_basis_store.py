"""A model with no shipped key basis gets one on its first ``ec`` compress: calibrated on the
store's own documents, stored as an object with a catalog record, reused by later compresses,
found by loads (also in a process that never saw it), kept by gc, checked by verify and
recovered by rebuild-catalog. The shipped basis (SmolLM2) is used as before."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import EXAMPLES, run_cli
from test_models import DOC, SUFFIX, build_model_dir

from kdnctl.format import key_basis as kb


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, lm):
    """A tiny random Qwen2 (no shipped basis), its document ingested and compressed twice."""
    from kdnctl.models.load import load_model, use_loaded_models

    kb.forget_provided()
    root = tmp_path_factory.mktemp("kbs")
    path = build_model_dir("qwen2", root / "model", lm.tokenizer)
    mlm = load_model(path)
    store = root / "s"
    with use_loaded_models(mlm):
        run_cli("ingest", DOC, "--model", path, store=store, check=True)
        first = run_cli("compress", DOC.name, "--budget", "0.25", "--model", path, "--json", store=store, check=True)
        second = run_cli("compress", DOC.name, "--budget", "0.083", "--model", path, "--json", store=store,
                         check=True)
    yield {"path": path, "lm": mlm, "store": store, "first": first, "second": second}
    kb.forget_provided()


def _labels(proc) -> str:
    return json.loads(proc.stdout)["results"][0]["label"]


def _basis_of(store_root, label) -> str:
    from kdnctl.store import Store, read_bundle_meta

    with Store(store_root, create=False) as st:
        v = st.get_version(DOC.name, label)
        shas = {read_bundle_meta(st, c.object)["quant"].get("key_basis") for c in v.chunks}
    assert len(shas) == 1
    return shas.pop()


def _records(store_root):
    from kdnctl.store import Store
    from kdnctl.store.bases import basis_records

    with Store(store_root, create=False) as st:
        return basis_records(st)


def test_first_compress_calibrates_and_stores_a_basis_the_second_reuses(calibrated):
    mlm, store = calibrated["lm"], calibrated["store"]
    assert kb.shipped_basis_for_model(mlm.fingerprint) is None
    said = [line for line in calibrated["first"].stderr.splitlines() if "key basis" in line]
    assert len(said) == 1 and "calibrated" in said[0], calibrated["first"].stderr
    assert "key basis" not in calibrated["second"].stderr  # reused, not calibrated again
    recs = _records(store)
    assert [r.fingerprint for r in recs] == [mlm.fingerprint]
    sha = recs[0].object
    assert (store / "objects" / sha[:2] / sha).is_file()
    # both versions' keys are coded in it
    assert _basis_of(store, _labels(calibrated["first"])) == sha
    assert _basis_of(store, _labels(calibrated["second"])) == sha
    # the file is a basis: orthonormal axes for every layer and KV head, and it names its model
    basis, fp = kb.decode_basis((store / "objects" / sha[:2] / sha).read_bytes(), "stored basis")
    cfg = mlm.model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    assert list(basis.shape) == [cfg.num_hidden_layers, cfg.num_key_value_heads, d, d] and fp == mlm.fingerprint


def _next_logits(mlm, store_root, label):
    from kdnctl.engine.hf import forward_suffix, load_document
    from kdnctl.store import Store

    suffix = mlm.tokenizer(SUFFIX, add_special_tokens=False).input_ids
    with Store(store_root, create=False) as st:
        got, _ = forward_suffix(mlm, load_document(mlm, st, DOC.name, label=label), suffix, last_only=True)
    return got[-1]


def test_a_fresh_process_loads_with_the_store_basis(calibrated):
    """A process that never saw the basis reads it from the store; without the store's object
    no basis directory has it, so the load is refused (not decoded in channels)."""
    mlm, store, label = calibrated["lm"], calibrated["store"], _labels(calibrated["first"])
    before = _next_logits(mlm, store, label)
    kb.forget_provided()
    sha = _records(store)[0].object
    assert not kb.known(sha)
    after = _next_logits(mlm, store, label)
    assert torch.equal(before, after)
    kb.forget_provided()  # exports read the version through the same basis
    from kdnctl.export.base import read_document_kv
    from kdnctl.store import Store

    with Store(store, create=False) as st:
        read_document_kv(st, DOC.name, label)
    # and the loader really took it from the store: with the object gone, the load names the basis
    kb.forget_provided()
    copy = store.parent / "no-basis"
    shutil.copytree(store, copy)
    (copy / "objects" / sha[:2] / sha).unlink()
    from kdnctl.errors import BundleFormatError

    with pytest.raises(BundleFormatError, match="key basis"):
        _next_logits(mlm, copy, label)
    # the CLI in its own process answers from the compressed version
    from kdnctl.models.load import use_loaded_models

    with use_loaded_models(mlm):
        proc = run_cli("ask", DOC.name, "when does the depot open?", "--version", label, "--max-new-tokens", "2",
                       "--model", calibrated["path"], store=store, own_process=True)
    assert proc.returncode == 0, proc.stderr


def test_gc_keeps_the_basis_and_verify_catches_damage(calibrated):
    from kdnctl.store import Store

    store = calibrated["store"]
    sha = _records(store)[0].object
    copy = store.parent / "gc"
    shutil.copytree(store, copy)
    with Store(copy, create=False) as st:
        assert st.verify() == []
        stats = st.gc(grace_s=0, tmp_grace_s=0)
        assert st.has_object(sha), stats
        assert st.verify() == []
    # a flipped byte in the basis object: verify names it as the model's key basis
    p = copy / "objects" / sha[:2] / sha
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.chmod(0o644)
    p.write_bytes(bytes(data))
    with Store(copy, create=False) as st:
        problems = st.verify()
    assert any(sha[:12] in q and "key basis" in q for q in problems), problems
    proc = run_cli("verify", store=copy)
    assert proc.returncode != 0


def test_rebuild_catalog_recovers_the_basis_record(calibrated):
    from kdnctl.ingest.rebuild import rebuild_catalog
    from kdnctl.store import Store

    store, mlm = calibrated["store"], calibrated["lm"]
    sha = _records(store)[0].object
    copy = store.parent / "rebuilt"
    shutil.copytree(store, copy)
    shutil.rmtree(copy / "catalog")
    report = rebuild_catalog(copy, mlm, force=True)
    assert report.bases == 1
    recs = _records(copy)
    assert [(r.fingerprint, r.object) for r in recs] == [(mlm.fingerprint, sha)]
    with Store(copy, create=False) as st:
        assert st.verify() == []


def test_a_model_with_a_shipped_basis_uses_it_and_stores_none(lm, tmp_path):
    from kdnctl.compress.recipe import CompressRecipe
    from kdnctl.compress.key_basis import ensure_key_basis
    from kdnctl.store import Store

    shipped = kb.shipped_basis_for_model(lm.fingerprint)
    assert shipped is not None
    with Store(tmp_path / "s") as st, st.writer():
        assert ensure_key_basis(st, lm, CompressRecipe(budget=0.25, quant="ec").uses_key_basis) == shipped
        from kdnctl.store.bases import basis_records

        assert basis_records(st) == []
    assert not any((tmp_path / "s" / "objects").glob("*/*"))


def test_remote_loads_and_pulls_find_the_store_basis(calibrated, tmp_path):
    """Over HTTP (a token that sees only the document): a load straight from the server fetches
    the basis object; a pull copies it with its record, and the pulled store loads and verifies."""
    from httpkit import ThreadServer

    from kdnctl.store.client import RemoteStore, mirror
    from kdnctl.engine.hf import forward_suffix, load_document
    from kdnctl.store import Store
    from kdnctl.store.bases import basis_records

    mlm, store, label = calibrated["lm"], calibrated["store"], _labels(calibrated["first"])
    want = _next_logits(mlm, store, label)
    sha = _records(store)[0].object
    suffix = mlm.tokenizer(SUFFIX, add_special_tokens=False).input_ids
    with ThreadServer(store, tokens={"t0k": [DOC.name]}) as srv, RemoteStore(srv.url, token="t0k") as remote:
        kb.forget_provided()
        got, _ = forward_suffix(mlm, load_document(mlm, remote, DOC.name, label=label), suffix, last_only=True)
        assert torch.equal(got[-1], want)
        kb.forget_provided()
        with Store(tmp_path / "pulled") as local:
            mirror(remote, local, [DOC.name])
            assert [(r.fingerprint, r.object) for r in basis_records(local)] == [(mlm.fingerprint, sha)]
            assert local.verify() == []
    kb.forget_provided()
    assert torch.equal(_next_logits(mlm, tmp_path / "pulled", label), want)


def test_ray_workers_calibrate_once_and_code_with_the_store_basis(tmp_path, lm):
    """``compress --ray``: workers cannot read the catalog; the driver has a worker calibrate the
    basis and measure the Fisher profile, records them, and hands them to every task; later runs
    reuse them. The bytes equal a single-process compress with the same basis and profile."""
    ray = pytest.importorskip("ray")
    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.distributed.compress import compress_on_ray
    from kdnctl.models.load import load_model, use_loaded_models
    from kdnctl.store import Store
    from kdnctl.store.profiles import profile_record

    kb.forget_provided()
    path = build_model_dir("qwen2", tmp_path / "model", lm.tokenizer)
    mlm = load_model(path)
    store = tmp_path / "s"
    with use_loaded_models(mlm):
        run_cli("ingest", DOC, "--model", path, store=store, check=True)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with Store(store, create=False) as st:
            compress_on_ray(st, [DOC.name], CompressRecipe(budget=0.25), address="local", workers=1, model=str(path))
            recs = _records(store)
            assert [r.fingerprint for r in recs] == [mlm.fingerprint]
            profile = profile_record(st, mlm.fingerprint)  # measured by a worker, recorded by the driver
            assert profile is not None
            compress_on_ray(st, [DOC.name], CompressRecipe(budget=0.083), address="local", workers=1, model=str(path))
            compress_on_ray(st, [DOC.name], CompressRecipe(budget=0.3), address="local", workers=1, model=str(path))
            assert _records(store) == recs  # reused: no second calibration
            assert profile_record(st, mlm.fingerprint) == profile
    finally:
        ray.shutdown()
    sha = recs[0].object
    assert _basis_of(store, "b0.25") == sha and _basis_of(store, "b0.083") == sha
    # the same recipe in this process, with the same basis: the same stored tensors
    from kdnctl.format.bundle import decode_bundle

    with Store(store, create=False) as st, st.writer():
        compress_document(st, DOC.name, CompressRecipe(budget=0.25), lm=mlm, label="here")
        here, there = ([decode_bundle(st.read_object(c.object)) for c in st.get_version(DOC.name, x).chunks]
                       for x in ("here", "b0.25"))
    for a, b in zip(here, there, strict=True):
        assert a.meta["quant"]["key_basis"] == b.meta["quant"]["key_basis"] == sha
        assert sorted(a.tensors) == sorted(b.tensors)
        assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    kb.forget_provided()


def test_another_store_gets_its_own_basis(calibrated, tmp_path):
    """The same model in a second store (in the same process): that store calibrates and holds
    its own basis, and its versions name it, never the first store's."""
    from kdnctl.models.load import use_loaded_models

    mlm, path = calibrated["lm"], calibrated["path"]
    first = _records(calibrated["store"])[0].object
    other = tmp_path / "other"
    with use_loaded_models(mlm):
        run_cli("ingest", EXAMPLES / "faq.md", "--model", path, store=other, check=True)
        proc = run_cli("compress", "faq.md", "--budget", "0.25", "--model", path, "--json", store=other, check=True)
    assert "calibrated" in proc.stderr
    recs = _records(other)
    assert len(recs) == 1 and recs[0].object != first
    from kdnctl.store import Store, read_bundle_meta

    with Store(other, create=False) as st:
        v = st.get_version("faq.md", _labels(proc))
        assert {read_bundle_meta(st, c.object)["quant"]["key_basis"] for c in v.chunks} == {recs[0].object}
