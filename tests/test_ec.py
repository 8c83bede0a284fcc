"""The entropy-coded ``ec`` layout: codes within half a step, both code widths, malformed
frames refused, the channel weights against element-by-element references, the rate fit
against brute force (fast, no model but the tiny one)."""

from __future__ import annotations

import math

import pytest
import torch

from kdnctl.allocate.rate import clamp_steps, fit_scale, relative_steps, step_floor
from kdnctl.errors import BundleFormatError, InputError
from kdnctl.quant import dequantize_tensors, get_quantizer
from kdnctl.quant.entropy import EntropyQuantizer, encode_role
from kdnctl.quant.sensitivity import key_weights, naive_key_weights, pair_mean, value_weights


def _layer(tensors, meta, t):
    full = {f"layers.0.{n}": v for n, v in tensors.items() if n != "levels"}
    full["token_levels"] = tensors["levels"]
    full["positions"] = torch.arange(t)
    return full


@pytest.mark.parametrize("shape", [(3, 37, 64), (2, 5, 16), (1, 1, 8)])
def test_codes_within_half_a_step(shape):
    torch.manual_seed(sum(shape))
    h, t, d = shape
    k, v = torch.randn(h, t, d) * 3 + 1, torch.randn(h, t, d)
    levels = torch.randint(0, 3, (t,), dtype=torch.uint8)
    steps = (torch.rand(h, d) * 0.3 + 0.01, torch.rand(h, d) * 0.3 + 0.01)
    q = get_quantizer("ec")  # no RoPE: keys are stored as they are
    tensors, meta = q.quantize_layer(k, v, steps=steps, levels=levels)
    full = _layer(tensors, meta, t)
    for role, x, s in (("keys", k, steps[0]), ("values", v, steps[1])):
        y = dequantize_tensors(full, f"layers.0.{role}", meta)
        bound = s.half().float()[:, None, :] / 2 ** levels.float()[None, :, None] / 2
        assert y.shape == x.shape
        assert bool(((y - x).abs() <= bound * (1 + 1e-4) + 1e-6).all())


def test_rope_keys_decode_to_their_positions():
    torch.manual_seed(1)
    k, v = torch.randn(3, 20, 64), torch.randn(3, 20, 64)
    q = EntropyQuantizer(key_rope_theta=10000.0)
    steps = (torch.full((3, 64), 0.01), torch.full((3, 64), 0.01))
    pos = torch.arange(100, 120)
    tensors, meta = q.quantize_layer(k, v, positions=pos.expand(3, -1), steps=steps)
    full = _layer(tensors, meta, 20)
    full["positions"] = pos
    y = dequantize_tensors(full, "layers.0.keys", meta)
    assert (y - k).abs().max() < 0.02  # RoPE removed before coding, put back after


@pytest.mark.parametrize("own_widths,width", [(True, 3), (False, 2)])
def test_wide_codes_use_int16_and_stay_exact(own_widths, width):
    """Codes beyond a byte: int16 in the frame that needs it (1.11, width 3), or in every frame
    (before 1.11, width 2, still read)."""
    torch.manual_seed(2)
    x = torch.randn(2, 50, 8)
    x[0, 3, 2] = 900.0  # an outlier far beyond 127 steps
    step = torch.full((2, 8), 0.05)
    codes, params = encode_role(x, step, torch.zeros(50, dtype=torch.uint8), own_widths=own_widths)
    assert int(codes[0]) == width
    tensors = {"layers.0.values.codes": codes, "layers.0.values.params": params,
               "token_levels": torch.zeros(50, dtype=torch.uint8)}
    meta = EntropyQuantizer().meta(2, 8)
    y = dequantize_tensors(tensors, "layers.0.values", meta)
    assert (y - x).abs().max() <= 0.0251


