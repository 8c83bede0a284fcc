"""Zero-copy tensor views over a safetensors buffer, validated as strictly as the safetensors
reader (kdnctl.format.bundle decodes bundles through it)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import BundleFormatError


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}


def _unreadable(msg: str) -> BundleFormatError:
    return BundleFormatError(f"bundle tensors cannot be read (truncated or corrupted): {msg}")


def tensor_index(header: dict[str, Any], n_header: int, total: int) -> list[tuple]:
    """The tensor index of a safetensors file of ``total`` bytes whose JSON header is
    ``n_header`` bytes: ``(begin, end, name, dtype, shape, numel)`` by offset (payload-relative),
    as strictly checked as the safetensors reader: known dtypes, non-negative integer shapes,
    each tensor's byte range exactly its size, ranges contiguous from 0 and covering the whole
    payload (no gaps, no overlaps, no trailing bytes)."""
    payload = total - (8 + n_header)
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise _unreadable(f"tensor index entry {name!r} is not an object (corrupted?)")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise _unreadable(f"tensor name {name!r} is not valid UTF-8") from None
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dt, str) or dt not in _DTYPES:
            raise _unreadable(f"tensor {name!r} has unknown dtype {dt!r}")
        if type(shape) is not list or not all(type(x) is int and x >= 0 for x in shape):  # (bool is not int)
            raise _unreadable(f"tensor {name!r} has an invalid shape {shape!r}")
        if not (type(offs) is list and len(offs) == 2 and type(offs[0]) is int and type(offs[1]) is int
                and 0 <= offs[0] <= offs[1]):
            raise _unreadable(f"tensor {name!r} has invalid data offsets {offs!r}")
        dtype = _DTYPES[dt]
        numel = 1
        for x in shape:
            numel *= x
        if offs[1] - offs[0] != numel * dtype.itemsize:
            raise _unreadable(f"tensor {name!r}: {offs[1] - offs[0]} bytes for shape {shape} {dt} (corrupted?)")
        entries.append((offs[0], offs[1], name, dtype, shape, numel))
    entries.sort(key=lambda e: (e[0], e[1]))
    pos = 0
    for begin, end, name, *_ in entries:
        if begin != pos:
            raise _unreadable(f"tensor {name!r} does not start where the previous one ends (corrupted?)")
        pos = end
    if pos != payload:
        raise _unreadable(
            f"bundle is truncated or has trailing bytes: the tensor index covers {pos} of {payload} payload bytes"
        )
    return entries


def tensor_views(header: dict[str, Any], buf, n_header: int) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors buffer as zero-copy views into ``buf`` (a writable buffer),
    after the checks of ``tensor_index``. Views keep ``buf`` alive."""
    base = 8 + n_header
    tensors: dict[str, torch.Tensor] = {}
    for begin, _end, name, dtype, shape, numel in tensor_index(header, n_header, len(buf)):
        off = base + begin
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        elif off % dtype.itemsize:  # misaligned for its dtype: one small copy instead of a view
            t = torch.frombuffer(bytearray(buf[off : off + numel * dtype.itemsize]), dtype=dtype).view(shape)
        else:
            t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=off).view(tuple(shape))
        tensors[name] = t
    return tensors
