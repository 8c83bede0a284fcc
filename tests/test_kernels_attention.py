"""Decode attention: Triton kernel (interpreter on CPU, see conftest) against the torch reference,
and the reference against torch's sdpa on the dequantized cache (the ground truth).

Outputs are pre-filled with NaN before every kernel run so a row or column the kernel forgets to
write fails. Sizes are deliberately odd: Hq=9/Hkv=3 (GQA 3:1), T not a multiple of the token
block (64) nor of the quant group (32), and D=40/17 besides 64/128. bfloat16 is not covered:
the interpreter lacks it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kdnctl.kernels import attention as ka  # noqa: E402  (after the triton check)
from kdnctl.kernels.attention import QuantizedKV  # noqa: E402
from kdnctl.kernels.attention import reference as ref  # noqa: E402
from kdnctl.kernels.attention import triton as tr  # noqa: E402  (TRITON_INTERPRET set in conftest)
from kdnctl.models.cache_args import cache_arg  # noqa: E402

# The one tolerance table. Under the interpreter the dequantized tiles equal the reference's bit
# for bit; what differs is float32 summation order in the dots and exp2-vs-exp softmax (~1e-7).
# The slack covers a real GPU (ex2.approx, FMA contraction) with margin.
TOL = {
    "triton": dict(rtol=2e-5, atol=2e-5),  # kernel vs reference, any cache kind / query dtype
    "sdpa": dict(rtol=1e-5, atol=1e-5),  # reference vs F.scaled_dot_product_attention
    "gpu": dict(rtol=1e-4, atol=1e-4),  # CUDA kernel vs CPU reference (different hardware)
}

HQ, HKV, D = 9, 3, 64
LOG_001 = math.log(0.01)  # PASTA-style down-weighting: attention x0.01
CACHES = ["dense32", "dense16", "int8", "int4", "fp8"]


def _kv(kind: str, hkv: int, t: int, d: int, seed: int, group: int = 32):
    """(k, v) operands of one cache kind, keys per channel and values per token (KIVI)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, t, d, generator=g) * 2
    k[..., :2] += 5.0  # outlier key channels, as real keys have
    v = torch.randn(hkv, t, d, generator=g)
    if kind == "dense32":
        return k, v
    if kind == "dense16":
        return k.half(), v.half()
    return (QuantizedKV.quantize(k, kind, group, "channel"), QuantizedKV.quantize(v, kind, group, "token"))


def _query(hq: int, d: int, dtype, seed: int, nq: int | None = None):
    g = torch.Generator().manual_seed(seed + 100)
    shape = (hq, d) if nq is None else (hq, nq, d)
    return torch.randn(shape, generator=g).to(dtype)


def _bias(kind: str | None, hq: int, t: int, seed: int):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed + 200)
    if kind == "randn":
        return torch.randn(hq, t, generator=g)
    picked = torch.rand(hq, t, generator=g) < 0.5
    if kind == "log":  # down-weight half the tokens by 100x
        return torch.where(picked, LOG_001, 0.0)
    if kind == "mask":  # hard-mask ~half the tokens, and the whole first block of head 0
        b = torch.where(picked, -1e9, 0.0)
        b[0, : min(t - 1, 70)] = -1e9
        return b
    if kind == "-inf":  # true -inf, enough to leave whole chunks of head 1 with no token
        b = torch.where(picked, float("-inf"), 0.0)
        b[1, : t - 3] = float("-inf")
        return b
    raise ValueError(kind)


def _dense(x):
    return x.dense() if isinstance(x, QuantizedKV) else x.float()


def _sdpa(query, k, v, bias=None, scale=None):
    """Ground truth: torch sdpa on the dequantized cache, KV heads repeated for GQA."""
    q3 = query.float()[:, None] if query.dim() == 2 else query.float()
    rep = q3.shape[0] // _dense(k).shape[0]
    kd, vd = (_dense(x).repeat_interleave(rep, dim=0) for x in (k, v))
    mask = None if bias is None else (bias[:, None] if bias.dim() == 2 else bias).float()
    out = F.scaled_dot_product_attention(q3[None], kd[None], vd[None], attn_mask=mask, scale=scale)[0]
    return out[:, 0] if query.dim() == 2 else out


def _assert_close(got, want, tol: str, what: str):
    assert got.dtype == torch.float32 and got.shape == want.shape, (what, got.dtype, got.shape)
    assert not torch.isnan(got).any(), f"{what}: NaN in output (unwritten poisoned element?)"
    torch.testing.assert_close(got, want, **TOL[tol], msg=lambda m: f"{what}: {m}")