def test_per_role_levels_come_first():
    """A role's own levels (``layers.i.<role>.levels``, 1.5) before the layer's and the chunk's."""
    torch.manual_seed(4)
    h, t, d = 2, 23, 16
    k, v = torch.randn(h, t, d), torch.randn(h, t, d)
    step = torch.full((h, d), 0.2)
    lk, lv = torch.randint(0, 2, (t,), dtype=torch.uint8), torch.randint(2, 5, (t,), dtype=torch.uint8)
    meta = EntropyQuantizer().meta(h, d)
    tensors = {"token_levels": torch.zeros(t, dtype=torch.uint8), "layers.0.levels": torch.zeros(t, dtype=torch.uint8),
               "layers.0.keys.levels": lk, "layers.0.values.levels": lv}
    for role, x, lev in (("keys", k, lk), ("values", v, lv)):
        tensors[f"layers.0.{role}.codes"], tensors[f"layers.0.{role}.params"] = encode_role(x, step, lev)
    for role, x, lev in (("keys", k, lk), ("values", v, lv)):
        y = dequantize_tensors(tensors, f"layers.0.{role}", meta)
        bound = 0.1 / 2 ** lev.float()[None, :, None]
        assert bool(((y - x).abs() <= bound * (1 + 1e-3) + 1e-6).all())
    bad = dict(tensors)
    bad["layers.0.values.levels"] = lv[:-1].clone()  # one token fewer than was coded
    with pytest.raises(BundleFormatError):
        dequantize_tensors(bad, "layers.0.values", meta)


@pytest.mark.parametrize("shape,peak", [((3, 41, 16), 3), ((2, 17, 8), 60), ((3, 9, 5), 300)])
def test_narrow_heads_code_their_kept_rows_only(shape, peak):
    """1.8: heads marked in ``layers.i.narrow`` code the chunk's ``kept`` rows only (small peaks:
    packed digits; larger: bytes; int16 codes); their other rows decode to the mean, every stored
    row within half a step, and dropping the rows costs fewer bytes than coding them."""
    from kdnctl.format.names import stored_rows

    torch.manual_seed(shape[1] + peak)
    h, t, d = shape
    narrow = torch.tensor([1, 0, 1][:h], dtype=torch.uint8)
    kept = (torch.rand(t) < 0.4).to(torch.uint8)
    kept[0] = 1
    tensors = {"kept": kept, "layers.0.narrow": narrow, "token_levels": torch.randint(0, 2, (t,), dtype=torch.uint8)}
    stored = stored_rows(tensors, "layers.0")
    assert torch.equal(stored, torch.stack([kept.bool() if n else torch.ones(t, dtype=torch.bool) for n in narrow]))
    x = torch.randn(h, t, d) * peak / 4
    step = torch.rand(h, d) * 0.5 + 0.5
    meta = EntropyQuantizer().meta(h, d)
    tensors["layers.0.values.codes"], tensors["layers.0.values.params"] = encode_role(x, step, tensors["token_levels"], stored=stored)
    everything, _ = encode_role(x, step, tensors["token_levels"])
    assert tensors["layers.0.values.codes"].numel() < everything.numel()
    y = dequantize_tensors(tensors, "layers.0.values", meta)
    bound = step.half().float()[:, None, :] / 2 ** tensors["token_levels"].float()[None, :, None] / 2
    assert bool(((y - x).abs() <= bound * (1 + 1e-4) + 1e-6)[stored].all())
    mean = x.mean(1, keepdim=True).half().float().expand(h, t, d)
    assert torch.allclose(y[~stored], mean[~stored])
    wrong = dict(tensors, kept=torch.ones_like(kept))  # the frames hold fewer rows than that says
    with pytest.raises(BundleFormatError):
        dequantize_tensors(wrong, "layers.0.values", meta)


