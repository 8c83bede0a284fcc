"""Key bases (``--key-basis model``, kdnctl/quant/basis.py): ec codes a head's step-normalised
keys in a per-model orthonormal basis. Decoding inverts exactly what encoding did, the registry
refuses damaged or foreign files, calibration finds the axes of known data, and on correlated
keys the rotation stores fewer bytes at the same error."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from kdnctl.errors import BundleFormatError, UsageError
from kdnctl.format import key_basis as kb
from kdnctl.quant import basis as kcal
from kdnctl.quant.entropy import EntropyQuantizer, decode_role, encode_role, quantize_codes, roundtrip_role


def _orthonormal(n_layers, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n_layers, h, d, d, generator=g, dtype=torch.float64))[0].float()


def _correlated_keys(h, t, d, seed, rank=4):
    """Keys whose channels share a few directions (as real keys do), plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(h, rank, d, generator=g) * 3
    return torch.randn(h, t, rank, generator=g) @ mix + 0.05 * torch.randn(h, t, d, generator=g)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv(kb.ENV, str(tmp_path))
    kb.clear_caches()
    yield tmp_path
    kb.clear_caches()


@pytest.mark.parametrize("shape", [(3, 37, 64), (2, 5, 16)])
def test_rotated_codes_decode_within_half_a_step_of_each_axis(shape):
    h, t, d = shape
    x = _correlated_keys(h, t, d, seed=t)
    basis = _orthonormal(1, h, d, seed=1)[0]
    step = torch.rand(h, d, generator=torch.Generator().manual_seed(2)) * 0.2 + 0.05
    levels = torch.zeros(t, dtype=torch.uint8)
    levels[-3:] = 2
    codes, params = encode_role(x, step, levels, basis=basis)
    got = decode_role(codes, params, h, d, levels, "layers.0.keys", basis=basis)
    step16 = step.half().float()
    mean = x.mean(1).half().float()
    # the error, measured in the basis and in steps at each token's level, is at most half a step
    z = lambda y: ((y - mean[:, None]) / step16[:, None]) @ basis * 2.0 ** levels.float()[None, :, None]  # noqa: E731
    assert float((z(got) - z(x)).abs().max()) <= 0.5 + 1e-3
    # and decoding is what the docs say: codes / 2**level @ basis^T * step + mean
    ints = quantize_codes(x, step16, mean, levels, basis)
    by_hand = ((ints / 2.0 ** levels.float()[None, :, None]) @ basis.transpose(-1, -2)) * step16[:, None] + mean[:, None]
    torch.testing.assert_close(got, by_hand, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotated", [False, True])
def test_a_roundtrip_without_the_coder_is_what_decoding_the_stored_role_gives(rotated):
    """``roundtrip_role`` (what ``--refit-decoded`` reads the keys as) equals encode then decode."""
    h, t, d = 3, 29, 16
    x = _correlated_keys(h, t, d, seed=9)
    basis = _orthonormal(1, h, d, seed=3)[0] if rotated else None
    step = torch.rand(h, d, generator=torch.Generator().manual_seed(4)) * 0.3 + 0.05
    levels = torch.zeros(t, dtype=torch.uint8)
    levels[::5] = 2
    want = decode_role(*encode_role(x, step, levels, basis=basis), h, d, levels, "layers.0.keys", basis=basis)
    got = roundtrip_role(x, step, levels, basis)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, x, rtol=1e-3, atol=1e-3)  # the steps are coarse enough to move them


def test_correlated_keys_store_fewer_bytes_in_their_axes_at_the_same_error():
    h, t, d = 3, 256, 64
    x = _correlated_keys(h, t, d, seed=5)
    step = (0.3 * x.std(1)).clamp_min(1e-3)
    levels = torch.zeros(t, dtype=torch.uint8)
    u = (x - x.mean(1, keepdim=True)) / step.half().float()[:, None]
    axes = kcal.calibrate([u[None]])[0]
    plain, _ = encode_role(x, step, levels)
    rotated, _ = encode_role(x, step, levels, basis=axes)
    assert rotated.numel() < 0.8 * plain.numel()
    ref = [decode_role(*encode_role(x, step, levels, basis=b), h, d, levels, "k", basis=b) for b in (None, axes)]
    mse = [float(((r - x) / step.half().float()[:, None]).pow(2).mean()) for r in ref]
    assert mse[1] <= 1.05 * mse[0]  # an orthonormal rotation keeps the error in steps (~1/12)


