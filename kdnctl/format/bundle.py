"""KV bundles: one chunk's KV cache (plus token ids, positions, stats) as a safetensors blob.

The format is specified in docs/bundle-format.md. Every byte sequence that is not a valid
bundle turns into a one-line BundleFormatError: bundles come from disk, from a remote store
or from an older/newer kdnctl, and a crash deep inside attention code is far harder to
diagnose than "layer 3: keys and values differ in shape".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kdnctl.errors import BundleFormatError, ModelMismatchError
from .header import (  # noqa: F401  (re-exported: the header format's names live there)
    ALLOWED_METADATA_KEYS as _ALLOWED_METADATA_KEYS, DIGEST_KEY, MAX_HEADER as _MAX_HEADER, META_KEY, SUPPORTED_MAJOR,
    check_version as _check_version, header_size, load_meta as _load_meta, parse_header as _parse_header, read_meta,
)
from .kept import fold_kept_positions, unfold_kept_positions
from .layout import layout_views, parse_head_cached
from .safetensors_bytes import file_bytes
from .names import REQUIRED_META_KEYS, REQUIRED_MODEL_KEYS, tensor_name, role_levels
from .tensor_views import tensor_index, tensor_views

FORMAT_VERSION = "1.12"  # each version's tensors: docs/bundle-format.md, section 2; in short
# 1.1 ladder layout, int16/int32 positions; 1.2 ladder "zlib+params"; 1.3 the entropy-coded ec layout;
# 1.4 ec layers of different lengths (--backfill, layers.i.levels); 1.5 per-role levels; 1.6 deflate
# frames; 1.7 a per-model key basis; 1.8 narrow heads (layers.i.narrow, kept); 1.9 kept_layers;
# 1.10 token_levels.keys (a lift of the keys alone); 1.11 ec code frames of their own widths (codes width 3);
# 1.12 query_energy (ingest: each chunk's squared queries, compress's key weights without a forward)

QUANT_SUFFIXES = (".q", ".scale", ".zero")

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
MASKED = float(torch.finfo(torch.float16).min)  # bias on a row a query head must not read (finite: no inf - inf)

# Ingest statistics are stored as float16 except ``surprisal`` (one float32 per token).
STATS_DTYPE = torch.float16
STATS_PREFIX = "stats."
# An ingest chunk's squared queries [L, H_kv, D] float32 (``kdnctl.engine.prefill.QueryEnergy``)
QUERY_ENERGY = "query_energy"
# Meta keys the writer stamps itself; a derived bundle gets fresh ones (see ``derived_meta``).
STAMPED_META_KEYS = ("format_version", "created", "tool_version")


def masking_bias(bias: torch.Tensor | None, heads: list[int], evicted: torch.Tensor, n_q: int, n_kv: int) -> torch.Tensor:
    """A chunk's ``[H_q, T]`` float16 bias for a layer whose ``heads`` (KV) must not read the
    ``evicted`` rows: their query heads get ``MASKED`` there (over any steering bias)."""
    out = torch.zeros(n_q, evicted.numel()) if bias is None else bias.float().clone()
    group = n_q // n_kv  # query head j reads KV head j // group
    for h in heads:
        out[h * group:(h + 1) * group, evicted] = MASKED
    return out.to(torch.float16)


def stats_name(stat: str) -> str:
    """Name of an ingest statistic's tensor (``window``, ``accum``, ``surprisal``)."""
    return STATS_PREFIX + stat