@pytest.mark.parametrize("own_positions", [False, True])
def test_stacked_layers_decode_as_each_layer_alone(own_positions):
    """``dequantize_into`` (what a load runs: integers decoded on the host, then one stacked
    dequantize + RoPE per chunk on a GPU, one layer at a time on a CPU) gives every layer
    exactly what decoding that layer alone gives: one-byte and two-byte layers mixed, per-role
    levels, the chunk's positions or each layer's own (``--backfill``), into an fp16 cache."""
    torch.manual_seed(5)
    h, t, d, n_layers = 3, 29, 16, 4
    meta = EntropyQuantizer(key_rope_theta=10000.0).meta(h, d)
    tensors = {"token_levels": torch.randint(0, 3, (t,), dtype=torch.uint8), "positions": torch.arange(7, 7 + t)}
    for i in range(n_layers):
        v = torch.randn(h, t, d)
        if i == 2:
            v[1, 4, 3] = 200.0  # int16 codes in this layer only
        lv = torch.randint(0, 4, (t,), dtype=torch.uint8)
        for role, x, lev in (("keys", torch.randn(h, t, d), tensors["token_levels"]), ("values", v, lv)):
            tensors[f"layers.{i}.{role}.codes"], tensors[f"layers.{i}.{role}.params"] = encode_role(
                x, torch.full((h, d), 0.5), lev)
        tensors[f"layers.{i}.values.levels"] = lv
        if own_positions:
            tensors[f"layers.{i}.positions"] = torch.stack([torch.randperm(60)[:t].sort().values for _ in range(h)])
    assert int(tensors["layers.2.values.codes"][0]) == 3 and int(tensors["layers.1.values.codes"][0]) == 1
    for role in ("keys", "values"):
        names = [f"layers.{i}.{role}" for i in range(n_layers)]
        alone = torch.stack([EntropyQuantizer.dequantize(tensors, n, meta) for n in names])
        for block, dtype in ((n_layers, torch.float32), (1, torch.float32), (3, torch.float16)):
            cache = torch.full((n_layers, h, t + 7, d), float("nan"), dtype=dtype)
            out = cache[:, :, 2:2 + t]  # a slot of a cache with room around it, as a load writes
            EntropyQuantizer.dequantize_into(out, tensors, names, meta, block=block)
            assert torch.equal(out, alone.to(dtype)), (role, block, dtype)
            assert cache[:, :, :2].isnan().all() and cache[:, :, 2 + t:].isnan().all()  # nothing else written
    with pytest.raises(BundleFormatError):  # a slot of the wrong size is refused, not broadcast into
        EntropyQuantizer.dequantize_into(torch.empty(n_layers, h, t + 1, d), tensors, names, meta)


@pytest.mark.parametrize("block", [1, 3])
def test_a_chunk_that_kept_no_tokens_loads_as_empty(block):
    """With eviction first a chunk may keep no token; each layer then has positions ``[H, 0]``
    (the 0.083 default on real text hit this: the load crashed reshaping an empty stack)."""
    h, d, n_layers = 3, 16, 3
    meta = EntropyQuantizer(key_rope_theta=10000.0).meta(h, d)
    tensors = {"token_levels": torch.zeros(0, dtype=torch.uint8), "positions": torch.arange(5, 9)}
    for i in range(n_layers):
        for role in ("keys", "values"):
            tensors[f"layers.{i}.{role}.codes"], tensors[f"layers.{i}.{role}.params"] = encode_role(
                torch.zeros(h, 0, d), torch.full((h, d), 0.5), tensors["token_levels"])
        tensors[f"layers.{i}.positions"] = torch.zeros(h, 0, dtype=torch.int16)
    for role in ("keys", "values"):
        out = torch.empty(n_layers, h, 0, d)
        EntropyQuantizer.dequantize_into(out, tensors, [f"layers.{i}.{role}" for i in range(n_layers)], meta, block=block)


def test_malformed_frames_are_refused():
    torch.manual_seed(3)
    k = v = torch.randn(2, 9, 8)
    tensors, meta = EntropyQuantizer().quantize_layer(k, v)
    full = _layer(tensors, meta, 9)
    bad = dict(full)
    bad["layers.0.keys.codes"] = torch.cat([full["layers.0.keys.codes"][:1], torch.tensor([1, 2, 3], dtype=torch.uint8)])
    with pytest.raises(BundleFormatError, match="frame"):
        dequantize_tensors(bad, "layers.0.keys", meta)
    bad = dict(full)
    codes = full["layers.0.keys.codes"].clone()
    n_frames = int(codes[1])
    sizes = codes[2:2 + 4 * n_frames].clone().view(torch.int32).tolist()
    first = 2 + 6 * n_frames + sum(sizes[:next(j for j, n in enumerate(sizes) if n)])
    codes[first:first + 4] ^= 0xFF  # the block header and Huffman table of the first frame that holds bytes
    bad["layers.0.keys.codes"] = codes
    with pytest.raises(BundleFormatError, match="deflate|decode"):
        dequantize_tensors(bad, "layers.0.keys", meta)
    bad = dict(full)
    bad["layers.0.keys.codes"] = full["layers.0.keys.codes"].clone()
    bad["layers.0.keys.codes"][0] = 7
    with pytest.raises(BundleFormatError, match="width"):
        dequantize_tensors(bad, "layers.0.keys", meta)
    bad = dict(full)
    bad["token_levels"] = torch.zeros(10, dtype=torch.uint8)  # one token more than was coded
    with pytest.raises(BundleFormatError):
        dequantize_tensors(bad, "layers.0.values", meta)
    bad = dict(full)
    del bad["layers.0.values.params"]
    with pytest.raises(BundleFormatError):
        dequantize_tensors(bad, "layers.0.values", meta)


