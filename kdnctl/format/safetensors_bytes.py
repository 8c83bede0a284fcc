"""A safetensors file's bytes as kdnctl writes them, without safetensors' work per tensor.

A bundle holds a hundred or more small tensors; ``safetensors.torch.save`` spends ~80 us of Python
on each (10 ms a chunk), and a compress sizes its chunks more than once. The layout is
safetensors' own: an 8-byte little-endian header length, the JSON header padded with spaces to
8 bytes, then the tensors' bytes back to back in safetensors' order (by dtype, the larger first,
then by name). The header is kdnctl's canonical one (``bundle._canonical_header``): ``__metadata__``
first with its keys sorted, then the tensors by offset, then name. The dtype order and the key
order of a header entry are read off one small file safetensors writes, so the bytes follow the
installed safetensors; ``tests/test_bundle.py`` compares them with its files.
"""

from __future__ import annotations

import functools
import json
import struct

import torch

DTYPE_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
               torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
               torch.float64: "F64"}


@functools.lru_cache(maxsize=1)
def file_order() -> tuple[dict[str, int], tuple[str, ...]]:
    """(each dtype name's rank in safetensors' data order, the key order of a header entry)."""
    from safetensors.torch import save

    data = save({f"t{i}": torch.zeros(1, dtype=dt) for i, dt in enumerate(DTYPE_NAMES)})
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    entries = sorted(header.values(), key=lambda e: e["data_offsets"][0])
    return {e["dtype"]: i for i, e in enumerate(entries)}, tuple(entries[0])


def file_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes | None:
    """The file of contiguous CPU ``tensors`` (no two sharing memory) with ``metadata``; None where
    a tensor's dtype is not one this writes (the caller lets safetensors write the file)."""
    rank, keys = file_order()
    dtypes = {}
    for name, t in tensors.items():
        dtypes[name] = DTYPE_NAMES.get(t.dtype)
        if dtypes[name] not in rank:
            return None
    entries, parts, pos = {}, [], 0
    for name in sorted(tensors, key=lambda n: (rank[dtypes[n]], n)):
        t = tensors[name]
        n = t.numel() * t.element_size()
        fields = {"dtype": dtypes[name], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        entries[name] = {k: fields[k] for k in keys}
        if n:
            parts.append(t.reshape(-1).view(torch.uint8).numpy())
        pos += n
    header = {"__metadata__": dict(sorted(metadata.items()))}
    header.update(sorted(entries.items(), key=lambda kv: (kv[1]["data_offsets"][0], kv[0])))
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *parts])