def test_calibrate_finds_known_axes_with_fixed_signs():
    d = 8
    truth = _orthonormal(1, 1, d, seed=3)[0, 0].double()
    scales = torch.tensor([2.0 ** -i for i in range(d)], dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    u = (torch.randn(20000, d, generator=g, dtype=torch.float64) * scales) @ truth.T
    got = kcal.calibrate([u.float().view(1, 1, -1, d)[:, :, :10000], u.float().view(1, 1, -1, d)[:, :, 10000:]])[0, 0]
    cos = (got.double().T @ truth).abs().diagonal()
    assert float(cos.min()) > 0.99  # every axis found, largest variance first
    assert bool((got.gather(0, got.abs().argmax(0, keepdim=True)) > 0).all())  # largest component positive
    assert torch.equal(kcal.calibrate([u.float().view(1, 1, -1, d)])[0, 0], kcal.calibrate([u.float().view(1, 1, -1, d)])[0, 0])
    with pytest.raises(UsageError):
        kcal.calibrate([])


def test_registry_round_trip_and_refusals(registry):
    basis = _orthonormal(2, 3, 16, seed=6)
    sha = kb.register(basis, "fp-a", registry)
    assert kb.basis_for_model("fp-a") == sha and kb.basis_for_model("fp-b") is None
    assert sha == hashlib.sha256((registry / f"{sha}.safetensors").read_bytes()).hexdigest()
    assert torch.equal(kb.load_basis(sha), basis)
    assert json.loads((registry / "index.json").read_text()) == {"fp-a": sha}
    with pytest.raises(BundleFormatError, match="does not have"):
        kb.load_basis("0" * 64)
    with pytest.raises(BundleFormatError, match="not a sha256"):
        kb.load_basis("../etc")
    path = registry / f"{sha}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    kb.clear_caches()
    with pytest.raises(BundleFormatError, match="does not match its sha256"):
        kb.load_basis(sha)
    with pytest.raises(BundleFormatError, match="orthonormal"):
        kb.register(basis * 1.01, "fp-c", registry)
    (registry / "index.json").write_text("[1]")
    with pytest.raises(UsageError):
        kb.basis_for_model("fp-a")


def test_quantizer_decodes_keys_in_the_registered_basis_and_values_in_channels(registry):
    n_layers, h, t, d = 3, 2, 19, 16
    basis = _orthonormal(n_layers, h, d, seed=8)
    sha = kb.register(basis, "fp", registry)
    q = EntropyQuantizer(key_basis=sha)
    meta = q.meta(h, d)
    assert meta["key_basis"] == sha and "key_basis" not in EntropyQuantizer().meta(h, d)
    levels = torch.zeros(t, dtype=torch.uint8)
    tensors, want = {"token_levels": levels}, {}
    for i in range(n_layers):
        k, v = _correlated_keys(h, t, d, seed=10 + i), torch.randn(h, t, d)
        step = torch.full((h, d), 0.1)
        for role, x, b in (("keys", k, basis[i]), ("values", v, None)):
            tensors[f"layers.{i}.{role}.codes"], tensors[f"layers.{i}.{role}.params"] = encode_role(x, step, levels, basis=b)
            want[f"layers.{i}.{role}"] = decode_role(tensors[f"layers.{i}.{role}.codes"], tensors[f"layers.{i}.{role}.params"],
                                                     h, d, levels, role, basis=b)
    for role in ("keys", "values"):
        prefixes = [f"layers.{i}.{role}" for i in range(n_layers)]
        for block in (1, n_layers):
            out = torch.zeros(n_layers, h, t, d)
            q.dequantize_into(out, tensors, prefixes, meta, block=block)
            torch.testing.assert_close(out, torch.stack([want[p] for p in prefixes]), rtol=1e-5, atol=1e-5)
    # without the basis file the bundle is refused, not decoded in the wrong axes
    (registry / f"{sha}.safetensors").unlink()
    kb.clear_caches()
    with pytest.raises(BundleFormatError, match="does not have"):
        q.dequantize_into(torch.zeros(1, h, t, d), tensors, ["layers.0.keys"], meta)
    # a basis of the wrong shape for the bundle is refused too
    sha2 = kb.register(_orthonormal(1, h, d, seed=9), "fp2", registry)
    with pytest.raises(BundleFormatError, match="the bundle needs"):
        q.dequantize_into(torch.zeros(1, h, t, d), tensors, ["layers.2.keys"], {**meta, "key_basis": sha2})


def test_recipe_validation_and_label():
    from kdnctl.compress.document import CompressRecipe

    r = CompressRecipe(budget=0.25, quant="ec", protect=64, key_basis="model")
    assert r.default_label() == "ec-b0.25-p64-kbm" and r.as_dict()["key_basis"] == "model"
    none = CompressRecipe(budget=0.25, quant="ec", protect=64, key_basis="none")
    assert none.default_label() == "ec-b0.25-p64-kb0" and none.as_dict()["key_basis"] == "none"
    # the default ("auto") is not recorded: versions made before keep their recipe and label
    auto = CompressRecipe(budget=0.25)
    assert auto.key_basis == "auto" and "key_basis" not in auto.as_dict() and auto.default_label() == "b0.25"
    assert CompressRecipe(budget=0.083).default_label() == "b0.083"
    with pytest.raises(UsageError, match="key_basis must be"):
        CompressRecipe(budget=0.25, quant="ec", key_basis="pca")
    for explicit in ("model", "none"):
        with pytest.raises(UsageError, match="ec"):
            CompressRecipe(budget=0.25, quant="uniform", key_basis=explicit)
    CompressRecipe(budget=0.25, quant="uniform")  # auto means nothing outside ec, and is no error there


def test_which_basis_a_recipe_gets(registry, tiny_lm):
    from kdnctl.compress.document import CompressRecipe
    from kdnctl.compress.stages.coder import key_basis_for

    def asks(kind):
        return CompressRecipe(budget=0.25, quant="ec", key_basis=kind)

    with pytest.raises(UsageError, match="no key basis is registered"):
        key_basis_for(asks("model"), tiny_lm)
    assert key_basis_for(asks("auto"), tiny_lm) is None and key_basis_for(asks("none"), tiny_lm) is None
    cfg = tiny_lm.model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    sha = kb.register(_orthonormal(cfg.num_hidden_layers, cfg.num_key_value_heads, d, seed=12), tiny_lm.fingerprint, registry)
    assert key_basis_for(asks("auto"), tiny_lm) == sha == key_basis_for(asks("model"), tiny_lm)
    assert key_basis_for(asks("none"), tiny_lm) is None


def test_default_compress_uses_a_registered_basis_end_to_end(registry, tiny_lm, tmp_path_factory):
    """With a basis registered for the model, the default recipe codes keys in it (unrecorded in
    the recipe, named in the bundle); the load equals decoding by hand, keys in channels load
    too, `verify` is clean, and once the basis file is gone `verify` names it and loading refuses."""
    from budgetkit import trimmed_store

    from kdnctl.format.bundle import decode_bundle
    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.engine.hf import load_document
    from kdnctl.quant.entropy import decode_role_ints, dequantize_ints
    from kdnctl.quant.transforms import rope

    cfg = tiny_lm.model.config
    n_layers, h = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    st = trimmed_store(tmp_path_factory, tiny_lm, {"faq.md": 300})
    try:
        st.close()
        from kdnctl.store import Store

        st = Store(st.root)
        u = torch.cat(list(kcal.key_samples(tiny_lm, [[1, 2, 3, 4, 5, 6, 7, 8] * 20])), 0)
        sha = kb.register(kcal.calibrate([u]), tiny_lm.fingerprint, registry)
        with st.writer():
            # --lift none: the keys here decode by token_levels (the auto lift's own row is tested in test_ec_e2e)
            auto = compress_document(st, "faq.md", CompressRecipe(budget=0.5, lift="none"), lm=tiny_lm)
            plain = compress_document(st, "faq.md", CompressRecipe(budget=0.5, key_basis="none", lift="none"), lm=tiny_lm)
        assert (auto.label, plain.label) == ("ec-b0.5-p64", "ec-b0.5-p64-kb0")
        bundles = [decode_bundle(st.read_object(c.object)) for c in st.get_version("faq.md", auto.label).chunks]
        q = bundles[0].meta["quant"]
        assert q["key_basis"] == sha and "key_basis" not in bundles[0].meta["recipe"]["steps"][-1]
        loaded = load_document(tiny_lm, st, "faq.md", auto.label)
        basis = kb.load_basis(sha)
        for i in (0, n_layers - 1):
            parts = []
            for b in bundles:
                ints, step, mean = decode_role_ints(b.tensors[f"layers.{i}.keys.codes"], b.tensors[f"layers.{i}.keys.params"],
                                                    h, d, b.n_tokens, "k")
                lv = b.tensors["token_levels"]
                z = ints.view(h, d, -1).transpose(1, 2).float() / 2.0 ** lv.float()[None, :, None]
                x = (z @ basis[i].transpose(-1, -2)) * step[:, None] + mean[:, None]
                parts.append(rope(x, b.tensors["positions"].expand(h, -1), float(q["key_rope_theta"])))
            torch.testing.assert_close(loaded.keys[i][0].float(), torch.cat(parts, 1), rtol=1e-4, atol=1e-4)
            # values never use the basis
            want_v = torch.cat([dequantize_ints(*[y[None] for y in decode_role_ints(
                b.tensors[f"layers.{i}.values.codes"], b.tensors[f"layers.{i}.values.params"], h, d, b.n_tokens, "v")],
                b.tensors["token_levels"][None], h, d)[0] for b in bundles], 1)
            torch.testing.assert_close(loaded.values[i][0].float(), want_v, rtol=1e-5, atol=1e-5)
        load_document(tiny_lm, st, "faq.md", plain.label)
        assert st.verify() == []
        (registry / f"{sha}.safetensors").unlink()
        kb.clear_caches()
        problems = st.verify()
        assert problems and all(f"needs key basis {sha[:12]}" in p and "ec-b0.5-p64 chunk" in p for p in problems)
        with pytest.raises(BundleFormatError, match="does not have"):
            load_document(tiny_lm, st, "faq.md", auto.label)
        load_document(tiny_lm, st, "faq.md", plain.label)  # keys in channels need no basis
    finally:
        st.close()
