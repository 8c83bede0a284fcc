"""KVCrush kernels: Triton (interpreter on CPU, see conftest) against the torch reference.

Outputs are poisoned (NaN for floats, a sentinel for integers) before every run so a kernel
that skips an element cannot pass by inheriting the right value.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kdnctl.kernels import kvcrush as K  # noqa: E402  (after the triton check)
from kdnctl.kernels.kvcrush import reference as ref  # noqa: E402
from kdnctl.kernels.kvcrush import triton as tri  # noqa: E402

# One table: (atol, rtol) per output. Every output is an integer or a pure copy, so all exact.
TOL = {
    "binarize": (0, 0),
    "hamming": (0, 0),
    "gather.float32": (0, 0),
    "gather.float16": (0, 0),
}
SENTINEL = {torch.uint8: 0xAB, torch.int32: -12345}


def poisoned(shape, dtype):
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.full(shape, SENTINEL[dtype], dtype=dtype)


def assert_close(name, got, want):
    atol, rtol = TOL[name]
    assert got.dtype == want.dtype and got.shape == want.shape
    if atol == 0 and rtol == 0:
        assert torch.equal(got, want), f"{name}: not bit-exact"
    else:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape,seed", [((1, 1, 1), 0), ((3, 5, 131), 1), ((2, 3, 257), 2), ((30, 3, 77), 3)])
def test_binarize_matches_reference(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(shape, generator=gen)
    thr = scores.median(dim=-1).values
    scores.view(-1)[::7] = float("nan")  # NaN is never above a threshold
    scores[..., -1] = thr  # equal to the threshold: strictly greater is 0
    out = poisoned(shape, torch.uint8)
    tri.binarize(scores.contiguous(), thr.contiguous(), out)
    want = ref.binarize(scores, thr)
    assert_close("binarize", out, want)
    assert int(want[..., -1].sum()) == 0


def test_pack_bits_layout():
    assert ref.pack_bits(torch.tensor([1, 0, 1], dtype=torch.uint8)).tolist() == [5]
    assert ref.pack_bits(torch.ones(32, dtype=torch.uint8)).tolist() == [-1]  # bit 31 set
    two = ref.pack_bits(torch.tensor([1] + [0] * 31 + [1, 1], dtype=torch.uint8))
    assert two.tolist() == [1, 3]


@pytest.mark.parametrize(
    "groups,n,n_bits,seed",
    [(1, 1, 1, 0), (30, 129, 3, 1), (1, 257, 90, 2), (2, 300, 64, 3), (3, 5, 33, 4)],
)
def test_hamming_matches_reference(groups, n, n_bits, seed):
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (groups, n, n_bits), generator=gen, dtype=torch.uint8)
    anchor_bits = torch.randint(0, 2, (groups, n_bits), generator=gen, dtype=torch.uint8)
    words, anchor = ref.pack_bits(bits), ref.pack_bits(anchor_bits)
    out = poisoned((groups, n), torch.int32)
    tri.hamming(words, anchor, out)
    want = ref.hamming(words, anchor)
    assert_close("hamming", out, want)
    # and the reference is the plain count of differing bits
    assert torch.equal(want, (bits != anchor_bits.unsqueeze(1)).sum(-1, dtype=torch.int32))


@pytest.mark.parametrize(
    "shape,k,dtype,seed",
    [
        ((1, 1, 1, 1), 1, torch.float32, 0),
        ((3, 2, 50, 37), 19, torch.float32, 1),
        ((30, 3, 77, 64), 33, torch.float32, 2),
        ((2, 3, 41, 64), 41, torch.float16, 3),
    ],
)
def test_gather_matches_reference(shape, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    l, h, t, d = shape
    idx = torch.sort(torch.rand(l, h, t, generator=gen).argsort(-1)[..., :k], dim=-1).values
    out = poisoned((l, h, k, d), dtype)
    tri.gather_kept(x.contiguous(), idx.contiguous(), out)
    name = f"gather.{str(dtype).split('.')[-1]}"
    assert_close(name, out, ref.gather_kept(x, idx))


def test_dispatch_routes_to_triton_when_forced(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    scores = torch.randn(2, 3, 45, generator=gen)
    thr = scores.median(-1).values
    x = torch.randn(2, 3, 45, 16, generator=gen)
    idx = torch.randint(0, 45, (2, 3, 7), generator=gen)
    plain = (K.binarize(scores, thr), K.gather_kept(x, idx))
    called = []
    real = tri.binarize
    monkeypatch.setattr(tri, "binarize", lambda *a: called.append(1) or real(*a))
    monkeypatch.setenv("KDNCTL_FORCE_TRITON", "1")
    forced = (K.binarize(scores, thr, out=poisoned((2, 3, 45), torch.uint8)), K.gather_kept(x, idx))
    assert called, "the Triton path did not run"
    assert_close("binarize", forced[0], plain[0])
    assert_close("gather.float32", forced[1], plain[1])


def test_gather_layers_ragged_and_bounds():
    gen = torch.Generator().manual_seed(4)
    layers = [torch.randn(3, 20, 8, generator=gen) for _ in range(3)]
    kept = [
        torch.tensor([[0, 5, 19]] * 3),
        torch.zeros(3, 0, dtype=torch.long),  # an empty layer still works
        torch.arange(20).expand(3, 20),
    ]
    got = K.gather_layers(layers, kept)
    for x, idx, g in zip(layers, kept, got):
        assert g.shape == (3, idx.shape[1], 8)
        assert torch.equal(g, torch.stack([x[h, idx[h]] for h in range(3)]))
    with pytest.raises(ValueError):
        K.gather_kept(torch.zeros(1, 1, 4, 2), torch.tensor([[[4]]]))
    with pytest.raises(ValueError):
        K.gather_kept(torch.zeros(1, 1, 4, 2), torch.tensor([[[-1]]]))


@pytest.mark.parametrize("bits", ["heads", "layers"])
def test_kvcrush_press_same_selection_on_triton_path(monkeypatch, bits):
    from kdnctl.presses import KVCrushPress, ScoreContext

    gen = torch.Generator().manual_seed(11)
    ctx = ScoreContext(importance=torch.rand(4, 3, 83, generator=gen))
    press = KVCrushPress(bits=bits, page_size=3)
    want = press.select(ctx, [20, 9, 30, 83])
    monkeypatch.setenv("KDNCTL_FORCE_TRITON", "1")
    got = press.select(ctx, [20, 9, 30, 83])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
