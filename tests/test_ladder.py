"""The ladder quantizer (per-row tiers, one code/param blob per role) and its transforms."""

from __future__ import annotations

import pytest
import torch

from kdnctl.errors import BundleFormatError
from kdnctl.quant import dequantize_tensors, get_quantizer
from kdnctl.quant import transforms as tf
from kdnctl.quant.ladder import TIERS, LadderQuantizer, row_bytes, tier_errors

# relative Frobenius error allowed per tier on Gaussian data (int rows: scale/2 bounds)
MAX_REL = {"fp16": 1e-3, "int8": 0.01, "int4": 0.12, "int3": 0.25, "int2": 0.5}


def _kv(seed=0, h=3, t=45, d=64):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h, t, d, generator=g)
    k[..., :3] = k[..., :3] * 8 + 5  # outlier key channels
    return k, torch.randn(h, t, d, generator=g)


def _roundtrip(q, k, v, kt, vt, pos):
    t = q.encode_layer(k, v, pos, kt, vt)
    full = {f"layers.0.{n}": x for n, x in t.items()}
    full["layers.0.positions"] = pos
    meta = q.meta(k.shape[-1])
    return t, [dequantize_tensors(full, f"layers.0.{r}", meta) for r in ("keys", "values")]


@pytest.mark.parametrize("theta,had", [(None, False), (1e5, True)])
def test_every_tier_round_trips_within_its_bound(theta, had):
    k, v = _kv()
    h, t, _ = k.shape
    pos = torch.arange(7, 7 + 2 * t, 2).expand(h, t)  # a pruned layer's sparse positions
    g = torch.Generator().manual_seed(1)
    kt, vt = torch.randint(0, 5, (h, t), generator=g), torch.randint(0, 5, (h, t), generator=g)
    q = LadderQuantizer(key_rope_theta=theta, value_hadamard=had)
    _, (k2, v2) = _roundtrip(q, k, v, kt, vt, pos)
    for tid, name in enumerate(TIERS):
        for x, y, m in ((k, k2, kt == tid), (v, v2, vt == tid)):
            if m.any():
                rel = float((y[m] - x[m]).norm() / x[m].norm())
                assert rel < MAX_REL[name], (name, rel)


def test_stored_bytes_follow_the_tiers():
    k, v = _kv(t=64)
    pos = torch.arange(64).expand(3, 64)
    q = LadderQuantizer()
    sizes = {}
    for name in TIERS:
        ids = torch.full((3, 64), TIERS.index(name))
        t = q.encode_layer(k, v, pos, ids, ids)
        sizes[name] = sum(x.numel() * x.element_size() for x in t.values())
        rows = 2 * 3 * 64
        assert sizes[name] == pytest.approx(rows * row_bytes(name, 64, 32), rel=0.01), name
    assert sizes["fp16"] > sizes["int8"] > sizes["int4"] > sizes["int3"] > sizes["int2"]