def _run_triton(query, k, v, bias=None, scale=None, **kw):
    out_shape = query.shape[:-1] + (ref.kv_shape(k)[-1],)
    out = torch.full(out_shape, float("nan"))
    got = tr.decode_attention(query, k, v, bias, scale, out=out, **kw)
    assert got is out
    return got


# Query dtype and bias kind are paired rather than crossed to keep the interpreter run short;
# every bias kind meets every cache kind and T.
PAIRS = [(torch.float32, None), (torch.float16, "randn"), (torch.float32, "log"), (torch.float16, "mask")]


@pytest.mark.parametrize("t", [37, 100, 257])
@pytest.mark.parametrize("cache", CACHES)
def test_triton_matches_reference(cache, t):
    k, v = _kv(cache, HKV, t, D, seed=t)
    for i, (qdtype, bias_kind) in enumerate(PAIRS):
        query = _query(HQ, D, qdtype, seed=i)
        bias = _bias(bias_kind, HQ, t, seed=i)
        want = ref.decode_attention(query, k, v, bias)
        got = _run_triton(query, k, v, bias)
        _assert_close(got, want, "triton", f"{cache}/T{t}/{qdtype}/bias={bias_kind}")


@pytest.mark.parametrize("cache", ["dense32", "int8", "int4"])
@pytest.mark.parametrize("bias_kind", [None, "randn", "log", "mask", "-inf"])
def test_reference_matches_sdpa(cache, bias_kind):
    """The reference is what sdpa computes on the dequantized cache, for one query or a few."""
    t = 100
    k, v = _kv(cache, HKV, t, D, seed=1)
    bias = _bias(bias_kind, HQ, t, seed=1)
    for nq in (None, 3):
        query = _query(HQ, D, torch.float32, seed=2, nq=nq)
        _assert_close(ref.decode_attention(query, k, v, bias), _sdpa(query, k, v, bias), "sdpa",
                      f"{cache}/bias={bias_kind}/Q={nq}")
    # A non-default scale reaches the scores.
    query = _query(HQ, D, torch.float32, seed=3)
    _assert_close(ref.decode_attention(query, k, v, bias, 0.3), _sdpa(query, k, v, bias, 0.3), "sdpa", "scale")


@pytest.mark.parametrize("num_splits,block_t", [(1, 64), (3, 16), (100, 16), (2, 128)])
def test_splits_and_blocks(num_splits, block_t):
    """Chunking of T (incl. chunks that see only -inf tokens) does not change the result."""
    t = 257
    k, v = _kv("int4", HKV, t, D, seed=5)
    query = _query(HQ, D, torch.float32, seed=5)
    for bias_kind in ("-inf", "mask"):
        bias = _bias(bias_kind, HQ, t, seed=5)
        want = _sdpa(query, k, v, bias)
        got = _run_triton(query, k, v, bias, num_splits=num_splits, block_t=block_t)
        _assert_close(got, want, "triton", f"splits={num_splits}/block={block_t}/{bias_kind}")


@pytest.mark.parametrize("d,group", [(128, 32), (40, 32), (17, 6)])
@pytest.mark.parametrize("cache", ["dense32", "int8", "int4"])
def test_head_dims_and_groups(cache, d, group):
    """D = 128, D = 40 (padded to a 64 tile), odd D = 17 (a half-filled int4 byte per token),
    and a group size (6) that is not a power of two."""
    t = 45
    k, v = _kv(cache, 2, t, d, seed=d, group=group)
    query = _query(8, d, torch.float32, seed=d)  # GQA 4:1, as in 7-8B models
    bias = _bias("randn", 8, t, seed=d)
    _assert_close(_run_triton(query, k, v, bias), ref.decode_attention(query, k, v, bias), "triton", f"{cache}/D{d}/G{group}")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_swapped_layouts(fmt):
    """Keys per token and values per channel also work (the layout is per operand), as does
    a dense K with a quantized V."""
    t = 53
    k, v = _kv("dense32", HKV, t, D, seed=6)
    kq = QuantizedKV.quantize(k, fmt, 16, "token")
    vq = QuantizedKV.quantize(v, fmt, 16, "channel")
    query = _query(HQ, D, torch.float32, seed=6)
    for kk, vv in ((kq, vq), (k, vq)):
        _assert_close(_run_triton(query, kk, vv), _sdpa(query, kk, vv), "triton", f"swapped {fmt}")