def test_zstd_bundles_before_1_6_still_decode():
    """Bundles written before format 1.6 hold zstd frames (``coding: "zstd"``): they decode to
    the same K/V as deflate frames of the same codes; an unknown coding is refused."""
    torch.manual_seed(5)
    k, v = torch.randn(3, 41, 16), torch.randn(3, 41, 16) * 3
    out = {}
    for coding in ("zstd", "deflate"):
        q = EntropyQuantizer(coding=coding)
        tensors, meta = q.quantize_layer(k, v)
        assert meta["coding"] == coding
        full = _layer(tensors, meta, 41)
        out[coding] = [dequantize_tensors(full, f"layers.0.{r}", meta) for r in ("keys", "values")]
    for a, b in zip(out["zstd"], out["deflate"]):
        assert torch.equal(a, b)
    with pytest.raises(BundleFormatError, match="coding"):
        dequantize_tensors(full, "layers.0.keys", {**meta, "coding": "lz4"})


@pytest.mark.parametrize("coding,inflater", [("deflate", "isal"), ("deflate", "zlib"), ("zstd", "isal")])
def test_mutated_blobs_raise_only_format_errors(coding, inflater, monkeypatch):
    """Codes and params blobs behind a valid digest (a hostile remote store) are decoded, not
    trusted: random flips, overwrites, truncations and insertions give a BundleFormatError or
    K/V of the right shape, never another exception or an unbounded allocation; with either
    inflate (ISA-L's errors are not zlib's)."""
    import random

    from fuzzkit import mutate

    from kdnctl.quant.coders import deflate
    monkeypatch.setattr(deflate, "INFLATER", inflater)
    torch.manual_seed(7)
    k, v = torch.randn(3, 29, 16) * 2, torch.randn(3, 29, 16)
    tensors, meta = EntropyQuantizer(coding=coding).quantize_layer(k, v)
    full = _layer(tensors, meta, 29)
    rng = random.Random(20261126)
    outcomes = {"error": 0, "decoded": 0}
    for case in range(600):
        name = rng.choice(["layers.0.keys.codes", "layers.0.keys.params"])
        b = bytearray(full[name].numpy().tobytes())
        op = mutate(b, rng, n_ops=4)
        bad = dict(full)
        bad[name] = torch.frombuffer(b, dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)
        try:
            y = dequantize_tensors(bad, "layers.0.keys", meta)
            assert y.shape == k.shape
            outcomes["decoded"] += 1
        except BundleFormatError:
            outcomes["error"] += 1
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {case} ({name}, op {op}): {type(exc).__name__}: {str(exc)[:200]}")
    assert outcomes["error"] > 300, outcomes


def test_both_inflaters_decode_the_same_bytes(monkeypatch):
    """ISA-L's inflate (the default where python-isal is installed) and zlib's give the same
    bytes for the same frames, and both refuse a truncated frame with a format error."""
    from kdnctl.quant import entropy
    from kdnctl.quant.coders import deflate
    pytest.importorskip("isal")
    assert deflate.inflate_module("isal") is not deflate.inflate_module("zlib")
    data = bytes(torch.randint(0, 9, (10_000,), generator=torch.Generator().manual_seed(8)).to(torch.uint8).tolist())
    frame = deflate.deflate_compress(data)
    for name in ("isal", "zlib"):
        monkeypatch.setattr(deflate, "INFLATER", name)
        assert entropy.decompress_frame(frame, len(data), "x", "deflate") == data
        with pytest.raises(BundleFormatError):
            entropy.decompress_frame(frame[:-3], len(data), "x", "deflate")
    with pytest.raises(InputError):
        deflate.inflate_module("gzip")