def test_transforms_are_exact_inverses():
    k, _ = _kv()
    pos = torch.arange(45).expand(3, 45) * 3
    torch.testing.assert_close(tf.rope(tf.unrope(k, pos, 1e5), pos, 1e5), k, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(tf.rotate(tf.rotate(k)), k, rtol=1e-5, atol=1e-5)
    h = tf.hadamard(64)
    torch.testing.assert_close(h @ h.T, torch.eye(64), rtol=0, atol=1e-6)


def test_rope_tables_are_built_on_the_keys_device():
    """A GPU load rotates decoded keys on the GPU: the angle tables must be made where the
    positions are (the meta device stands in for CUDA here; a CPU-made table fails there)."""
    k, pos = torch.empty(3, 5, 8, device="meta"), torch.arange(5, device="meta")
    assert tf.rope(k, pos, 1e4).device.type == "meta" and tf.unrope(k, pos, 1e4).device.type == "meta"


def test_pre_rope_keys_and_rotated_values_lower_the_error():
    """Real keys carry RoPE; here: channels with a stable offset, rotated by position."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3, 128, 64, generator=g) * 0.3 + torch.randn(3, 1, 64, generator=g) * 4
    pos = torch.arange(128).expand(3, 128)
    keys = tf.rope(base, pos, 1e4)
    values = torch.randn(3, 128, 64, generator=g)
    values[..., 5] *= 20  # one outlier channel
    ids = torch.full((3, 128), TIERS.index("int2"))
    errs = {}
    for theta, had in ((None, False), (1e4, True)):
        _, (k2, v2) = _roundtrip(LadderQuantizer(key_rope_theta=theta, value_hadamard=had), keys, values, ids, ids, pos)
        errs[theta] = (float((k2 - keys).norm() / keys.norm()), float((v2 - values).norm() / values.norm()))
    assert errs[1e4][0] < errs[None][0] and errs[1e4][1] < errs[None][1]


def test_tier_errors_shrink_with_bits():
    k, v = _kv()
    pos = torch.arange(45).expand(3, 45)
    e = tier_errors(LadderQuantizer(key_rope_theta=1e5), k, v, pos, list(TIERS))
    means = e.mean((2, 3))
    assert e.shape == (2, 5, 3, 45)
    assert bool((means[:, 1:] > means[:, :-1]).all())


def test_corrupt_blobs_are_refused():
    k, v = _kv()
    pos = torch.arange(45).expand(3, 45)
    q = LadderQuantizer()
    ids = torch.full((3, 45), TIERS.index("int3"))
    t = q.encode_layer(k, v, pos, ids, ids)
    meta = q.meta(64)
    for name, bad in (("keys.codes", t["keys.codes"][:-1]), ("keys.params", t["keys.params"][:-2]),
                      ("tiers", torch.full((3, 45), 0x0F, dtype=torch.uint8))):
        full = {f"layers.0.{n}": x for n, x in {**t, name: bad}.items()}
        full["positions"] = torch.arange(45)
        with pytest.raises(BundleFormatError):
            dequantize_tensors(full, "layers.0.keys", meta)


def test_registered_and_uniform_interface():
    q = get_quantizer("ladder", group_size=32)
    k, v = _kv()
    tensors, meta = q.quantize_layer(k, v, tier="int2")
    assert meta["scheme"] == "ladder" and set(tensors) == {"tiers", "keys.codes", "keys.params", "values.codes", "values.params"}


def test_zlib_coding_is_lossless_and_smaller():
    k, v = _kv(t=128)
    pos = torch.arange(128).expand(3, 128)
    ids = torch.full((3, 128), TIERS.index("int2"))
    plain, (k1, v1) = _roundtrip(LadderQuantizer(key_rope_theta=1e5), k, v, ids, ids, pos)
    coded, (k2, v2) = _roundtrip(LadderQuantizer(key_rope_theta=1e5, coding="zlib"), k, v, ids, ids, pos)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert coded["keys.codes"].numel() < plain["keys.codes"].numel()


def test_coding_params_too_is_lossless_and_smaller_on_real_like_scales():
    # K/V whose scales repeat (per-channel key ranges are stable across groups of tokens)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 256, 64, generator=g) * torch.linspace(0.5, 4, 64)
    v = torch.randn(2, 256, 64, generator=g)
    pos = torch.arange(256).expand(2, 256)
    ids = torch.full((2, 256), TIERS.index("int2"))
    ref_t, (k1, v1) = _roundtrip(LadderQuantizer(key_rope_theta=1e5, coding="zlib"), k, v, ids, ids, pos)
    both, (k2, v2) = _roundtrip(LadderQuantizer(key_rope_theta=1e5, coding="zlib+params"), k, v, ids, ids, pos)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert both["keys.params"].dtype == torch.uint8
    assert both["keys.params"].numel() + both["values.params"].numel() < 2 * (
        ref_t["keys.params"].numel() + ref_t["values.params"].numel())  # fp16 -> bytes: 2 per element
    assert row_bytes("int2", 64, 32, coded="zlib+params") < row_bytes("int2", 64, 32, coded="zlib")
    full = {f"layers.0.{n}": x for n, x in {**both, "keys.params": both["keys.params"][:-3]}.items()}
    full["positions"] = torch.arange(256)
    with pytest.raises(BundleFormatError):
        dequantize_tensors(full, "layers.0.keys", LadderQuantizer(coding="zlib+params").meta(64))


@pytest.mark.parametrize("tier", ["fp16", "int4"])
def test_coded_blobs_round_trip_when_empty(tier):
    """fp16-only rows leave the params blob empty (eviction alone at a size budget)."""
    k, v = _kv(t=40)
    pos = torch.arange(40).expand(3, 40)
    ids = torch.full((3, 40), TIERS.index(tier))
    t, (k2, v2) = _roundtrip(LadderQuantizer(coding="zlib+params"), k, v, ids, ids, pos)
    assert t["values.params"].dtype == torch.uint8
    assert float((k2 - k).norm() / k.norm()) < MAX_REL[tier] and float((v2 - v).norm() / v.norm()) < MAX_REL[tier]
    _, (k0, v0) = _roundtrip(LadderQuantizer(coding="zlib+params"), k[:, :0], v[:, :0], ids[:, :0], ids[:, :0],
                             pos[:, :0])  # a layer that keeps no token
    assert k0.shape == v0.shape == (3, 0, 64)


def test_floor_lifts_rows_one_tier_above_the_uniform_one():
    from kdnctl.compress.sizing import floor_tiers, uniform_tier

    rows, fp16_row_pair = 1000, 256
    assert floor_tiers(0.25 * rows * fp16_row_pair, rows, 64, 32) == ("int4", uniform_tier(0.25 * rows * fp16_row_pair, rows, 64, 32)[0])
    assert floor_tiers(1.0 * rows * fp16_row_pair, rows, 64, 32) == ("fp16",)


def test_recipe_labels_and_when_scores_are_needed():
    from kdnctl.compress.document import CompressRecipe

    # the default at 0.25: every token kept, attention-weighted entropy-coded steps (the model weighs the channels)
    d = CompressRecipe()
    assert (d.quant, d.keep, d.protect, d.scorer, d.default_label()) == ("ec", 1.0, 64, "hybrid", "b0.25")
    assert d.needs_model and not d.uses_scorer and d.as_dict()["protect"] == 64 and "coding" not in d.as_dict()
    assert CompressRecipe(budget=0.3).quant == "ec" and CompressRecipe(budget=0.3).keep == 1.0
    # below 0.25: ec with eviction first, half of the tokens at 0.083 (measured), every token at 0.25,
    # the share between them interpolated and below 0.083 proportional to the budget; the kept
    # tokens' values refitted, the lifted ones' held
    below = CompressRecipe(budget=0.2)
    assert (below.quant, below.keep, below.scorer, below.refit, below.refit_hold) == ("ec", 0.85, "sentences-gap", 0.01, True)
    assert [CompressRecipe(budget=b).keep for b in (0.0415, 0.083, 0.1665, 0.249)] == [0.25, 0.5, 0.75, 1.0]
    for b in (0.31, 0.45, 0.5):  # int4 holds every token from ~0.31, int8 from ~0.54: ec fills the bytes between
        mid = CompressRecipe(budget=b)
        assert (mid.quant, mid.keep, mid.protect, mid.default_label()) == ("ec", 1.0, 64, f"b{b:g}")
    full8 = CompressRecipe(budget=0.6)  # int8 holds every token (lossless): one tier, nothing evicted, no scores
    assert (full8.quant, full8.keep, full8.needs_model) == ("uniform", 1.0, False)
    assert CompressRecipe(budget=0.25, quant="floor", keep=0.95, protect=64).default_label() == "floor-b0.25-k0.95-p64"
    g64 = CompressRecipe(budget=0.25, quant="int4", scorer="sentences", protect=64, group_size=64)
    assert g64.default_label() == "int4-b0.25-p64-g64-sentences"  # another group size is another version
    u = CompressRecipe(budget=0.25, quant="uniform")  # one tier that fits every token: no scores needed
    assert u.default_label() == "uniform-b0.25" and not u.needs_model and u.keep == 1.0
    assert CompressRecipe(budget=0.6).quant == "uniform"
    # the same rule at 0.083: half of the tokens, whole sentences, their values refitted
    low = CompressRecipe(budget=0.083)
    assert (low.quant, low.keep, low.protect, low.scorer, low.method_options) == ("ec", 0.5, 32, "sentences-gap", {})
    # the auto recipe lifts the keys of the top 30% of the kept tokens 4x: by literals where every
    # token is kept, below 0.25 by the better rank of literals and the eviction scorer;
    # --lift none turns that off, and the label is the old default's (the same bytes)
    assert (d.lift, d.lift_share, d.lift_level, d.lift_role) == ("literals", 0.3, 2, "keys")
    assert CompressRecipe(lift="none").default_label() == "ec-b0.25-p64" and "lift" not in CompressRecipe(lift="none").as_dict()
    assert CompressRecipe(lift_share=0.1).default_label() == "ec-b0.25-p64-lliterals0.1x2k"  # a user's own share stays
    assert CompressRecipe(lift="sentences").default_label() == "ec-b0.25-p64-lsentences"  # a user's own scorer: no auto role
    assert low.default_label() == "b0.083"
    assert low.recipe_label() == "ec-b0.083-k0.5-p32-lliterals+sentences-gap0.3x2k-rf0.01hdf-sentences-gap"
    assert (low.lift, low.lift_share, low.lift_level, low.lift_role) == \
        ("literals+sentences-gap", d.lift_share, d.lift_level, d.lift_role)
    assert CompressRecipe(budget=0.083, lift="none").default_label() == "ec-b0.083-k0.5-p32-sentences-gap"
    wide = CompressRecipe(budget=0.083, backfill="18.2")  # with --backfill no auto lift (it cost facts there)
    assert wide.lift is None and wide.lift_role is None and "-l" not in wide.default_label().replace("-local", "")
    assert CompressRecipe(budget=0.083, backfill="18.2", lift="literals").lift_steps == (0.25, 1)  # the user's own
    assert low.needs_model and low.uses_scorer  # the tokenizer splits sentences; eviction ranks by them
    old = CompressRecipe(budget=0.083, quant="int4", scorer="sentences", protect=64, method_options={"ratio": 0.0})
    assert old.default_label() == "int4-b0.083-p64-sentences" and old.keep == 1.0  # the cap evicts
    assert CompressRecipe(budget=0.083, method_options={"ratio": 0.5}).method_options == {"ratio": 0.5}
    mine = CompressRecipe(budget=0.083, scorer="hybrid")  # a scorer of one's own keeps KVCrush's representatives
    assert mine.scorer == "hybrid" and mine.method_options == {}
    assert CompressRecipe(budget=0.25, quant="floor").scorer == "hybrid"
    assert CompressRecipe(budget=0.25, quant="ladder").needs_model
    q8 = CompressRecipe(budget=1.0, quant="int8")  # fits everywhere: nothing to rank, no model pass
    assert q8.default_label() == "int8-b1" and not q8.needs_model
    assert CompressRecipe(budget=0.25, quant="fp16", method="snapkv").default_label() == "snapkv-fp16-b0.25"
    evict = CompressRecipe(budget=None, keep=0.25)
    assert evict.default_label() == "kvcrush-k0.25" and evict.quant == "none"


def test_uniform_picks_the_best_tier_that_fits():
    from kdnctl.compress.sizing import uniform_tier

    rows, fp16_row_pair = 1000, 256
    assert uniform_tier(1.0 * rows * fp16_row_pair, rows, 64, 32) == ("fp16",)
    assert uniform_tier(0.25 * rows * fp16_row_pair, rows, 64, 32) == ("int3",)
    assert uniform_tier(0.083 * rows * fp16_row_pair, rows, 64, 32) == ("int2",)  # + forced eviction


def test_shipped_size_recipes_are_the_cli_defaults():
    from pathlib import Path

    from kdnctl.compress.document import CompressRecipe
    from kdnctl.recipes import load_recipe

    root = Path(__file__).resolve().parents[1] / "recipes"
    for name, budget in (("size-0.25.toml", 0.25), ("size-0.083.toml", 0.083)):
        r = load_recipe(root / name)
        assert r.compress_recipe().as_dict() == CompressRecipe(budget=budget).as_dict(), name
        assert r.label == CompressRecipe(budget=budget).default_label()


def test_key_weight_and_lift_are_recipe_options():
    from kdnctl.compress.document import CompressRecipe
    from kdnctl.errors import UsageError

    base = CompressRecipe(budget=0.25, quant="floor")
    assert CompressRecipe(budget=0.25, quant="floor", key_weight=1).as_dict() == base.as_dict()  # old versions still match
    kw = CompressRecipe(budget=0.25, quant="floor", keep=0.95, protect=64, key_weight=4, lift="sentences")
    assert kw.default_label() == "floor-b0.25-k0.95-p64-lsentences-kw4"
    assert kw.as_dict()["key_weight"] == 4.0 and kw.as_dict()["lift"] == "sentences" and kw.needs_model
    for bad in ({"key_weight": 0}, {"key_weight": True}, {"lift": "nope"}, {"protect": -1}):
        with pytest.raises(UsageError):
            CompressRecipe(budget=0.25, **bad)


def test_key_weight_moves_upgrades_to_keys():
    from kdnctl.quant.ladder import TIERS, LadderQuantizer, row_bytes
    from kdnctl.compress.sizing import plan_tiers

    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(2, 64, 64, generator=g) * 2]
    values = [torch.randn(2, 64, 64, generator=g)]
    pos = [torch.arange(64).expand(2, 64)]
    imp = [torch.ones(2, 64)]
    q = LadderQuantizer(group_size=32)
    rows = 2 * 64
    cap = rows * 2 * row_bytes("int3", 64, 32) + rows * 0.5 * (row_bytes("int4", 64, 32) - row_bytes("int3", 64, 32))
    ups = {}
    for kw in (1.0, 20.0):
        maps, _ = plan_tiers(q, keys, values, pos, imp, ("int4", "int3"), cap, key_weight=kw)
        kt, vt = maps[0]
        ups[kw] = int((kt == TIERS.index("int4")).sum()), int((vt == TIERS.index("int4")).sum())
    assert ups[20.0][0] > ups[1.0][0] and ups[20.0][1] < ups[1.0][1]
