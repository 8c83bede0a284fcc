"""ec's compiled CPU decoder (``kdnctl.quant.ec_batch``) against the reference decoder
(``EntropyQuantizer.dequantize``, layer by layer): every code width and digit packing, odd
sizes, levels, RoPE by the chunk's or each layer's positions, the key basis; and fuzzed frames
(truncations, flips, wrong sizes) end in BundleFormatError on both, or in the same K/V."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from fuzzkit import mutate

from kdnctl.errors import BundleFormatError
from kdnctl.quant import ec_batch
from kdnctl.quant.entropy import EntropyQuantizer, encode_role

pytestmark = pytest.mark.skipif(not ec_batch.enabled(), reason="numba or ISA-L missing: loads take the reference path")


@dataclass
class Chunk:
    tensors: dict
    meta: dict

    def layer_len(self, i: int) -> int:
        pos = self.tensors.get(f"layers.{i}.positions", self.tensors["positions"])
        return pos.shape[-1]


def _chunk(seed: int, h: int, t: int, d: int, n_layers: int, *, theta=10000.0, basis=None, own_positions=False,
           spread=1.0, start=0, own_widths=True, own_levels=False):
    g = torch.Generator().manual_seed(seed)
    q = EntropyQuantizer(key_rope_theta=theta, key_basis="test" if basis is not None else None)
    meta = {"quant": {**q.meta(h, d), "scheme": "ec"}}
    tensors = {"token_levels": torch.randint(0, 4, (t,), dtype=torch.uint8, generator=g),
               "positions": torch.arange(start, start + t)}
    for i in range(n_layers):
        # channels of very different spreads: every bin, peaks 0 to 7 (digits packed 5, 3, 2 to a
        # byte), one-byte codes, and two-byte codes in layer 1
        scale = torch.logspace(-3, -0.3, d)[torch.randperm(d, generator=g)] * spread
        for role in ("keys", "values"):
            x = torch.randn(h, t, d, generator=g) * scale
            if i == 1 and role == "values" and t:
                x[0, t // 2, 0] = 500.0
            lv = tensors["token_levels"]
            if own_levels:  # each layer's role coded with levels of its own (``layers.i.role.levels``)
                lv = tensors[f"layers.{i}.{role}.levels"] = torch.randint(0, 4, (t,), dtype=torch.uint8, generator=g)
            axes = basis[i] if basis is not None and role == "keys" else None
            tensors[f"layers.{i}.{role}.codes"], tensors[f"layers.{i}.{role}.params"] = encode_role(
                x, torch.full((h, d), 0.3), lv, basis=axes, own_widths=own_widths)
        if own_positions:
            tensors[f"layers.{i}.positions"] = torch.stack(
                [torch.randperm(3 * t + 1, generator=g)[:t].sort().values + start for _ in range(h)])
    return Chunk(tensors, meta)


def _reference(chunks, n_layers, h, d, monkeypatch=None):
    outs = []
    for role in ("keys", "values"):
        parts = [torch.stack([EntropyQuantizer.dequantize(c.tensors, f"layers.{i}.{role}", c.meta["quant"])
                              for i in range(n_layers)]) for c in chunks]
        outs.append(torch.cat(parts, 2))
    return outs


def _fast(chunks, n_layers, h, d, workers=2, room=3):
    total = sum(c.layer_len(0) for c in chunks)
    out = tuple(torch.full((n_layers, h, total + room, d), float("nan")) for _ in range(2))
    starts = [sum(c.layer_len(0) for c in chunks[:i]) for i in range(len(chunks))]
    assert ec_batch.eligible(chunks, n_layers, chunks[0].meta["quant"], out)
    ec_batch.decode_into(out, chunks, starts, chunks[0].meta["quant"], workers=workers)
    assert all(o[:, :, total:].isnan().all() for o in out)  # nothing written past the chunks
    return [o[:, :, :total] for o in out]


@pytest.fixture
def with_basis(monkeypatch):
    """A random orthonormal key basis, registered for these tests only."""
    h, d, n_layers = 3, 24, 3
    g = torch.Generator().manual_seed(9)
    basis = torch.linalg.qr(torch.randn(n_layers, h, d, d, generator=g))[0].contiguous()
    from kdnctl.quant import entropy

    monkeypatch.setattr(entropy, "basis_on", lambda sha, device: basis)
    monkeypatch.setattr(ec_batch, "_basis_t_cached", lambda sha: basis.transpose(-1, -2).contiguous())
    return basis


@pytest.mark.parametrize("h,t,d,theta,own,workers,own_widths", [
    (3, 37, 16, 10000.0, False, 2, True), (1, 1, 8, 10000.0, False, 1, True), (2, 129, 10, None, False, 2, True),
    (3, 64, 16, 500.0, True, 2, True), (2, 0, 8, 10000.0, False, 1, True), (3, 37, 16, 10000.0, False, 2, False),
    (2, 129, 10, None, True, 1, False),
    # chunks of a multiple of 8 tokens (40, 16): one-byte codes go token by token in 8x8 blocks
    (2, 40, 24, 10000.0, False, 2, True), (3, 16, 8, None, False, 1, True)])
def test_batch_decoder_equals_the_reference(h, t, d, theta, own, workers, own_widths):
    """Every code width: one byte, each frame its own (1.11), two bytes for every frame (before 1.11)."""
    n_layers = 3
    chunks = [_chunk(11 + j, h, t + j, d, n_layers, theta=theta, own_positions=own, start=j * 300, own_widths=own_widths)
              for j in range(3)]
    widths = {int(c.tensors[f"layers.{i}.{r}.codes"][0]) for c in chunks for i in range(n_layers) for r in ("keys", "values")}
    if t > 1:
        assert widths == ({1, 3} if own_widths else {1, 2})  # both code widths appear
    ref = _reference(chunks, n_layers, h, d)
    fast = _fast(chunks, n_layers, h, d, workers)
    for a, b in zip(ref, fast):
        assert torch.equal(a, b)  # the same float32 operations in the same order: bit for bit


def every_packing_chunk() -> Chunk:
    """A chunk (3 heads, 61 tokens, head dim 32, 2 layers) whose frames hold every packing of codes:
    none stored, one per byte, 2, 3 and 5 digits to a byte (checked here)."""
    from kdnctl.quant.entropy import codes_per_byte

    c = _chunk(3, 3, 61, 32, 2)
    peaks = set()
    for name, blob in c.tensors.items():
        if name.endswith(".codes"):
            n = int(blob[1])
            peaks |= set(blob[2 + 4 * n:2 + 6 * n].clone().view(torch.int16).tolist())
    assert {codes_per_byte(p) for p in peaks} >= {0, 1, 2, 3, 5}, sorted(peaks)
    return c


def test_every_packing_is_exercised():
    c = every_packing_chunk()
    assert torch.equal(_reference([c], 2, 3, 32)[1], _fast([c], 2, 3, 32)[1])


def test_a_cache_made_under_inference_mode(with_basis):
    """A load under ``torch.inference_mode`` allocates inference tensors; the worker threads
    (which do not inherit the mode) write them all the same."""
    h, d, n_layers = 3, 24, 3
    chunks = [_chunk(41 + j, h, 30, d, n_layers, basis=with_basis, start=30 * j) for j in range(2)]
    ref = _reference(chunks, n_layers, h, d)
    with torch.inference_mode():
        fast = _fast(chunks, n_layers, h, d, workers=2)
    assert torch.equal(ref[1], fast[1]) and torch.allclose(ref[0], fast[0], atol=1e-5 * float(ref[0].abs().max()))


def test_key_basis_within_float_tolerance(with_basis):
    h, d, n_layers = 3, 24, 3
    chunks = [_chunk(21 + j, h, 50 - 7 * j, d, n_layers, basis=with_basis, start=50 * j) for j in range(3)]
    ref = _reference(chunks, n_layers, h, d)
    fast = _fast(chunks, n_layers, h, d)
    assert torch.equal(ref[1], fast[1])
    scale = ref[0].abs().amax()
    assert (ref[0] - fast[0]).abs().max() <= 1e-5 * scale  # a matmul's sums in another order


@pytest.mark.parametrize("coding_bits", range(4))
def test_fuzzed_frames_fail_alike(coding_bits):
    """Flips, overwrites, truncations, insertions and wrong sizes of codes and params blobs:
    the batch decoder raises BundleFormatError exactly where the reference does, and where the
    reference decodes, both give the same K/V."""
    h, t, d, n_layers = 2, 23, 8, 2
    rng = random.Random(20261129 + coding_bits)
    base = _chunk(31 + coding_bits, h, t, d, n_layers)
    counts = fuzz_against_the_reference(base, n_layers, h, d, rng, 150,
                                        lambda chunk: _fast([chunk], n_layers, h, d, workers=1))
    assert counts["error"] > 50, counts


def fuzz_against_the_reference(base, n_layers, h, d, rng, n_cases, decode) -> dict:
    """``n_cases`` mutations (``fuzzkit.mutate``) of one codes or params blob of ``base``, each
    decoded by the reference and by ``decode(chunk)``: both raise BundleFormatError or both give
    the same K/V. Returns how many of each."""
    counts = {"error": 0, "decoded": 0}
    for case in range(n_cases):
        tensors = dict(base.tensors)
        name = rng.choice([f"layers.{rng.randrange(n_layers)}.{r}.{p}" for r in ("keys", "values") for p in ("codes", "params")])
        b = bytearray(tensors[name].numpy().tobytes())
        op = mutate(b, rng)
        tensors[name] = torch.frombuffer(b, dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)
        chunk = Chunk(tensors, base.meta)
        try:
            ref = _reference([chunk], n_layers, h, d)
        except BundleFormatError:
            ref = None
        try:
            got = decode(chunk)
        except BundleFormatError:
            got = None
        assert (ref is None) == (got is None), (case, name, op)
        if ref is None:
            counts["error"] += 1
        else:
            counts["decoded"] += 1
            assert all(torch.equal(a, b) for a, b in zip(ref, got)), (case, name, op)
    return counts


@pytest.mark.model
def test_a_load_decodes_like_the_reference(lm, tmp_path_factory, monkeypatch):
    """``load_document`` of the shipped defaults (0.25: every token, keys in the model's basis;
    0.083: eviction first, per-layer positions) through the batch decoder and through the
    reference give the same cache, and the same next token."""
    from budgetkit import trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.engine.hf import forward_suffix, load_document

    st = trimmed_store(tmp_path_factory, lm, {"faq.md": 300})
    with st.writer():
        for b in (0.25, 0.083):
            compress_document(st, "faq.md", CompressRecipe(budget=b), lm=lm, label=f"b{b}")
    question = lm.tokenizer("How long does charging take?", add_special_tokens=False).input_ids
    calls, real = [], ec_batch.decode_into
    monkeypatch.setattr(ec_batch, "decode_into", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    for label in ("b0.25", "b0.083"):
        n_calls = len(calls)
        fast = load_document(lm, st, "faq.md", label)
        assert len(calls) == n_calls + 1  # the batch decoder ran
        monkeypatch.setenv("KDNCTL_EC_REFERENCE", "1")
        ref = load_document(lm, st, "faq.md", label)
        monkeypatch.delenv("KDNCTL_EC_REFERENCE")
        for a, b in zip(fast.keys + fast.values, ref.keys + ref.values):
            assert a.shape == b.shape
            assert (a - b).abs().max() <= 1e-5 * max(1.0, float(b.abs().max()))
        assert all(torch.equal(a, b) for a, b in zip(fast.values, ref.values))
        lf = forward_suffix(lm, fast, question, last_only=True)[0]
        lr = forward_suffix(lm, ref, question, last_only=True)[0]
        assert int(lf[-1].argmax()) == int(lr[-1].argmax())


@pytest.mark.parametrize("h,t,d", [(3, 37, 16), (1, 1, 8), (2, 256, 64), (3, 0, 8)])
def test_frames_cut_in_numpy_are_the_reference_bytes(h, t, d):
    """The encoder's numpy frame cutting writes exactly the bytes of the plain per-frame loop:
    every packing, every code width (stored bytes of existing versions do not move)."""
    from kdnctl.quant.entropy import encode_codes

    g = torch.Generator().manual_seed(h * 1000 + t)
    for spread in (0.2, 3.0, 400.0):
        scale = torch.logspace(-2, 0, d)[torch.randperm(d, generator=g)] * spread
        codes = torch.round(torch.randn(h, t, d, generator=g) * scale)
        for own_widths in (True, False):
            fast, bins = encode_codes(codes, own_widths=own_widths)
            ref, bins_ref = encode_codes(codes, reference=True, own_widths=own_widths)
            assert torch.equal(bins, bins_ref) and torch.equal(fast, ref), (spread, own_widths)


def test_warm_decodes_like_the_reference_and_a_second_process_compiles_nothing(tmp_path):
    # numba keeps the kernels on disk; a kernel whose cache key differs per process (a closure
    # over a jitted function or an external symbol) is compiled again by every load: seconds
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "NUMBA_DEBUG_CACHE": "1"}
    code = "from kdnctl.quant import ec_batch; assert ec_batch.warm()"
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "data saved" in first.stdout + first.stderr  # the fresh cache directory was filled
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    log = second.stdout + second.stderr
    assert "data loaded" in log and "data saved" not in log, log[-3000:]


def test_the_kernels_see_one_numba_type_whichever_way_the_blobs_lie():
    # a second type is a second compile on a load (seconds), and a miss in numba's disk cache
    # for a process whose heap put the blobs apart
    numba = pytest.importorskip("numba")
    from kdnctl.quant.ec_batch import _level_scales, _span

    big = torch.arange(4 << 20, dtype=torch.int32).view(torch.uint8)
    near, _ = _span([big[:10], big[10:30]])
    apart, offs = _span([big[:10], big[-20:]])
    assert near.base is not None and apart.base is None  # a view in one case, a copy in the other
    assert numba.typeof(near) == numba.typeof(apart)
    assert bytes(apart[offs[1]:offs[1] + 20]) == bytes(big[-20:].numpy())
    levels = torch.tensor([0, 1, 2], dtype=torch.uint8)
    shared = {"token_levels": levels}
    own = {"layers.0.levels": levels, "layers.1.levels": levels.clone()}
    a = _level_scales(shared, ["layers.0.keys", "layers.1.keys"], 3)
    b = _level_scales(own, ["layers.0.keys", "layers.1.keys"], 3)
    assert numba.typeof(a) == numba.typeof(b) and np.array_equal(a, b)


@pytest.mark.parametrize("h,t,d", [(3, 37, 16), (2, 256, 64), (1, 5, 8)])
def test_frames_of_their_own_width_hold_the_same_codes_in_fewer_bytes(h, t, d):
    """A role whose largest code needs two bytes: its frames at their own widths (1.11) decode to
    the codes of the blob whose frames all take two bytes, in fewer bytes where a frame's peak
    fits a byte."""
    from kdnctl.quant.entropy import decode_role_ints, encode_codes, encode_params

    g = torch.Generator().manual_seed(7 * t + d)
    scale = torch.logspace(-1, 1.3, d)[torch.randperm(d, generator=g)]
    codes = torch.round(torch.randn(h, t, d, generator=g) * scale)
    codes[0, t // 2, 0] = 3000.0  # two-byte codes in one frame
    own, bins = encode_codes(codes)
    two, _ = encode_codes(codes, own_widths=False)
    assert int(own[0]) == 3 and int(two[0]) == 2
    assert own.numel() < two.numel()
    params = encode_params(torch.ones(h, d), torch.zeros(h, d), bins)
    ints_own = decode_role_ints(own, params, h, d, t, "x")[0]
    ints_two = decode_role_ints(two, params, h, d, t, "x")[0]
    assert torch.equal(ints_own, ints_two)
    assert torch.equal(ints_own.view(h, d, t).transpose(1, 2).float(), codes)
    one, _ = encode_codes(codes.clamp(-100, 100))
    assert int(one[0]) == 1 and torch.equal(encode_codes(codes.clamp(-100, 100), own_widths=False)[0], one)  # one-byte blobs either way
