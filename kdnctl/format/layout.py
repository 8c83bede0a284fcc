"""Bundle headers parsed and checked once per distinct tensor index.

A document's chunks share one tensor index: the same names, dtypes, shapes and offsets, chunk
after chunk (a quantized 30-layer chunk holds 242 small tensors). Turning that index into
tensor views, checking it as strictly as the safetensors reader (``tensor_index``), formatting
it for the header digest and checking the structure against the meta (the decoder's structure check)
cost about a millisecond per chunk in Python. Here that work is done once per distinct index
and reused; per chunk there remain the JSON parse of the chunk's own metadata, the sha256
header digest over that metadata plus the cached index text, and the checks of the few tensor
CONTENTS the structure check reads (per-layer positions, stored quantized shapes).

Why reuse is sound: the cache key is the exact text of the header after the metadata object,
so everything derived from that text alone (entries, digest text, which tensors exist with
which dtype and shape) is the same for every chunk carrying it. The structure check reads,
besides dtypes and shapes, only a few meta fields: a check that passed is remembered per
"signature" of exactly those fields (``_meta_sig``), and only re-run when they differ. Headers
not in kdnctl's canonical form (metadata first, no whitespace) take the general path, which
parses everything, as does anything these shortcuts would have to judge: the general path
then raises its usual error.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from collections import OrderedDict
from typing import Any

import torch

from .header import MAX_HEADER, check_version, load_meta
from ..errors import BundleFormatError
from .names import REQUIRED_META_KEYS, REQUIRED_MODEL_KEYS, tensor_name
from .tensor_views import tensor_index

_PREFIX = '{"__metadata__":'
_DECODER = json.JSONDecoder()
_MAX_LAYOUTS = 64
_MAX_SIGS = 16
_CACHE: OrderedDict[str, Layout] = OrderedDict()
_LOCK = threading.Lock()
_POSITIONS_RE = re.compile(r"^layers\.(\d+)\.positions$")


class Layout:
    """Everything derived from one tensor index text."""

    def __init__(self, entries: list[tuple], payload: int):
        self.entries = entries  # tensor_index's (begin, end, name, dtype, shape, numel), by offset
        self.payload = payload  # payload bytes the index covers
        self.names = frozenset(e[2] for e in entries)
        self.digest_text = "".join(f"\n{e[2]}|{e[3]}|{list(e[4])}" for e in sorted(entries, key=lambda e: e[2])).encode()
        self.shapes = {e[2]: (e[3], tuple(e[4])) for e in entries}
        self.strides = {e[2]: (tuple(e[4]), _contiguous_strides(e[4])) for e in entries}
        self._passed: dict[tuple, list] = {}  # meta signature -> content checks still due per chunk
        self.memo: dict = {}  # per-consumer derived facts (kdnctl/engine/placed.py)

    def digest(self, meta_json: str) -> str:
        """``bundle.header_digest`` of a bundle with this index (same bytes hashed)."""
        return hashlib.sha256(meta_json.encode("utf-8") + self.digest_text).hexdigest()

    def validate(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], full_check) -> None:
        """``full_check(meta, tensors)`` (the bundle decoder's structure check) for tensors laid
        out as this index says: run in full once per meta signature, then only its checks of
        tensor contents."""
        sig = _meta_sig(meta)
        if "kept_layers" in self.names:  # 1.9: layer lengths follow kept's contents, not the index
            sig = None
        due = self._passed.get(sig) if sig is not None else None
        if due is not None:
            if _contents_ok(tensors, due):
                return
            full_check(meta, tensors)  # raises the general check's own error
            return
        full_check(meta, tensors)
        if sig is not None and len(self._passed) < _MAX_SIGS:
            self._passed[sig] = self._content_plan(meta)

    def _content_plan(self, meta: dict[str, Any]) -> list:
        """The checks of tensor contents the structure check made for this index and meta signature."""
        model = meta["model"]
        n_layers, h_kv, d = model["n_layers"], model["n_kv_heads"], model["head_dim"]
        t_full = meta["token_end"] - meta["token_start"]
        plan = []
        for name in self.names:
            if _POSITIONS_RE.match(name):
                plan.append(("positions", name))
        for i in range(n_layers):
            lp = self.shapes.get(tensor_name(i, "positions"))
            t_i = lp[1][1] if lp is not None else t_full
            if tensor_name(i, "tiers") in self.names:
                continue
            for kind in ("keys", "values"):
                base = tensor_name(i, kind)
                if f"{base}.q" in self.names and f"{base}.shape" in self.names:
                    plan.append(("shape", f"{base}.shape", [h_kv, t_i, d]))
        return plan


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for x in reversed(shape):
        strides.append(step)
        step *= max(x, 1)
    return tuple(reversed(strides))


def _meta_sig(meta: dict[str, Any]) -> tuple | None:
    """Exactly the meta fields the structure check (``bundle``) reads (types included: ``True`` is not 1),
    or None when they are unusual enough to always take the full check."""
    model, ts, te = meta.get("model"), meta.get("token_start"), meta.get("token_end")
    if not isinstance(model, dict) or type(ts) is not int or type(te) is not int:
        return None
    return (repr(meta.get("format_version")), tuple(k in meta for k in REQUIRED_META_KEYS),
            repr(tuple(model.get(k) for k in (*REQUIRED_MODEL_KEYS, "n_q_heads"))),
            type(meta.get("model_fingerprint")) is str, ts >= 0, te - ts, not meta.get("quant"))


def _contents_ok(tensors: dict[str, torch.Tensor], plan: list) -> bool:
    for item in plan:
        t = tensors[item[1]]
        if item[0] == "positions":
            if t.shape[1] > 1 and not bool((t[:, 1:] > t[:, :-1]).all()):
                return False
            if t.numel() and int(t.min()) < 0:
                return False
        elif t.tolist() != item[2]:
            return False
    return True


def parse_head_cached(head, total: int):
    """``bundle.parse_head(head, total)`` through the layout cache: ``(meta, meta_json, digest,
    n_header, layout)``, or None when the general path must parse (and judge) this header."""

    if len(head) < 8:
        return None
    (n,) = struct.unpack_from("<Q", head, 0)
    if n > MAX_HEADER or 8 + n > total or 8 + n > len(head):
        return None
    try:
        text = bytes(head[8 : 8 + n]).decode("utf-8")
        if not text.startswith(_PREFIX):
            return None
        md, end = _DECODER.raw_decode(text, len(_PREFIX))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    rest = text[end:].rstrip(" ")
    if '"__metadata__"' in rest or not (rest == "}" or rest.startswith(",")):
        return None  # (a second metadata entry would override the first in a full parse)
    with _LOCK:
        layout = _CACHE.get(rest)
        if layout is not None:
            _CACHE.move_to_end(rest)
    if layout is None:
        try:
            header = json.loads("{" + rest[1:]) if rest != "}" else {}
            layout = Layout(tensor_index(header, n, total), total - 8 - n)
        except (BundleFormatError, ValueError, RecursionError):
            return None
        with _LOCK:
            _CACHE[rest] = layout
            while len(_CACHE) > _MAX_LAYOUTS:
                _CACHE.popitem(last=False)
    if layout.payload != total - 8 - n:
        return None
    meta, meta_json, digest = load_meta({"__metadata__": md})
    check_version(meta)
    return meta, meta_json, digest, n, layout


def layout_views(layout: Layout, buf, n_header: int) -> dict[str, torch.Tensor]:
    """``tensor_views`` of ``buf`` (a writable buffer holding a bundle with this index): one
    typed view of the buffer per dtype, each tensor a strided view of it."""
    base = 8 + n_header
    typed: dict[torch.dtype, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for begin, _end, name, dtype, shape, numel in layout.entries:
        off, size = base + begin, dtype.itemsize
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif off % size:  # misaligned for its dtype: one small copy instead of a view
            tensors[name] = torch.frombuffer(bytearray(buf[off : off + numel * size]), dtype=dtype).view(shape)
        else:
            whole = typed.get(dtype)
            if whole is None:
                whole = typed[dtype] = torch.frombuffer(buf, dtype=dtype, count=(len(buf) - base) // size,
                                                        offset=base) if base % size == 0 else None
            if whole is None:
                tensors[name] = torch.frombuffer(buf, dtype=dtype, count=numel, offset=off).view(tuple(shape))
            else:
                tensors[name] = whole.as_strided(layout.strides[name][0], layout.strides[name][1], begin // size)
    return tensors


def clear() -> None:
    with _LOCK:
        _CACHE.clear()