def stats_tensors(stats: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    """Token range ``[start, end)`` of whole-sequence statistics (last dim = tokens), named and
    in their stored dtypes."""
    out = {}
    for name, stat in stats.items():
        part = stat[..., start:end].contiguous()
        out[stats_name(name)] = part.float() if name == "surprisal" else part.to(STATS_DTYPE)
    return out


def chunk_tensors(result, start: int, end: int, token_ids: list[int], first_position: int) -> dict[str, torch.Tensor]:
    """Tensors of one dense chunk bundle from a prefill result: tokens ``[start, end)`` of
    ``result`` (``keys``/``values`` per layer ``[H_kv, T, D]``, ``stats``), whose ids are
    ``token_ids`` and whose original positions start at ``first_position``."""
    n = end - start
    tensors = {
        "token_ids": torch.tensor(token_ids, dtype=torch.int64),
        "positions": torch.arange(first_position, first_position + n, dtype=torch.int64),
    }
    for layer, (k, v) in enumerate(zip(result.keys, result.values)):
        tensors[tensor_name(layer, "keys")] = k[:, start:end].contiguous().cpu()
        tensors[tensor_name(layer, "values")] = v[:, start:end].contiguous().cpu()
    tensors.update(stats_tensors(result.stats, start, end))
    return tensors


def stats_of(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The statistics a bundle carries, by statistic name."""
    return {n[len(STATS_PREFIX):]: t for n, t in tensors.items() if n.startswith(STATS_PREFIX)}


def tensor_bytes(tensors: dict[str, torch.Tensor], prefix: str) -> int:
    """Payload bytes of the tensors whose names start with ``prefix`` (``"layers."``, ``"stats."``)."""
    return sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith(prefix))


@dataclass
class KVBundle:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    # -- helpers; properties where the contract lists no arguments -----------------------
    @property
    def n_layers(self) -> int:
        return int(self.meta["model"]["n_layers"])

    @property
    def token_ids(self) -> torch.Tensor:
        return self.tensors["token_ids"]

    @property
    def n_tokens(self) -> int:
        """Original chunk length T (also for pruned bundles)."""
        return int(self.tensors["token_ids"].shape[0])

    def is_quantized(self, i: int) -> bool:
        return any(tensor_name(i, n) in self.tensors for n in ("keys.q", "tiers", "keys.codes"))

    def layer(self, i: int, role: str) -> torch.Tensor | None:
        """Layer i's tensor ``role`` (``keys``, ``bias``, ...), or None when absent."""
        return self.tensors.get(tensor_name(i, role))

    def layer_bias(self, i: int) -> torch.Tensor | None:
        """The ``[H_q, T_i]`` attention bias a reader adds to layer i's scores, or None: the stored
        one (steering) and, where some KV heads hold the kept tokens only (1.8), ``MASKED`` for
        their query heads on the other tokens (their rows there decode to the chunk's mean)."""
        stored, narrow, m = self.layer(i, "bias"), self.layer(i, "narrow"), self.meta["model"]
        return stored if narrow is None else masking_bias(stored, torch.nonzero(narrow).flatten().tolist(),
                                                          ~self.tensors["kept"].bool(), int(m["n_q_heads"]), int(m["n_kv_heads"]))

    def layer_len(self, i: int) -> int:
        """T_i, the number of tokens layer i keeps (per head)."""
        p = self.layer(i, "positions")
        return int(p.shape[1]) if p is not None else self.n_tokens

    @property
    def kept_tokens(self) -> float:
        """Average kept tokens per layer (equals n_tokens for an unpruned bundle)."""
        n = self.n_layers
        return sum(self.layer_len(i) for i in range(n)) / n if n else 0.0

    @property
    def nbytes(self) -> int:
        """Payload bytes of all tensors in memory (on disk, minus the header; a 1.9 file holds kept layers' positions once)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def layer_positions(self, i: int) -> torch.Tensor:
        """Absolute original positions of layer i's kept tokens, int64 [H_kv, T_i]."""
        p = self.layer(i, "positions")
        if p is not None:
            return p.long()
        h = int(self.meta["model"]["n_kv_heads"])
        return self.tensors["positions"].unsqueeze(0).expand(h, -1)


def make_meta(**fields: Any) -> dict[str, Any]:
    """A meta dict with format_version, created and tool_version filled; fields override.

    `created` (whole seconds) honours SOURCE_DATE_EPOCH: reproducible builds write identical bundles.
    """
    from kdnctl import __version__

    sde = os.environ.get("SOURCE_DATE_EPOCH")
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "created": float(sde) if sde else float(int(time.time())),  # fixed length: byte caps count it
        "tool_version": __version__,
    }
    meta.update(fields)
    return meta


def derived_meta(source: dict[str, Any], **updates: Any) -> dict[str, Any]:
    """Meta of a bundle derived from ``source``'s (a new version of the same chunk): the source's
    fields with fresh writer stamps, then ``updates`` (label, parent, recipe, ...)."""
    meta = make_meta(**{k: v for k, v in source.items() if k not in STAMPED_META_KEYS})
    meta.update(updates)
    return meta


def header_digest(meta_json: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the meta JSON and the tensor index (name, dtype, shape), in name order."""
    h = hashlib.sha256(meta_json.encode("utf-8"))
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"\n{name}|{t.dtype}|{list(t.shape)}".encode("utf-8"))
    return h.hexdigest()


def encode_bundle(b: KVBundle) -> bytes:
    """Serialise a bundle; validates first so an invalid bundle never reaches the store."""
    tensors: dict[str, torch.Tensor] = {}
    for name, t in b.tensors.items():
        if not isinstance(t, torch.Tensor):
            raise BundleFormatError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().to("cpu")
        # safetensors refuses non-contiguous tensors and tensors sharing storage (views of a
        # bigger tensor, e.g. kv[0]); a compact copy satisfies both.
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone(memory_format=torch.contiguous_format)
        tensors[name] = t
    _validate(b.meta, tensors)
    tensors = fold_kept_positions(b.meta, tensors)  # 1.9: the kept set's positions once per chunk
    try:
        meta_json = json.dumps(b.meta, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise BundleFormatError(f"bundle meta is not JSON-serialisable: {e}") from None
    metadata = {META_KEY: meta_json, DIGEST_KEY: header_digest(meta_json, tensors)}
    data = file_bytes(tensors, metadata)
    if data is None:  # a dtype the writer does not know: safetensors writes it
        from safetensors.torch import save

        data = _canonical_header(save(tensors, metadata=metadata))
    return data


def _canonical_header(data: bytes) -> bytes:
    """Re-emit the safetensors header in a fixed key order.

    safetensors writes __metadata__ from a hash map, so with two keys their order (and hence
    the bundle bytes and its content address) changes from run to run. Equal bundles must be
    equal bytes, so the header is rewritten: metadata first (sorted), tensors by offset.
    """
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    md = header.pop("__metadata__")
    ordered = {"__metadata__": dict(sorted(md.items()))}
    ordered.update(sorted(header.items(), key=lambda kv: (kv[1]["data_offsets"][0], kv[0])))
    text = json.dumps(ordered, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8-byte alignment
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def decode_bundle(data, *, expect_fingerprint: str | None = None) -> KVBundle:
    """Parse and validate bundle bytes. Malformed -> BundleFormatError; other model ->
    ModelMismatchError (only when expect_fingerprint is given).

    A writable buffer (``bytearray``, writable ``memoryview``: what ``Store.read_object_checked``
    returns) is decoded without copying: the tensors are views into it. ``bytes`` are copied
    once into a private buffer (tensors must not alias immutable memory)."""
    if isinstance(data, memoryview) and data.readonly:
        data = bytearray(data)
    elif isinstance(data, bytes):
        data = bytearray(data)
    if not isinstance(data, (bytearray, memoryview)):
        raise BundleFormatError(f"bundle data must be bytes, got {type(data).__name__}")
    fast = parse_head_cached(data, len(data))  # a tensor index seen before: its checks are cached
    if fast is not None:
        meta, meta_json, digest, n, layout = fast
        return finish_decode(meta, meta_json, digest, layout_views(layout, data, n), expect_fingerprint, layout)
    header = _parse_header(data)
    meta, meta_json, digest = _load_meta(header)
    # Version first: a future major version may change anything below, including the digest.
    _check_version(meta)
    (n,) = struct.unpack_from("<Q", data, 0)
    return finish_decode(meta, meta_json, digest, tensor_views(header, data, n), expect_fingerprint)


def parse_head(head, total: int) -> tuple[dict[str, Any], str, str | None, int, list[tuple]]:
    """A bundle's header from its first bytes ``head`` (at least ``header_size`` of them) and its
    length ``total``: ``(meta, meta_json, header digest, n_header, tensor index)`` with the
    same checks ``decode_bundle`` makes before it looks at tensor bytes. A reader that places
    tensors itself (kdnctl/engine/placed.py) then calls ``finish_decode`` on its tensors."""
    header = _parse_header(head, total)
    meta, meta_json, digest = _load_meta(header)
    _check_version(meta)
    (n,) = struct.unpack_from("<Q", head, 0)
    return meta, meta_json, digest, n, tensor_index(header, n, total)


def finish_decode(meta: dict[str, Any], meta_json: str, digest: str | None, tensors: dict[str, torch.Tensor],
                  expect_fingerprint: str | None = None, layout=None) -> KVBundle:
    """The checks of ``decode_bundle`` after the tensors exist: header digest, structure, model
    (with ``layout``, kdnctl/format/layout.py, the same checks with their index-only parts cached)."""
    try:
        computed = None if digest is None else layout.digest(meta_json) if layout is not None \
            else header_digest(meta_json, tensors)
    except UnicodeEncodeError:
        raise BundleFormatError("bundle metadata is not valid UTF-8 (corrupted?)") from None
    if digest is not None and digest != computed:
        raise BundleFormatError("bundle header checksum mismatch (corrupted metadata or tensor index)")
    tensors = unfold_kept_positions(meta, tensors)  # checks and readers see every layer's positions
    if layout is not None:
        layout.validate(meta, tensors, _validate)
    else:
        _validate(meta, tensors)
    fp = meta["model_fingerprint"]
    if expect_fingerprint is not None and fp != expect_fingerprint:
        raise ModelMismatchError(
            f"bundle was made with model {str(fp)[:12]}, the loaded model is "
            f"{str(expect_fingerprint)[:12]}"
        )
    return KVBundle(meta=meta, tensors=tensors)


# -- structural validation --------------------------------------------------------------

def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Raise BundleFormatError naming the first inconsistency between meta and tensors."""
    if not isinstance(meta, dict):
        raise BundleFormatError("bundle meta must be a dict")
    _check_version(meta)
    missing = [k for k in REQUIRED_META_KEYS if k not in meta]
    if missing:
        raise BundleFormatError(f"bundle meta lacks required key(s): {', '.join(missing)}")
    model = meta["model"]
    if not isinstance(model, dict) or not all(_int(model.get(k)) and model[k] > 0 for k in REQUIRED_MODEL_KEYS):
        raise BundleFormatError(
            f"bundle meta 'model' must give positive integers {', '.join(REQUIRED_MODEL_KEYS)}"
        )
    if not isinstance(meta["model_fingerprint"], str):
        raise BundleFormatError("bundle meta 'model_fingerprint' must be a hex string")
    n_layers, h_kv, d = model["n_layers"], model["n_kv_heads"], model["head_dim"]
    ts, te = meta["token_start"], meta["token_end"]
    if not (_int(ts) and _int(te) and 0 <= ts <= te):
        raise BundleFormatError(f"bundle token range [{ts}, {te}) is invalid")
    quant = meta.get("quant")

    ids = tensors.get("token_ids")
    if ids is None:
        raise BundleFormatError("bundle has no 'token_ids' tensor")
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise BundleFormatError(f"token_ids must be int64 [T], got {ids.dtype} {list(ids.shape)}")
    t_full = ids.shape[0]
    if t_full != te - ts:
        raise BundleFormatError(f"token_ids has {t_full} tokens but the token range [{ts}, {te}) has {te - ts}")
    pos = tensors.get("positions")
    if pos is not None and (pos.dtype != torch.int64 or list(pos.shape) != [t_full]):
        raise BundleFormatError(f"positions must be int64 [{t_full}], got {pos.dtype} {list(pos.shape)}")

    kept = tensors.get("kept")
    if kept is not None and (kept.dtype != torch.uint8 or list(kept.shape) != [t_full] or bool((kept > 1).any())):
        raise BundleFormatError(f"kept must be uint8 [{t_full}] of 0 and 1, got {kept.dtype} {list(kept.shape)}")
    energy = tensors.get(QUERY_ENERGY)
    if energy is not None and (energy.dtype != torch.float32 or list(energy.shape) != [n_layers, h_kv, d]
                               or not bool(torch.isfinite(energy).all()) or bool((energy < 0).any())):
        raise BundleFormatError(f"{QUERY_ENERGY} must be float32 [{n_layers}, {h_kv}, {d}] of finite values >= 0, "
                                f"got {energy.dtype} {list(energy.shape)}")
    for name in tensors:
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= n_layers:
            raise BundleFormatError(f"tensor {name!r} is beyond the model's {n_layers} layers")

    for i in range(n_layers):
        t_i = _validate_positions(tensors, i, h_kv, pos, t_full)
        for kind in ("keys", "values"):
            base = tensor_name(i, kind)
            dense, coded = base in tensors, f"{base}.q" in tensors
            laddered = f"layers.{i}.tiers" in tensors
            entropy = not laddered and f"{base}.codes" in tensors  # the ec layout (quant/entropy.py)
            if dense and (coded or laddered or entropy):
                raise BundleFormatError(f"layer {i} has both dense and quantized {kind}")
            if laddered:  # ladder layout: the quantizer checks every slice against the tier map
                if not quant:
                    raise BundleFormatError(f"layer {i} has a tier map but meta has no 'quant'")
                absent = [base + s for s in (".codes", ".params") if base + s not in tensors]
                tiers = tensors[f"layers.{i}.tiers"]
                if absent:
                    raise BundleFormatError(f"layer {i}: missing ladder tensor(s) {', '.join(absent)}")
                if tiers.dtype != torch.uint8 or list(tiers.shape) != [h_kv, t_i]:
                    raise BundleFormatError(f"layers.{i}.tiers must be uint8 [{h_kv}, {t_i}], got {tiers.dtype} {list(tiers.shape)}")
            elif entropy:
                if not quant or quant.get("scheme") != "ec":
                    raise BundleFormatError(f"layer {i} has entropy-coded {kind} but meta's quant scheme is not 'ec'")
                if base + ".params" not in tensors:
                    raise BundleFormatError(f"layer {i}: missing tensor {base}.params")
                levels = role_levels(tensors, f"layers.{i}", kind)
                if levels is None or levels.dtype != torch.uint8 or list(levels.shape) != [t_i]:
                    raise BundleFormatError(f"layer {i}: token_levels (or token_levels.{kind}, layers.{i}.levels, {base}.levels) "
                                            f"must be uint8 [{t_i}]")
            elif coded:
                if not quant:
                    raise BundleFormatError(f"layer {i} {kind} are quantized but meta has no 'quant'")
                absent = [base + s for s in QUANT_SUFFIXES if base + s not in tensors]
                if absent:
                    raise BundleFormatError(f"layer {i}: missing quantized tensor(s) {', '.join(absent)}")
                # The quantizers also store the original shape; when present it must agree.
                shp = tensors.get(f"{base}.shape")
                if shp is not None and shp.tolist() != [h_kv, t_i, d]:
                    raise BundleFormatError(f"{base}.shape is {shp.tolist()}, expected {[h_kv, t_i, d]}")
            elif not dense:
                raise BundleFormatError(f"layer {i}: missing tensor {base!r}")
        k, v = tensors.get(tensor_name(i, "keys")), tensors.get(tensor_name(i, "values"))
        for name, t in ((tensor_name(i, "keys"), k), (tensor_name(i, "values"), v)):
            if t is None:
                continue
            if not t.dtype.is_floating_point:
                raise BundleFormatError(f"{name} must be a floating dtype, got {t.dtype}")
            if t.dim() != 3 or t.shape[0] != h_kv or t.shape[2] != d:
                raise BundleFormatError(
                    f"{name} has shape {list(t.shape)}, expected [H_kv={h_kv}, T, D={d}] from meta['model']"
                )
            if t.shape[1] != t_i:
                raise BundleFormatError(f"{name} holds {t.shape[1]} tokens but its positions hold {t_i}")
        if k is not None and v is not None and k.shape != v.shape:
            raise BundleFormatError(f"layer {i}: keys {list(k.shape)} and values {list(v.shape)} differ in shape")
        _validate_bias(tensors, i, model, t_i)
        _validate_narrow(tensors, i, model, t_i, t_full, quant)


def _validate_positions(tensors, i: int, h_kv: int, pos, t_full: int) -> int:
    """Check layer i's positions; return T_i."""
    lp = tensors.get(tensor_name(i, "positions"))
    if lp is None:
        if pos is None:
            raise BundleFormatError(f"layer {i} has no positions (neither 'positions' nor 'layers.{i}.positions')")
        return t_full
    # int64 in 1.0; 1.1 also allows int16/int32 (a size-budgeted bundle pays for every byte)
    if lp.dtype not in (torch.int64, torch.int32, torch.int16) or lp.dim() != 2 or lp.shape[0] != h_kv or lp.shape[1] > t_full:
        raise BundleFormatError(
            f"layers.{i}.positions must be int [H_kv={h_kv}, T_i<={t_full}], got {lp.dtype} {list(lp.shape)}"
        )
    # Sorted ascending per head is part of the contract; consumers rely on it to merge and
    # to rebuild causal order, so a violation is a format error, not a soft warning.
    if lp.shape[1] > 1 and not bool((lp[:, 1:] > lp[:, :-1]).all()):
        raise BundleFormatError(f"layers.{i}.positions are not strictly ascending per head")
    if lp.numel() and int(lp.min()) < 0:
        raise BundleFormatError(f"layers.{i}.positions contain negative positions")
    return int(lp.shape[1])


def _validate_bias(tensors, i: int, model: dict, t_i: int) -> None:
    bias = tensors.get(tensor_name(i, "bias"))
    if bias is None:
        return
    h_q = model.get("n_q_heads")
    if not bias.dtype.is_floating_point or bias.dim() != 2 or bias.shape[1] != t_i or (
        _int(h_q) and bias.shape[0] != h_q
    ):
        raise BundleFormatError(
            f"layers.{i}.bias must be float [H_q={h_q}, T_i={t_i}], got {bias.dtype} {list(bias.shape)}"
        )


def _validate_narrow(tensors, i: int, model: dict, t_i: int, t_full: int, quant) -> None:
    """1.8: ``layers.i.narrow`` uint8 ``[H_kv]`` (1: the head holds the ``kept`` tokens only), ec, every token."""
    narrow = tensors.get(tensor_name(i, "narrow"))
    if narrow is None:
        return
    h_kv, h_q = model["n_kv_heads"], model.get("n_q_heads")
    if narrow.dtype != torch.uint8 or list(narrow.shape) != [h_kv] or bool((narrow > 1).any()):
        raise BundleFormatError(f"layers.{i}.narrow must be uint8 [{h_kv}] of 0 and 1, got {narrow.dtype} {list(narrow.shape)}")
    if "kept" not in tensors or t_i != t_full or not quant or quant.get("scheme") != "ec":
        raise BundleFormatError(f"layers.{i}.narrow needs the chunk's 'kept' tensor and an ec layer holding all {t_full} tokens")
    if not (_int(h_q) and h_q % h_kv == 0):
        raise BundleFormatError(f"layers.{i}.narrow needs meta['model']['n_q_heads'], a multiple of {h_kv}")