@pytest.mark.parametrize("cache", ["dense32", "int4"])
def test_several_queries(cache):
    """``[Hq, Q, D]`` queries with a shared ``[Hq, T]`` bias and a per-query (causal) one."""
    t, nq = 50, 3
    k, v = _kv(cache, HKV, t, D, seed=7)
    query = _query(HQ, D, torch.float16, seed=7, nq=nq)
    causal = torch.zeros(HQ, nq, t)
    for i in range(nq):
        causal[:, i, t - nq + i + 1:] = float("-inf")  # query i sees keys up to its position
    for bias in (None, _bias("randn", HQ, t, seed=7), causal):
        _assert_close(_run_triton(query, k, v, bias), _sdpa(query, k, v, bias), "triton", f"{cache}/Q{nq}")


def test_noncontiguous_operands():
    """Strided views (a transposed cache, a sliced query and bias) are read in place."""
    g = torch.Generator().manual_seed(8)
    k = torch.randn(HKV, D, 70, generator=g).transpose(1, 2)  # [Hkv, T, D] view
    v = torch.randn(70, HKV, D, generator=g).transpose(0, 1)
    query = torch.randn(HQ, 2 * D, generator=g)[:, ::2]
    bias = torch.randn(HQ, 140, generator=g)[:, 1::2]
    vq = QuantizedKV.quantize(v.contiguous(), "int8", 32, "token")
    for vv in (v, vq):
        _assert_close(_run_triton(query, k, vv, bias), _sdpa(query, k, vv, bias), "triton", "strided")


def test_fully_masked_rows_and_empty_cache():
    t = 40
    k, v = _kv("int8", HKV, t, D, seed=9)
    query = _query(HQ, D, torch.float32, seed=9)
    bias = torch.zeros(HQ, t)
    bias[4] = float("-inf")  # head 4 may attend to nothing: 0, as sdpa gives, not NaN
    for got in (ref.decode_attention(query, k, v, bias), _run_triton(query, k, v, bias, block_t=16, num_splits=2)):
        assert torch.equal(got[4], torch.zeros(D))
        _assert_close(got, _sdpa(query, k, v, bias), "triton", "fully masked")
    k0, v0 = torch.zeros(HKV, 0, D), torch.zeros(HKV, 0, D)
    assert torch.equal(_run_triton(query, k0, v0), torch.zeros(HQ, D))
    assert torch.equal(ref.decode_attention(query, k0, v0), torch.zeros(HQ, D))


def test_comparison_is_sensitive():
    """The checks catch a wrong GQA mapping, a dropped bias, and an unwritten output element."""
    t = 37
    k, v = _kv("int8", HKV, t, D, seed=11)
    query = _query(HQ, D, torch.float32, seed=11)
    bias = _bias("log", HQ, t, seed=11)
    got = _run_triton(query, k, v, bias)
    _assert_close(got, _sdpa(query, k, v, bias), "triton", "baseline")
    # Wrong GQA: query head h -> KV head h % Hkv (repeat instead of repeat_interleave).
    kd, vd = _dense(k).repeat(HQ // HKV, 1, 1), _dense(v).repeat(HQ // HKV, 1, 1)
    wrong = F.scaled_dot_product_attention(query[:, None][None], kd[None], vd[None], attn_mask=bias[:, None])[0, :, 0]
    with pytest.raises(AssertionError):
        _assert_close(got, wrong, "triton", "wrong gqa")
    with pytest.raises(AssertionError):
        _assert_close(_run_triton(query, k, v), _sdpa(query, k, v, bias), "triton", "no bias")
    broken = got.clone()
    broken[HQ - 1, D - 1] = float("nan")
    with pytest.raises(AssertionError):
        _assert_close(broken, _sdpa(query, k, v, bias), "triton", "poison")


def test_dispatch_routes_to_triton(monkeypatch):
    k, v = _kv("int4", HKV, 37, D, seed=12)
    query = _query(HQ, D, torch.float32, seed=12)
    calls = []
    real = tr.decode_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tr, "decode_attention", spy)
    monkeypatch.delenv("KDNCTL_FORCE_TRITON", raising=False)
    monkeypatch.delenv("KDNCTL_DISABLE_TRITON", raising=False)
    want = ka.decode_attention(query, k, v)
    assert calls == []  # CPU tensors use the reference by default
    monkeypatch.setenv("KDNCTL_FORCE_TRITON", "1")
    _assert_close(ka.decode_attention(query, k, v), want, "triton", "dispatched")
    assert calls == [1]
    monkeypatch.setenv("KDNCTL_DISABLE_TRITON", "1")
    ka.decode_attention(query, k, v)
    assert calls == [1]


