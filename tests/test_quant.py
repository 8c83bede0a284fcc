"""Quantizers (kdnctl.quant) and the torch reference numerics: error bounds, packing, format,
registry, and the measurements behind the design choices (per-channel keys, float16 scales,
the mixed policy). Run with ``-s`` to see the size/error table."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kdnctl.errors import BundleFormatError, InputError, UsageError
from kdnctl.kernels.quant import reference as ref
from kdnctl.quant import QUANTIZERS, bytes_per_element, dequantize_tensors, get_quantizer
from kdnctl.quant.mixed import select_important

SCHEMES = ["int8", "int4", "fp8", "mixed"]
ODD_SHAPES = [(3, 37, 64), (3, 1, 64), (2, 37, 40), (1, 5, 3)]  # odd T, T=1, D % G != 0


def kv_with_outliers(h=3, t=256, d=64, seed=0):
    """Real-ish K/V: keys carry a few large, offset channels (as RoPE'd keys of real models do),
    and a few tokens (attention-sink-like) are large in both K and V."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h, t, d, generator=g)
    v = torch.randn(h, t, d, generator=g)
    chans = torch.tensor([3, 17, 40]) % d
    k[:, :, chans] = k[:, :, chans] * 8 + 20
    toks = torch.randperm(t, generator=g)[: max(1, t // 32)]
    k[:, toks] *= 4
    v[:, toks] *= 6
    return k, v


def rel_err(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    """Relative Frobenius error ||x_hat - x|| / ||x||: the 'mean relative error' reported."""
    return float((x_hat - x).norm() / x.norm().clamp_min(1e-12))


def roundtrip(q, keys, values, importance=None, prefix="layers.7"):
    tensors, meta = q.quantize_layer(keys, values, importance=importance)
    full = {f"{prefix}.{n}": t for n, t in tensors.items()}
    k = dequantize_tensors(full, f"{prefix}.keys", meta)
    v = dequantize_tensors(full, f"{prefix}.values", meta)
    return tensors, meta, k, v


def per_element(scale: torch.Tensor, shape, group_size: int, layout: str) -> torch.Tensor:
    """Expand a [H, nG, D] / [H, T, nG] per-group tensor to [H, T, D]."""
    n = shape[1] if layout == "channel" else shape[2]
    idx = torch.arange(n) // group_size
    s = scale.float()
    return s[:, idx, :] if layout == "channel" else s[:, :, idx]


# ---- reference numerics --------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_int4_pack_unpack_lossless(dim, n):
    g = torch.Generator().manual_seed(n)
    shape = [3, 5, 4]
    shape[dim] = n
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    packed = ref.pack_int4(codes, dim=dim)
    assert packed.dtype == torch.uint8 and packed.shape[dim] == (n + 1) // 2
    assert torch.equal(ref.unpack_int4(packed, n, dim=dim), codes)
    # low nibble = even index; the padding nibble of an odd length is 0
    flat = ref.pack_int4(torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert flat.tolist() == [0x21, 0x03]


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["channel", "token"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int_error_at_most_half_scale(fmt, layout, scale_dtype):
    for i, shape in enumerate(ODD_SHAPES):
        for g in (32, 64, 6):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 5 + 3
            q, s, z = ref.quantize(x, fmt, g, layout, scale_dtype)
            x_hat = ref.dequantize(q, s, z, fmt, g, layout, shape)
            bound = per_element(s, shape, g, layout) / 2
            err = (x_hat - x).abs()
            eps = 1e-6 * (x.abs() + 1)
            assert (err <= bound + eps).all(), (fmt, layout, shape, g, float((err - bound).max()))


def test_fp16_scale_keeps_bound_on_narrow_offset_groups():
    """A channel at 100 +- 0.01: float16 spacing near 100 (0.06) dwarfs int8's step, so plain
    rounding of zero would break the bound; the directed rounding keeps it."""
    x = 100 + torch.rand(2, 64, 8, generator=torch.Generator().manual_seed(1)) * 0.02
    q, s, z = ref.quantize(x, "int8", 32, "channel", torch.float16)
    x_hat = ref.dequantize(q, s, z, "int8", 32, "channel", x.shape)
    assert ((x_hat - x).abs() <= per_element(s, x.shape, 32, "channel") / 2 + 1e-5).all()
    assert float((x_hat - x).abs().max()) < 2e-3  # and the error stays small in absolute terms


def test_fp8_error_bound():
    for layout in ("channel", "token"):
        x = torch.randn(3, 37, 64, generator=torch.Generator().manual_seed(2)) * 4
        q, s, z = ref.quantize(x, "fp8", 32, layout)
        x_hat = ref.dequantize(q, s, z, "fp8", 32, layout, x.shape)
        se = per_element(s, x.shape, 32, layout)
        ze = per_element(z, x.shape, 32, layout)
        # e4m3: half an ulp is <= 2**-4 relative for normals, 2**-10 absolute for subnormals.
        bound = torch.maximum((x - ze).abs() / 16, se / 1024) * (1 + 1e-5) + 1e-6
        assert ((x_hat - x).abs() <= bound).all()


def test_constant_and_empty_groups():
    x = torch.full((2, 5, 8), 0.3)
    for fmt in ("int8", "int4", "fp8"):
        for layout in ("channel", "token"):
            q, s, z = ref.quantize(x, fmt, 4, layout)
            x_hat = ref.dequantize(q, s, z, fmt, 4, layout, x.shape)
            assert torch.isfinite(x_hat).all() and float((x_hat - x).abs().max()) < 1e-3
    q, s, z = ref.quantize(torch.zeros(3, 0, 64), "int4", 32, "channel")
    assert ref.dequantize(q, s, z, "int4", 32, "channel", (3, 0, 64)).shape == (3, 0, 64)


def test_wrong_scale_or_zero_is_detected():
    """Tests are sensitive: a perturbed scale or zero gives a clearly larger error."""
    x = torch.randn(3, 37, 64, generator=torch.Generator().manual_seed(3))
    levels = {"int8": 255, "int4": 15, "fp8": 2 * 448}  # group range in units of scale
    for fmt in ("int8", "int4", "fp8"):
        q, s, z = ref.quantize(x, fmt, 32, "token")
        good = rel_err(ref.dequantize(q, s, z, fmt, 32, "token", x.shape), x)
        bad_s = rel_err(ref.dequantize(q, s * 1.05, z, fmt, 32, "token", x.shape), x)
        shifted = z.float() + s.float() * levels[fmt] * 0.05  # zero off by 5% of the range
        bad_z = rel_err(ref.dequantize(q, s, shifted.to(z.dtype), fmt, 32, "token", x.shape), x)
        assert bad_s > 1.5 * good and bad_z > 1.5 * good, (fmt, good, bad_s, bad_z)


def test_per_channel_beats_per_token_for_keys():
    """KIVI's point: keys have outlier channels, so grouping keys along T per channel isolates
    them while per-token groups let them stretch every group's range."""
    keys, values = kv_with_outliers()
    normal = torch.ones(keys.shape[2], dtype=torch.bool)
    normal[[3, 17, 40]] = False  # the outlier channels of kv_with_outliers
    queries = torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(9))
    logits = torch.einsum("hqd,htd->hqt", queries, keys)
    for scheme in ("int4", "int8"):
        errs = {}
        for layout in ("channel", "token"):
            k = roundtrip(get_quantizer(scheme, key_layout=layout), keys, values)[2]
            # The whole-tensor error is dominated by the big channels; what suffers is the
            # normal channels and hence the attention logits q.k.
            errs[layout] = (
                rel_err(torch.einsum("hqd,htd->hqt", queries, k), logits),
                rel_err(k[..., normal], keys[..., normal]),
            )
        print(f"\n{scheme} keys (logit err, normal-channel err): {errs}")
        assert errs["channel"][0] < 0.7 * errs["token"][0]
        assert errs["channel"][1] < 0.25 * errs["token"][1]


def test_fp16_scale_costs_little_accuracy():
    keys, values = kv_with_outliers()
    for scheme in ("int8", "int4", "fp8"):
        e16 = rel_err(roundtrip(get_quantizer(scheme), keys, values)[2], keys)
        q32 = get_quantizer(scheme, scale_dtype="float32")
        e32 = rel_err(roundtrip(q32, keys, values)[2], keys)
        print(f"\n{scheme} keys rel err: float16 scale {e16:.5f} float32 scale {e32:.5f}")
        assert e16 < e32 * 1.05


# ---- quantizers ----------------------------------------------------------------------------


def test_registry():
    assert set(QUANTIZERS) == {"none", "int8", "int4", "int3", "int2", "fp8", "mixed", "ladder", "ec"}
    with pytest.raises(UsageError) as ei:
        get_quantizer("int5")
    assert "int8" in ei.value.hint and "mixed" in ei.value.hint
    with pytest.raises(UsageError):
        get_quantizer("int8", group_size=33)
    with pytest.raises(UsageError):
        get_quantizer("int8", group_size=0)
    with pytest.raises(UsageError):
        get_quantizer("int8", scale_dtype="bfloat16")
    with pytest.raises(UsageError):
        get_quantizer("int8", bogus=1)
    with pytest.raises(UsageError):
        get_quantizer("mixed", important_frac=1.5)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_roundtrip_odd_shapes(scheme, shape):
    g = torch.Generator().manual_seed(sum(shape))
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q = get_quantizer(scheme, group_size=32)
    tensors, meta, k, v = roundtrip(q, keys, values)
    assert k.shape == keys.shape and v.shape == values.shape and k.dtype == torch.float32
    bound = {"int8": 0.02, "int4": 0.2, "fp8": 0.06, "mixed": 0.2}[scheme]
    assert rel_err(k, keys) < bound and rel_err(v, values) < bound
    json.dumps(meta)
    for key in ("scheme", "group_size", "shapes", "bits"):
        assert key in meta
    assert meta["shapes"]["keys"] == list(shape)
    for role in ("keys", "values"):
        for suffix in ("q", "scale", "zero"):
            assert f"{role}.{suffix}" in tensors


def test_float16_input_and_none_scheme():
    keys, values = kv_with_outliers(t=40)
    t, meta, k, v = roundtrip(get_quantizer("int8"), keys.half(), values.half())
    assert k.dtype == torch.float32 and rel_err(k, keys.half().float()) < 0.01
    t, meta, k, v = roundtrip(get_quantizer("none"), keys, values)
    assert set(t) == {"keys", "values"} and torch.equal(k, keys) and torch.equal(v, values)


def test_safetensors_roundtrip_and_pruned_layers():
    """Tensors serialise as-is, and layers with different T decode from one bundle-wide meta."""
    q = get_quantizer("int4", group_size=32)
    all_tensors, metas, dense = {}, [], {}
    for i, t in enumerate((37, 20, 1)):
        keys, values = kv_with_outliers(t=t, seed=i)
        tensors, meta = q.quantize_layer(keys, values)
        all_tensors.update({f"layers.{i}.{n}": x for n, x in tensors.items()})
        metas.append(meta)
        dense[i] = (keys, values)
    loaded = st_load(st_save(all_tensors))
    bundle_meta = json.loads(json.dumps(metas[0]))  # layer 0's meta serves every layer
    for i, (keys, values) in dense.items():
        k = dequantize_tensors(loaded, f"layers.{i}.keys", bundle_meta)
        assert k.shape == keys.shape and rel_err(k, keys) < 0.2


def test_dequantize_errors():
    keys, values = kv_with_outliers(t=37)
    tensors, meta = get_quantizer("int4").quantize_layer(keys, values)
    with pytest.raises(BundleFormatError):
        dequantize_tensors(tensors, "keys", {**meta, "scheme": "int5"})
    missing = {n: t for n, t in tensors.items() if n != "keys.scale"}
    with pytest.raises(BundleFormatError):
        dequantize_tensors(missing, "keys", meta)
    wrong = dict(tensors, **{"keys.shape": torch.tensor([3, 80, 64])})
    with pytest.raises(BundleFormatError):
        dequantize_tensors(wrong, "keys", meta)
    with pytest.raises(BundleFormatError):
        dequantize_tensors(tensors, "keys", {**meta, "group_size": 64})
    no_shape = {n: t for n, t in tensors.items() if n != "keys.shape"}
    with pytest.raises(BundleFormatError):  # int4 cannot tell T=37 from T=38 without it
        dequantize_tensors(no_shape, "keys", meta)
    t8, meta8 = get_quantizer("int8").quantize_layer(keys, values)
    k8 = dequantize_tensors({n: t for n, t in t8.items() if n != "keys.shape"}, "keys", meta8)
    assert torch.equal(k8, dequantize_tensors(t8, "keys", meta8))


def test_bad_inputs():
    q = get_quantizer("int8")
    x = torch.randn(3, 8, 64)
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(InputError):
        q.quantize_layer(bad, x)
    with pytest.raises(InputError):
        q.quantize_layer(x, torch.randn(3, 9, 64))
    with pytest.raises(InputError):
        q.quantize_layer(x[0], x[0])
    with pytest.raises(UsageError):
        q.quantize_layer(x * 1e5, x)  # beyond float16 scale/zero range
    get_quantizer("int8", scale_dtype="float32").quantize_layer(x * 1e5, x)


# ---- mixed ---------------------------------------------------------------------------------


def test_mixed_flagged_tokens_get_int8():
    keys, values = kv_with_outliers(t=64)
    mask = torch.zeros(64, dtype=torch.bool)
    mask[[0, 5, 63]] = True
    q = get_quantizer("mixed")
    tensors, meta, k, v = roundtrip(q, keys, values, importance=mask)
    assert tensors["keys.idx"].tolist() == [[0, 5, 63]] * 3
    assert meta["n_important"] == 3 and meta["policy"] == "importance"
    int8_err = rel_err(k[:, mask], keys[:, mask])
    int4_err = rel_err(k[:, ~mask], keys[:, ~mask])
    assert int8_err < int4_err / 4


def test_mixed_per_head_mask_is_topped_up():
    keys, values = kv_with_outliers(h=3, t=40)
    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[0, [1, 2, 3, 4]] = True
    mask[1, [7]] = True  # head 1 flags 1 token, head 2 none: both topped up to 4
    idx = select_important(mask, keys, values, 0.1)
    assert idx.shape == (3, 4)
    assert idx[0].tolist() == [1, 2, 3, 4] and 7 in idx[1].tolist()
    assert (idx[:, 1:] > idx[:, :-1]).all()
    _, _, k, _ = roundtrip(get_quantizer("mixed"), keys, values, importance=mask)
    assert rel_err(k, keys) < 0.1
    scores = torch.rand(40, generator=torch.Generator().manual_seed(0))
    idx = select_important(scores, keys, values, 0.1)
    assert idx[0].tolist() == sorted(scores.topk(4).indices.tolist())
    with pytest.raises(UsageError):
        select_important(torch.ones(39, dtype=torch.bool), keys, values, 0.1)


def test_mixed_extremes():
    keys, values = kv_with_outliers(t=37)
    for frac in (0.0, 1.0):
        t, meta, k, v = roundtrip(get_quantizer("mixed", important_frac=frac), keys, values)
        assert meta["n_important"] == (0 if frac == 0 else 37)
        assert rel_err(k, keys) < (0.1 if frac == 0 else 0.01)
    t, meta, k, v = roundtrip(get_quantizer("mixed"), keys[:, :1], values[:, :1])  # T = 1
    assert k.shape == (3, 1, 64)


def test_mixed_auto_policy_beats_random_choice():
    keys, values = kv_with_outliers()
    q = get_quantizer("mixed", important_frac=0.1)
    _, _, k, v = roundtrip(q, keys, values)
    auto = (rel_err(k, keys) + rel_err(v, values)) / 2
    rnd = torch.rand(keys.shape[1], generator=torch.Generator().manual_seed(5))
    _, _, k, v = roundtrip(q, keys, values, importance=rnd)
    random_pick = (rel_err(k, keys) + rel_err(v, values)) / 2
    _, _, k, v = roundtrip(get_quantizer("int4"), keys, values)
    int4 = (rel_err(k, keys) + rel_err(v, values)) / 2
    print(f"\nmixed auto {auto:.4f} random-10% {random_pick:.4f} int4 {int4:.4f}")
    assert auto < 0.85 * random_pick and auto < 0.85 * int4


# ---- the size / error table ------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 64])
def test_bytes_per_element_and_error_table(group_size):
    keys, values = kv_with_outliers(h=3, t=256, d=64)
    n = 2 * keys.numel()
    shape_bytes = 2 * 3 * 8 / n  # the two int64 [3] shape tensors
    expected = {  # codes + float16 scale and zero per group of `group_size`
        "int8": 1 + 4 / group_size,
        "int4": 0.5 + 4 / group_size,
        "fp8": 1 + 4 / group_size,
    }
    print(f"\n[3, 256, 64] group {group_size}: scheme  B/elem  rel.err K  V")
    for scheme in ["none"] + SCHEMES:
        opts = {} if scheme == "none" else {"group_size": group_size}
        q = get_quantizer(scheme, **opts)
        tensors, meta, k, v = roundtrip(q, keys, values)
        bpe = bytes_per_element(tensors, n)
        print(f"  {scheme:6s} {bpe:.4f}  {rel_err(k, keys):.5f}  {rel_err(v, values):.5f}")
        if scheme in expected:
            assert math.isclose(bpe, expected[scheme] + shape_bytes, rel_tol=1e-9)
            assert math.isclose(meta["bytes_per_element"], bpe, abs_tol=1e-6)
        if scheme == "mixed":
            k_imp = meta["n_important"]
            assert k_imp == math.ceil(0.1 * 256)
            assert expected["int4"] < bpe < expected["int8"]
