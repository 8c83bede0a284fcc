"""KV bundle encoding: round trips and every way a byte string can fail to be a bundle."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save as st_save

from kdnctl import __version__
from kdnctl.format.bundle import (
    DIGEST_KEY,
    FORMAT_VERSION,
    KVBundle,
    decode_bundle,
    encode_bundle,
    make_meta,
)
from kdnctl.errors import BundleFormatError, ModelMismatchError
from kdnctl.quant import layer_kv

FP = "0123456789abcdef" * 4
OTHER_FP = "fedcba9876543210" * 4
L, H_KV, H_Q, D, T = 2, 3, 9, 4, 5


def meta(**over):
    m = make_meta(
        model_fingerprint=FP,
        model={"arch": "llama", "n_layers": L, "n_q_heads": H_Q, "n_kv_heads": H_KV, "head_dim": D, "dtype": "float32"},
        doc_id="doc-a", doc_version="v1", chunk_index=0, n_chunks=1, token_start=10, token_end=10 + T,
        chain_hash="ab" * 32, label="full", parent=None, recipe={"chunk_tokens": 512}, dtype="float32",
    )
    m.update(over)
    return m


def dense_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {"token_ids": torch.tensor([5, 7, 11, 13, 17]), "positions": torch.arange(10, 10 + T)}
    for i in range(L):
        t[f"layers.{i}.keys"] = torch.randn(H_KV, T, D, generator=g)
        t[f"layers.{i}.values"] = torch.randn(H_KV, T, D, generator=g)
    t["stats.window"] = torch.rand(L, H_KV, T, generator=g).half()
    t["stats.accum"] = torch.rand(L, H_KV, T, generator=g).half()
    t["stats.surprisal"] = torch.rand(T, generator=g)
    return t


def pruned_tensors():
    """Layer 0 keeps 3 tokens per head, layer 1 keeps 2: different T_i per layer."""
    g = torch.Generator().manual_seed(1)
    t = {"token_ids": torch.tensor([5, 7, 11, 13, 17])}
    keep = {0: [[10, 12, 14], [11, 12, 13], [10, 11, 14]], 1: [[10, 14], [12, 13], [11, 12]]}
    for i, pos in keep.items():
        t_i = len(pos[0])
        t[f"layers.{i}.positions"] = torch.tensor(pos, dtype=torch.int64)
        t[f"layers.{i}.keys"] = torch.randn(H_KV, t_i, D, generator=g)
        t[f"layers.{i}.values"] = torch.randn(H_KV, t_i, D, generator=g)
        t[f"layers.{i}.bias"] = torch.randn(H_Q, t_i, generator=g).half()
    return t


def raw(meta_dict, tensors, metadata=None):
    """Bytes as a minimal contract writer makes them (no digest), bypassing encode validation."""
    md = metadata if metadata is not None else {"kdnctl": json.dumps(meta_dict)}
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=md)


def header_len(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


# -- round trips ----------------------------------------------------------------------------

def test_dense_round_trip_preserves_everything():
    b = KVBundle(meta(), dense_tensors())
    out = decode_bundle(encode_bundle(b), expect_fingerprint=FP)
    assert out.meta == b.meta
    assert set(out.tensors) == set(b.tensors)
    for name, t in b.tensors.items():
        assert out.tensors[name].dtype == t.dtype, name
        assert torch.equal(out.tensors[name], t), name
    assert out.n_layers == 2 and out.n_tokens == 5 and out.kept_tokens == 5.0
    assert out.token_ids.tolist() == [5, 7, 11, 13, 17]
    k, v = layer_kv(out, 1)
    assert torch.equal(k, b.tensors["layers.1.keys"]) and torch.equal(v, b.tensors["layers.1.values"])
    pos = out.layer_positions(0)
    assert pos.shape == (H_KV, T) and pos[2].tolist() == [10, 11, 12, 13, 14]
    assert out.nbytes == sum(t.numel() * t.element_size() for t in b.tensors.values())
    assert out.tensors["stats.window"].dtype == torch.float16  # stats stored as given


def test_pruned_round_trip_with_per_layer_positions_and_bias():
    b = KVBundle(meta(label="kv50", parent="full", mode="prefix"), pruned_tensors())
    out = decode_bundle(encode_bundle(b))
    assert "positions" not in out.tensors
    assert out.layer_positions(0).shape == (3, 3) and out.layer_positions(1).shape == (3, 2)
    assert out.layer_positions(1).tolist() == [[10, 14], [12, 13], [11, 12]]
    assert layer_kv(out, 0)[0].shape == (3, 3, 4) and layer_kv(out, 1)[1].shape == (3, 2, 4)
    assert torch.equal(layer_kv(out, 1)[1], b.tensors["layers.1.values"])
    assert out.tensors["layers.0.bias"].dtype == torch.float16
    assert out.n_tokens == 5 and out.kept_tokens == 2.5
    assert out.meta["parent"] == "full"


def test_views_of_one_tensor_can_be_encoded():
    # kv[0] / kv[1] share storage; safetensors alone would refuse them.
    t = dense_tensors()
    kv = torch.randn(2, H_KV, T, D)
    t["layers.0.keys"], t["layers.0.values"] = kv[0], kv[1]
    out = decode_bundle(encode_bundle(KVBundle(meta(), t)))
    assert torch.equal(out.tensors["layers.0.values"], kv[1])


def test_quantized_layers_validate_presence_only():
    t = dense_tensors()
    for kind in ("keys", "values"):
        del t[f"layers.1.{kind}"]
        t[f"layers.1.{kind}.q"] = torch.randint(0, 15, (H_KV, T, D // 2), dtype=torch.uint8)
        t[f"layers.1.{kind}.scale"] = torch.ones(H_KV, T, 1, dtype=torch.float16)
        t[f"layers.1.{kind}.zero"] = torch.zeros(H_KV, T, 1, dtype=torch.float16)
    q = {"scheme": "int4", "group": 4}
    out = decode_bundle(encode_bundle(KVBundle(meta(quant=q), t)))
    assert out.meta["quant"] == q and out.is_quantized(1) and not out.is_quantized(0)
    t["layers.1.keys.shape"] = torch.tensor([H_KV, T, D])  # quantizers store the original shape
    assert decode_bundle(encode_bundle(KVBundle(meta(quant=q), t))).tensors["layers.1.keys.shape"].tolist() == [3, 5, 4]
    t["layers.1.keys.shape"] = torch.tensor([H_KV, T, 2 * D])
    with pytest.raises(BundleFormatError, match=r"layers\.1\.keys\.shape is \[3, 5, 8\], expected \[3, 5, 4\]"):
        decode_bundle(raw(meta(quant=q), t))
    del t["layers.1.keys.shape"]
    del t["layers.1.values.zero"]
    with pytest.raises(BundleFormatError, match=r"layers\.1\.values\.zero"):
        decode_bundle(raw(meta(quant=q), t))
    with pytest.raises(BundleFormatError, match="no 'quant'"):
        encode_bundle(KVBundle(meta(), t))


@pytest.mark.parametrize("scheme", ["int8", "int4", "mixed"])
def test_quantized_pruned_bundle_dequantizes_through_kdnctl_quant(scheme):
    quant = pytest.importorskip("kdnctl.quant")
    dense = pruned_tensors()
    t = {k: v for k, v in dense.items() if not k.endswith((".keys", ".values"))}
    for i in range(L):
        q, qmeta = quant.get_quantizer(scheme).quantize_layer(dense[f"layers.{i}.keys"], dense[f"layers.{i}.values"])
        t.update({f"layers.{i}.{name}": tensor for name, tensor in q.items()})
    out = decode_bundle(encode_bundle(KVBundle(meta(quant=qmeta, label=scheme), t)))
    assert out.kept_tokens == 2.5
    for i in range(L):
        k, v = layer_kv(out, i)
        assert k.dtype == torch.float32 and k.shape == dense[f"layers.{i}.keys"].shape
        tol = 0.02 if scheme == "int8" else 0.5
        assert (k - dense[f"layers.{i}.keys"]).abs().max() < tol
        assert (v - dense[f"layers.{i}.values"]).abs().max() < tol


def test_newer_minor_version_with_extra_keys_and_tensors_is_accepted():
    t = dense_tensors()
    t["future.thing"] = torch.zeros(2)
    out = decode_bundle(encode_bundle(KVBundle(meta(format_version="1.7", future_key={"x": 1}), t)))
    assert out.meta["future_key"] == {"x": 1} and "future.thing" in out.tensors


def test_bundle_without_digest_is_accepted():
    out = decode_bundle(raw(meta(), dense_tensors()))
    assert out.meta["doc_id"] == "doc-a"


def test_make_meta_fills_defaults_and_honours_source_date_epoch(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    m = make_meta(doc_id="x")
    assert m == {"format_version": FORMAT_VERSION, "created": 1700000000.0, "tool_version": __version__, "doc_id": "x"}
    # deterministic bytes -> deterministic content address in the store (safetensors alone
    # orders its metadata map randomly, so compare many encodings)
    encodings = {encode_bundle(KVBundle(meta(), dense_tensors())) for _ in range(20)}
    assert len(encodings) == 1


# -- validation failures --------------------------------------------------------------------

def _drop(name):
    def f(m, t):
        del t[name]
    return f


def _set_tensor(name, value):
    def f(m, t):
        t[name] = value
    return f


def _set_meta(key, value):
    def f(m, t):
        m[key] = value
    return f


def _del_meta(key):
    def f(m, t):
        del m[key]
    return f


def _set_model(key, value):
    def f(m, t):
        m["model"] = dict(m["model"], **{key: value})
    return f


INVALID = [
    ("major-2", _set_meta("format_version", "2.0"), r"version 2\.0 is not supported .*supports 1\.x"),
    ("version-garbage", _set_meta("format_version", "one"), "not 'major.minor'"),
    ("missing-chain-hash", _del_meta("chain_hash"), "lacks required key.*chain_hash"),
    ("missing-model", _del_meta("model"), "lacks required key.*model"),
    ("model-no-head-dim", _set_model("head_dim", None), "positive integers"),
    ("missing-values", _drop("layers.1.values"), r"layer 1: missing tensor 'layers\.1\.values'"),
    ("missing-keys", _drop("layers.0.keys"), r"layer 0: missing tensor 'layers\.0\.keys'"),
    ("missing-token-ids", _drop("token_ids"), "no 'token_ids'"),
    ("missing-positions", _drop("positions"), "layer 0 has no positions"),
    ("kv-shape-mismatch", _set_tensor("layers.0.values", torch.zeros(H_KV, T - 1, D)), r"layers\.0\.values holds 4 tokens"),
    ("hkv-mismatch", _set_model("n_kv_heads", 2), r"expected \[H_kv=2"),
    ("head-dim-mismatch", _set_model("head_dim", 8), r"D=8\]"),
    ("positions-shape", _set_tensor("positions", torch.arange(4)), r"positions must be int64 \[5\]"),
    ("token-range", _set_meta("token_end", 99), r"token_ids has 5 tokens but the token range \[10, 99\)"),
    ("token-ids-int32", _set_tensor("token_ids", torch.arange(5, dtype=torch.int32)), "token_ids must be int64"),
    ("positions-float", _set_tensor("positions", torch.arange(5.0)), "positions must be int64"),
    ("keys-int", _set_tensor("layers.1.keys", torch.zeros(H_KV, T, D, dtype=torch.int64)), r"layers\.1\.keys must be a floating dtype"),
    ("extra-layer", _set_tensor("layers.2.keys", torch.zeros(H_KV, T, D)), "beyond the model's 2 layers"),
    ("keys-2d", _set_tensor("layers.0.keys", torch.zeros(H_KV, T)), r"layers\.0\.keys has shape \[3, 5\]"),
    ("bias-shape", _set_tensor("layers.0.bias", torch.zeros(H_KV, T).half()), r"layers\.0\.bias must be float \[H_q=9"),
    ("kept-shape", _set_tensor("kept", torch.ones(T - 1, dtype=torch.uint8)), r"kept must be uint8 \[5\] of 0 and 1"),
    ("kept-not-a-mask", _set_tensor("kept", torch.full((T,), 2, dtype=torch.uint8)), r"kept must be uint8 \[5\] of 0 and 1"),
    ("narrow-shape", _set_tensor("layers.0.narrow", torch.ones(H_Q, dtype=torch.uint8)), r"layers\.0\.narrow must be uint8 \[3\]"),
    ("narrow-without-kept", _set_tensor("layers.1.narrow", torch.tensor([1, 0, 0], dtype=torch.uint8)),
     r"layers\.1\.narrow needs the chunk's 'kept' tensor and an ec layer"),
]


def test_narrow_heads_get_a_masking_bias_over_any_stored_one():
    """1.8: a reader masks the query heads of ``layers.i.narrow``'s KV heads off the tokens
    ``kept`` leaves out, on top of a stored (steering) bias; other layers keep theirs as stored."""
    from kdnctl.format.bundle import MASKED

    kept = torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8)
    steer = torch.randn(H_Q, T).half()
    b = KVBundle(meta(), {"kept": kept, "layers.0.narrow": torch.tensor([0, 1, 1], dtype=torch.uint8),
                          "layers.0.bias": steer, "layers.1.bias": steer.clone()})
    want = steer.clone()
    want[3:, ~kept.bool()] = MASKED  # query heads 3-8 read KV heads 1 and 2
    assert torch.equal(b.layer_bias(0), want) and torch.equal(b.layer_bias(1), steer)
    assert KVBundle(meta(), {}).layer_bias(0) is None


@pytest.mark.parametrize("name,mutate,message", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_bundles_raise_one_line_format_error(name, mutate, message):
    m, t = meta(), dense_tensors()
    mutate(m, t)
    with pytest.raises(BundleFormatError, match=message) as exc:
        decode_bundle(raw(m, t))
    assert "\n" not in exc.value.one_line()
    # the writer refuses the same bundle, so it never reaches a store
    with pytest.raises(BundleFormatError, match=message):
        encode_bundle(KVBundle(m, t))


def test_pruned_positions_must_match_layer_and_be_sorted():
    t = pruned_tensors()
    t["layers.1.positions"] = torch.tensor([[10, 14, 15], [12, 13, 14], [11, 12, 13]])
    with pytest.raises(BundleFormatError, match=r"layers\.1\.keys holds 2 tokens but its positions hold 3"):
        decode_bundle(raw(meta(), t))
    t = pruned_tensors()
    t["layers.0.positions"] = torch.tensor([[12, 10, 14], [11, 12, 13], [10, 11, 14]])
    with pytest.raises(BundleFormatError, match="not strictly ascending"):
        decode_bundle(raw(meta(), t))
    t = pruned_tensors()
    t["layers.0.positions"] = t["layers.0.positions"][:2]  # 2 heads instead of 3
    with pytest.raises(BundleFormatError, match=r"H_kv=3"):
        decode_bundle(raw(meta(), t))


@pytest.mark.parametrize(
    "data,message",
    [
        (b"", "truncated"),
        (b"hello", "truncated"),
        (b"this is certainly not a safetensors file at all", "truncated or not a safetensors"),
        (struct.pack("<Q", 5) + b"[1,2]", "not a JSON object"),
        (struct.pack("<Q", 3) + b"{x}", "not valid safetensors JSON"),
    ],
)
def test_non_safetensors_bytes(data, message):
    with pytest.raises(BundleFormatError, match=message):
        decode_bundle(data)


def test_metadata_problems():
    t = dense_tensors()
    with pytest.raises(BundleFormatError, match="no 'kdnctl' entry"):
        decode_bundle(raw(None, t, metadata={}))
    with pytest.raises(BundleFormatError, match="no 'kdnctl' entry"):
        decode_bundle(st_save({"x": torch.zeros(1)}))
    with pytest.raises(BundleFormatError, match="'kdnctl' is not valid JSON"):
        decode_bundle(raw(None, t, metadata={"kdnctl": "{not json"}))
    with pytest.raises(BundleFormatError, match="not a JSON object"):
        decode_bundle(raw(None, t, metadata={"kdnctl": "[1, 2]"}))
    with pytest.raises(BundleFormatError, match="unexpected safetensors metadata"):
        decode_bundle(raw(None, t, metadata={"kdnctl": json.dumps(meta()), "other": "x"}))
    with pytest.raises(BundleFormatError, match="must be bytes"):
        decode_bundle("not bytes")


def test_fingerprint_mismatch_names_both_fingerprints():
    data = encode_bundle(KVBundle(meta(), dense_tensors()))
    with pytest.raises(ModelMismatchError) as exc:
        decode_bundle(data, expect_fingerprint=OTHER_FP)
    assert FP[:12] in exc.value.message and OTHER_FP[:12] in exc.value.message
    assert decode_bundle(data, expect_fingerprint=FP).meta["model_fingerprint"] == FP


def test_truncated_bytes_at_several_offsets():
    data = encode_bundle(KVBundle(meta(), dense_tensors()))
    h = header_len(data)
    for cut in sorted({0, 1, 7, 8, 9, 40, h // 2, h - 1, h, h + 1, h + 17, len(data) - 4, len(data) - 1}):
        with pytest.raises(BundleFormatError):
            decode_bundle(data[:cut])
    # extra bytes are as wrong as missing ones
    with pytest.raises(BundleFormatError, match="truncated or corrupted"):
        decode_bundle(data + b"\x00")


def test_flipped_byte_in_meta_value_is_caught_by_header_checksum():
    data = bytearray(encode_bundle(KVBundle(meta(), dense_tensors())))
    i = data.index(b"doc-a")
    data[i + 4] ^= 0x01  # "doc-a" -> "doc-`": still valid JSON, still a plausible bundle
    with pytest.raises(BundleFormatError, match="checksum mismatch"):
        decode_bundle(bytes(data))


def test_flipped_dtype_in_tensor_index_is_caught():
    clean = encode_bundle(KVBundle(meta(), pruned_tensors()))
    i = clean.index(b'"dtype":"F16"') + len(b'"dtype":"')
    data = bytearray(clean)
    data[i] = ord("X")  # F16 -> X16: not a dtype at all
    with pytest.raises(BundleFormatError, match="cannot be read"):
        decode_bundle(bytes(data))
    data = bytearray(clean)
    data[i] = ord("I")  # F16 -> I16: same element size, safetensors parses it; the checksum catches it
    with pytest.raises(BundleFormatError, match="checksum mismatch"):
        decode_bundle(bytes(data))


@pytest.mark.parametrize("mask", [0x01, 0x80])
def test_every_single_flipped_header_byte_is_rejected(mask):
    data = encode_bundle(KVBundle(meta(), pruned_tensors()))
    accepted = []
    for pos in range(header_len(data)):
        bad = bytearray(data)
        bad[pos] ^= mask
        try:
            decode_bundle(bytes(bad))
        except BundleFormatError:
            continue
        accepted.append(pos)  # any other exception type propagates and fails the test
    assert accepted == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_writers_bytes_are_safetensors_own_with_the_canonical_header(seed):
    """``file_bytes`` (what ``encode_bundle`` writes) against safetensors' own file with the
    canonical header: every dtype, empty and 0-d tensors, names whose order differs from their
    dtypes', byte for byte; and a dtype it does not know is left to safetensors."""
    from kdnctl.format.bundle import _canonical_header
    from kdnctl.format.safetensors_bytes import DTYPE_NAMES, file_bytes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, dt in enumerate(list(DTYPE_NAMES) * 3):
        shape = [int(x) for x in torch.randint(0, 5, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)]
        x = torch.randn(shape, generator=g) * 100
        name = f"layers.{int(torch.randint(0, 40, (1,), generator=g))}.{chr(97 + (i * 7 + seed) % 26)}{i}"
        tensors[name] = x.to(dt) if dt != torch.bool else x > 0
    metadata = {"kdnctl": json.dumps({"b": 1, "a": [seed]}), "digest": "ab" * 32}
    assert file_bytes(tensors, metadata) == _canonical_header(st_save(tensors, metadata=metadata))
    assert file_bytes({"x": torch.zeros(2, dtype=torch.complex64)}, metadata) is None