@pytest.mark.parametrize("name", ["deflate", "zstd"])
def test_every_frame_coder_round_trips_and_refuses_a_cut_frame(name):
    """Each registered frame coder gives back exactly the bytes it coded (codes and params), and
    a truncated frame is a BundleFormatError, never another exception; an unknown coder is named."""
    from kdnctl.quant import entropy
    from kdnctl.quant.coders import CODERS

    assert set(CODERS) == set(entropy.CODINGS) and name in CODERS
    data = bytes(torch.randint(0, 13, (7_001,), generator=torch.Generator().manual_seed(11)).to(torch.uint8).tolist())
    for codes in (True, False):
        frame = entropy.compress_frame(data, name, codes=codes)
        assert entropy.decompress_frame(frame, len(data), "x", name) == data
        with pytest.raises(BundleFormatError):
            entropy.decompress_frame(frame[: len(frame) // 2], len(data), "x", name)
    with pytest.raises(BundleFormatError, match="unknown coding 'lz4'"):
        entropy.decompress_frame(frame, len(data), "x", "lz4")
    with pytest.raises(InputError):
        entropy.compress_frame(data, "lz4")


def test_huffman_only_frames_are_smaller_than_zstd_on_noise_like_codes():
    """The reason for the 1.6 coder: Gaussian codes of a few bits (what K/V at ec's steps look
    like) cost fewer bytes as Huffman-only deflate than as zstd frames."""
    torch.manual_seed(6)
    x = torch.randn(3, 256, 64) * torch.rand(1, 1, 64) * 4
    step = torch.full((3, 64), 0.25)
    lv = torch.zeros(256, dtype=torch.uint8)
    sizes = {c: encode_role(x, step, lv, c)[0].numel() for c in ("zstd", "deflate")}
    assert sizes["deflate"] < 0.99 * sizes["zstd"], sizes  # 2% here; 2-8% per role on real K/V (bench/ec_coders.py)


def test_relative_steps_equalise_each_heads_weighted_error():
    """At scale alpha every head's weighted squared error is ~alpha^2/12 of its weighted
    variance, whatever the channel weights (high-rate uniform quantizer)."""
    torch.manual_seed(4)
    x = torch.randn(3, 4000, 16) * torch.rand(3, 1, 16) * 4
    w = torch.rand(3, 16) ** 2 * 10
    base = relative_steps(x, w)
    # element-by-element reference of the formula
    for h in range(3):
        s = math.sqrt(sum(float(w[h, c]) * float(x[h, :, c].var(unbiased=False)) for c in range(16)) / 16)
        for c in range(16):
            assert math.isclose(float(base[h, c]), s / math.sqrt(float(w[h, c])), rel_tol=1e-4)
    alpha = 0.1
    step = alpha * base
    y = torch.round((x - x.mean(1, keepdim=True)) / step[:, None]) * step[:, None] + x.mean(1, keepdim=True)
    err = (w[:, None] * (y - x) ** 2).sum((1, 2)) / (w[:, None] * (x - x.mean(1, keepdim=True)) ** 2).sum((1, 2))
    assert torch.allclose(err, torch.full((3,), alpha ** 2 / 12), rtol=0.1)


def test_clamped_steps_keep_codes_in_int16():
    x = torch.zeros(1, 4, 2)
    x[0, 0, 0] = 1000.0
    s = clamp_steps(torch.full((1, 2), 1e-9), step_floor(x, finest_level=2))
    assert float(s.min()) >= 0.999e-4
    for lo, hi in ((0, 4), (0, 1), (1, 4)):  # any span's mean: the codes a chunk would get
        assert float((x[:, lo:hi] - x[:, lo:hi].mean(1, keepdim=True)).abs().max() * 4 / s[0, 0]) <= 30000 + 1e-3


def test_fit_scale_matches_brute_force():
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        knots = sorted(torch.rand(6, generator=g).tolist())
        def size(a, knots=knots):  # a falling step function of alpha, like encoded bytes
            return 1000 - sum(100 for k in knots if math.log(a) > 8 * k - 4)
        cap = 1000 - 100 * int(torch.randint(1, 6, (1,), generator=g))
        got = fit_scale(size, cap)
        grid = [math.exp(-math.log(64) + i * 2 * math.log(64) / 20000) for i in range(20001)]
        best = min(a for a in grid if size(a) <= cap)
        assert size(got) <= cap and abs(math.log(got) - math.log(best)) < 1e-3
    assert fit_scale(lambda a: 10, 5) is None
    assert fit_scale(lambda a: 1, 5) == 1 / 64


def test_channel_weights_match_naive_references(tiny_lm):
    """key_weights (hooked forward) and value_weights against loops over captured queries and
    the output projection's columns, on the tiny random Llama."""
    model = tiny_lm.model
    cfg = model.config
    n_layers, hq, hkv, d = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ids = list(range(100, 131))  # 31 tokens
    captured = []
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: captured.append(o[0].detach().clone()))
             for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    for hk in hooks:
        hk.remove()
    got = key_weights(tiny_lm, ids, n_layers, hkv, d, rope=True)
    for i, q in enumerate(captured):
        ref = naive_key_weights(q.view(len(ids), hq, d), hkv, rope=True)
        torch.testing.assert_close(got[i], ref, rtol=1e-4, atol=1e-7)
    vw = value_weights(tiny_lm, n_layers, hkv, d)
    for i, layer in enumerate(model.model.layers):
        w = layer.self_attn.o_proj.weight.detach().float()
        for h in range(hkv):
            for c in range(d):
                acc = sum(float(w[:, g * d + c].pow(2).sum()) for g in range(h * hq // hkv, (h + 1) * hq // hkv))
                assert math.isclose(float(vw[i, h, c]), acc, rel_tol=1e-4)
    assert torch.equal(pair_mean(torch.tensor([1.0, 3.0])), torch.tensor([2.0, 2.0]))


def test_key_weights_are_computed_once_per_model_and_document(tiny_lm):
    """A second budget of the same document reuses the key weights (no second forward pass);
    another document, or the weights without RoPE's pairing, are computed afresh; callers get
    their own copy."""
    model = tiny_lm.model
    cfg = model.config
    n_layers, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    calls = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        ids = list(range(200, 223))
        first = key_weights(tiny_lm, ids, n_layers, hkv, d, rope=True)
        n = len(calls)
        assert n == 1
        first.zero_()  # (the caller's copy)
        again = key_weights(tiny_lm, ids, n_layers, hkv, d, rope=True)
        assert len(calls) == n and again.abs().sum() > 0
        key_weights(tiny_lm, ids[:-1], n_layers, hkv, d, rope=True)
        key_weights(tiny_lm, ids, n_layers, hkv, d, rope=False)
        assert len(calls) == n + 2
    finally:
        hook.remove()


def test_token_levels_protect_and_lift():
    from kdnctl.compress.options import LIFT_LEVEL, PROTECT_LEVEL
    from kdnctl.compress.stages.precision import token_levels

    lift = torch.zeros(2, 3, 20)
    lift[:, :, 7:12] = 1.0  # five tokens every layer and head ranks first
    levels = token_levels(20, header=3, protect=4, lift=lift)
    assert levels[:3].tolist() == [PROTECT_LEVEL] * 3 and levels[-4:].tolist() == [PROTECT_LEVEL] * 4
    assert levels[7:12].tolist() == [LIFT_LEVEL] * 5  # the top quarter of 20 tokens
    assert int((levels == 0).sum()) == 20 - 3 - 4 - 5
    assert token_levels(5, header=0, protect=0).tolist() == [0] * 5


@pytest.mark.parametrize("n,keep,header,protect", [(37, 0.4, 3, 5), (50, 0.1, 4, 8), (9, 0.9, 0, 0), (20, 0.05, 6, 6)])
def test_shared_keep_matches_naive(n, keep, header, protect):
    """The kept tokens are the top of the layer/head-averaged importance (ties to the earlier
    token), the header and the last ``protect`` always among them, ascending."""
    from kdnctl.compress.stages.select import shared_keep

    g = torch.Generator().manual_seed(n)
    imp = torch.randint(0, 4, (2, 3, n), generator=g).float()  # many ties, as whole sentences give
    got = shared_keep(imp, keep, header, protect).tolist()
    mean = [sum(float(imp[layer, h, t]) for layer in range(2) for h in range(3)) / 6 for t in range(n)]
    forced = set(range(header)) | set(range(n - protect, n))
    rest = sorted((t for t in range(n) if t not in forced), key=lambda t: (-mean[t], t))
    want = sorted(forced | set(rest[:max(0, max(round(keep * n), len(forced)) - len(forced))]))
    assert got == want


def test_encode_role_of_no_tokens():
    """A chunk whose tokens were all evicted encodes and decodes to an empty layer."""
    from kdnctl.quant.entropy import decode_role

    codes, params = encode_role(torch.randn(3, 0, 64), torch.full((3, 64), 0.1), torch.zeros(0, dtype=torch.uint8))
    assert decode_role(codes, params, 3, 64, torch.zeros(0, dtype=torch.uint8), "x").shape == (3, 0, 64)
