"""Format 1.9: layers holding the chunk's kept tokens store no positions of their own; the
file marks them in ``kept_layers`` and the decoder rebuilds their positions from ``kept``."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from kdnctl.format.bundle import KVBundle, decode_bundle, encode_bundle
from kdnctl.errors import BundleFormatError

from test_bundle import D, H_KV, L, meta, raw

KEPT = torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8)  # T = 5 tokens at positions 10..14


def kept_tensors(first_dtype=torch.int16):
    """Layer 0 holds the kept tokens (positions 10, 12, 13) in every head; layer 1 its own set."""
    g = torch.Generator().manual_seed(3)
    t = {"token_ids": torch.tensor([5, 7, 11, 13, 17]), "positions": torch.arange(10, 15), "kept": KEPT.clone()}
    t["layers.0.positions"] = torch.tensor([10, 12, 13], dtype=first_dtype).expand(H_KV, -1).contiguous()
    t["layers.1.positions"] = torch.tensor([[10, 11], [12, 13], [13, 14]], dtype=torch.int16)
    for i in range(L):
        n = t[f"layers.{i}.positions"].shape[1]
        t[f"layers.{i}.keys"] = torch.randn(H_KV, n, D, generator=g)
        t[f"layers.{i}.values"] = torch.randn(H_KV, n, D, generator=g)
    return t


def file_index(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return {k: v for k, v in json.loads(data[8 : 8 + n]).items() if k != "__metadata__"}


def test_kept_layers_store_their_positions_once_and_read_back_unchanged():
    tensors = kept_tensors()
    data = encode_bundle(KVBundle(meta=meta(), tensors=tensors))
    index = file_index(data)
    assert "layers.0.positions" not in index and "layers.1.positions" in index  # layer 1 is not the kept set
    assert index["kept_layers"]["dtype"] == "U8" and index["kept_layers"]["shape"] == [L]
    b = decode_bundle(data)
    assert "kept_layers" not in b.tensors  # readers see 1.8's tensors
    assert b.tensors["layers.0.positions"].dtype == torch.int16
    assert torch.equal(b.tensors["layers.0.positions"], tensors["layers.0.positions"])
    assert torch.equal(b.layer_positions(0), torch.tensor([[10, 12, 13]] * H_KV))
    assert b.layer_len(0) == 3 and b.layer_len(1) == 2
    assert encode_bundle(b) == data  # the same bundle, the same bytes (and content address)
    without = {k: v for k, v in tensors.items() if k != "kept"}  # no kept set: every layer stores its own
    plain = encode_bundle(KVBundle(meta=meta(), tensors=without))
    assert "layers.0.positions" in file_index(plain) and "kept_layers" not in file_index(plain)


def test_positions_in_another_dtype_are_stored_as_they_are():
    """Only what decodes back bit for bit is folded: int64 positions stay in the file."""
    data = encode_bundle(KVBundle(meta=meta(), tensors=kept_tensors(torch.int64)))
    assert "kept_layers" not in file_index(data) and "layers.0.positions" in file_index(data)
    assert decode_bundle(data).tensors["layers.0.positions"].dtype == torch.int64


def _on_disk(**change):
    """A 1.9 file as a writer could get it wrong (written without the encoder's checks)."""
    t = kept_tensors()
    t.pop("layers.0.positions")
    t["kept_layers"] = torch.tensor([1, 0], dtype=torch.uint8)
    for k, v in change.items():
        if v is None:
            t.pop(k)
        else:
            t[k] = v
    return raw(meta(), t)


@pytest.mark.parametrize("change, message", [
    ({}, None),
    ({"kept_layers": torch.tensor([1, 0, 0], dtype=torch.uint8)}, "kept_layers must be uint8 [2]"),
    ({"kept_layers": torch.tensor([2, 0], dtype=torch.uint8)}, "of 0 and 1"),
    ({"kept_layers": torch.tensor([1, 0], dtype=torch.int64)}, "kept_layers must be uint8"),
    ({"kept": None}, "needs a valid 'kept'"),
    ({"kept": torch.tensor([1, 0, 1], dtype=torch.uint8)}, "needs a valid 'kept'"),
    ({"positions": None}, "needs a valid 'kept'"),
    ({"layers.0.positions": torch.tensor([[10, 12, 13]] * H_KV, dtype=torch.int16)}, "stores its own positions too"),
    ({"kept": torch.tensor([1, 1, 1, 1, 0], dtype=torch.uint8)}, "holds 3 tokens but its positions hold 4"),
])
def test_bad_kept_layers_are_one_line_format_errors(change, message):
    data = _on_disk(**change)
    if message is None:  # the well-formed file decodes
        assert decode_bundle(data).layer_len(0) == 3
        return
    with pytest.raises(BundleFormatError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        decode_bundle(data)
    assert "\n" not in str(e.value)


def test_the_mark_is_the_encoders_to_write():
    t = kept_tensors()
    t["kept_layers"] = torch.tensor([0, 0], dtype=torch.uint8)
    with pytest.raises(BundleFormatError, match="the encoder's to write"):
        encode_bundle(KVBundle(meta=meta(), tensors=t))