def test_bad_arguments():
    k, v = _kv("dense32", HKV, 10, D, seed=13)
    q = _query(HQ, D, torch.float32, seed=13)
    with pytest.raises(ValueError, match="GQA"):
        tr.decode_attention(q[:8], k, v)  # 8 query heads over 3 KV heads
    with pytest.raises(ValueError, match="head_dim"):
        tr.decode_attention(q[:, :32], k, v)
    with pytest.raises(ValueError, match="bias"):
        tr.decode_attention(q, k, v, torch.zeros(HQ, 11))
    with pytest.raises(ValueError, match="same"):
        tr.decode_attention(q, k, v[:, :9])
    with pytest.raises(ValueError, match="rows"):
        tr.decode_attention(torch.zeros(HQ, 50, D), k, v)  # 3 x 50 rows per KV head > 128
    with pytest.raises(ValueError, match="block_t"):
        tr.decode_attention(q, k, v, block_t=48)
    with pytest.raises(ValueError, match="head_dim"):
        ref.decode_attention(torch.zeros(HQ, 300), torch.zeros(HKV, 4, 300), torch.zeros(HKV, 4, 300))
    qk = QuantizedKV.quantize(k, "int8", 4, "channel")
    with pytest.raises(ValueError, match="do not match"):
        QuantizedKV(qk.q, qk.scale, qk.zero, "int8", 4, "channel", (HKV, 11, D))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", ["dense16", "int8", "int4", "fp8"])
@pytest.mark.parametrize("hq,hkv,t,d", [(9, 3, 257, 64), (32, 8, 4099, 128), (32, 8, 1000, 40)])
def test_gpu_matches_reference(cache, hq, hkv, t, d):
    """On real hardware: the compiled kernel (via dispatch) against the CPU reference."""
    k, v = _kv(cache, hkv, t, d, seed=t)
    query = _query(hq, d, torch.float16, seed=t)
    bias = _bias("mask", hq, t, seed=t)
    want = ref.decode_attention(query, k, v, bias)

    def cuda(x):
        if isinstance(x, QuantizedKV):
            return QuantizedKV(x.q.cuda(), x.scale.cuda(), x.zero.cuda(), x.fmt, x.group_size, x.layout, x.shape)
        return x.cuda()

    out = torch.full((hq, d), float("nan"), device="cuda")
    got = ka.decode_attention(query.cuda(), cuda(k), cuda(v), bias.cuda(), out=out)
    _assert_close(got.cpu(), want, "gpu", f"cuda {cache}/{hq}x{hkv}/T{t}/D{d}")


def test_engine_decode_steps_run_the_kernel_via_dispatch(monkeypatch):
    """kdnctl's attention function sends single-token decode steps to the Triton decode kernel
    when the dispatch says so (CUDA; here the interpreter, forced): greedy tokens and logits
    equal the sdpa path, with a steering bias on one layer."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from kdnctl.engine.attention import AttentionState, kdn_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (1, 11))
    bias = {1: torch.randn(6, 11) * 2}
    calls = []
    import kdnctl.engine.attention as eng

    real = eng.decode_attention
    monkeypatch.setattr(eng, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(force: str):
        monkeypatch.setenv("KDNCTL_FORCE_TRITON", force)
        out, tok = [], None
        with torch.inference_mode(), kdn_attention(model, AttentionState(bias=bias)):
            cache = DynamicCache(config=cfg)
            logits = model(input_ids=ids, **cache_arg(model, cache), use_cache=True).logits[0, -1]
            for step in range(4):
                tok = int(logits.argmax())
                out.append(logits)
                logits = model(input_ids=torch.tensor([[tok]]), **cache_arg(model, cache), use_cache=True,
                               position_ids=torch.tensor([[11 + step]])).logits[0, -1]
        return torch.stack(out + [logits])

    plain = run("0")
    assert not calls
    kernel = run("1")
    assert len(calls) == 4 * cfg.num_hidden_layers  # every decode step, every layer
    assert (kernel - plain).abs().max().item() < 1e-4
