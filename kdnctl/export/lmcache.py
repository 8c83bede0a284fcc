"""Export to LMCache's ``fs`` remote storage (FSConnector), the KV layer vLLM uses.

What LMCache 0.5.6 reads (checked against its source, and in tests/test_export_lmcache.py
against its own ChunkedTokenDatabase + LocalCPUBackend + FSConnector):

* Keys: ``ChunkedTokenDatabase`` splits the prompt into ``chunk_size`` (256) token chunks and
  chains ``h = hash_fn((h, tuple(chunk), ()))`` from ``h = NONE_HASH``; byte digests are folded
  to the first 8 bytes big-endian. The key string is
  ``model_name@world_size@worker_id@{h:x}@dtype`` (``half`` / ``bfloat16``); FSConnector's file
  name replaces ``/`` by ``-SEP-`` and appends ``.data``.
* Hash: LMCache takes ``hash_fn`` and ``NONE_HASH`` from vLLM when vLLM is importable
  (``sha256_cbor``: sha256 of the canonical CBOR encoding; ``NONE_HASH = hash_fn(PYTHONHASHSEED)``)
  and falls back to Python's ``hash`` with ``NONE_HASH = 0``. The default here is the
  deployment's choice, vLLM's ``sha256_cbor`` with a fixed seed; ``builtin`` reproduces the
  fallback (Python's hash of int tuples does not depend on PYTHONHASHSEED; it does depend on
  CPython's tuple-hash algorithm, stable since 3.8, on 64-bit builds).
* Payload (``save_chunk_meta``, LMCache's default): 28 bytes = seven int32 (payload bytes,
  memory format 1 = KV_2LTD, dtype code 2 = fp16 / 3 = bf16, shape padded to 4 dims), then one
  tensor ``[2, layers, chunk_size, kv_heads*head_dim]`` in row-major order. Keys are post-RoPE
  in the rotate-half (NeoX) layout vLLM uses for Llama-family models, the layout kdnctl stores.

No LMCache import is needed to write these files.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ExportError, UsageError
from .base import (DocumentKV, read_document_kv, require_plain_attention, require_prefix_mode, tensor_bytes,
                   write_atomic)

LMCACHE_CHUNK_SIZE = 256
HASH_ALGORITHMS = ("sha256_cbor", "builtin")
DTYPES = {"fp16": (torch.float16, "half", 2), "bf16": (torch.bfloat16, "bfloat16", 3)}
KV_2LTD = 1
MANIFEST = "manifest.json"


# --------------------------------------------------------------------------- hashing

def cbor_encode(obj) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding) of ints, str, bytes, lists and
    tuples: what ``cbor2.dumps(obj, canonical=True)`` produces for these types."""
    out = bytearray()
    _cbor(obj, out)
    return bytes(out)


def _head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append((major << 5) | n)
    elif n < 1 << 8:
        out += bytes(((major << 5) | 24, n))
    elif n < 1 << 16:
        out.append((major << 5) | 25)
        out += n.to_bytes(2, "big")
    elif n < 1 << 32:
        out.append((major << 5) | 26)
        out += n.to_bytes(4, "big")
    else:
        out.append((major << 5) | 27)
        out += n.to_bytes(8, "big")


def _cbor(obj, out: bytearray) -> None:
    if isinstance(obj, bool) or obj is None:
        raise TypeError(f"cbor_encode does not handle {obj!r}")
    if isinstance(obj, int):
        if 0 <= obj < 1 << 64:
            _head(0, obj, out)
        elif -(1 << 64) <= obj < 0:
            _head(1, -1 - obj, out)
        else:  # bignum: tag 2 (positive) / 3 (negative), minimal big-endian bytes
            tag, mag = (2, obj) if obj >= 0 else (3, -1 - obj)
            _head(6, tag, out)
            raw = mag.to_bytes((mag.bit_length() + 7) // 8, "big")
            _head(2, len(raw), out)
            out += raw
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        _head(3, len(raw), out)
        out += raw
    elif isinstance(obj, (bytes, bytearray)):
        _head(2, len(obj), out)
        out += obj
    elif isinstance(obj, (list, tuple)):
        _head(4, len(obj), out)
        for item in obj:
            _cbor(item, out)
    else:
        raise TypeError(f"cbor_encode does not handle {type(obj).__name__}")


def sha256_cbor(obj) -> bytes:
    """vLLM's ``sha256_cbor``: sha256 over the canonical CBOR encoding."""
    return hashlib.sha256(cbor_encode(obj)).digest()


def fold_hash(value) -> int:
    """LMCache folds byte digests to the first 8 bytes, big-endian; ints pass through."""
    return int.from_bytes(value[:8], "big") if isinstance(value, (bytes, bytearray)) else int(value)


@dataclass(frozen=True)
class HashSettings:
    """How the engine computes chunk keys. ``none_hash`` None = what LMCache would use:
    ``fold(sha256_cbor(seed))`` under vLLM's sha256_cbor, 0 for the builtin fallback."""

    algorithm: str = "sha256_cbor"
    python_hash_seed: str = "0"
    none_hash: int | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in HASH_ALGORITHMS:
            raise UsageError(f"unknown hash algorithm {self.algorithm!r}",
                             hint=f"use one of {', '.join(HASH_ALGORITHMS)}")

    def hash_fn(self):
        return sha256_cbor if self.algorithm == "sha256_cbor" else hash

    def initial(self) -> int:
        if self.none_hash is not None:
            return int(self.none_hash)
        if self.algorithm == "sha256_cbor":
            return fold_hash(sha256_cbor(str(self.python_hash_seed)))
        return 0


def chunk_hashes(token_ids: list[int], chunk_size: int, settings: HashSettings) -> list[int]:
    """Chained hashes of every FULL chunk, as LMCache's ChunkedTokenDatabase computes them."""
    fn = settings.hash_fn()
    h = settings.initial()
    out = []
    for start in range(0, len(token_ids) - chunk_size + 1, chunk_size):
        h = fold_hash(fn((h, tuple(int(t) for t in token_ids[start : start + chunk_size]), ())))
        out.append(h)
    return out


def key_string(model_name: str, world_size: int, worker_id: int, chunk_hash: int, dtype_name: str) -> str:
    return f"{model_name}@{world_size}@{worker_id}@{chunk_hash:x}@{dtype_name}"


def file_name(key: str) -> str:
    return key.replace("/", "-SEP-") + ".data"


# --------------------------------------------------------------------------- payload

def chunk_payload(doc: DocumentKV, start: int, end: int, dtype: torch.dtype, heads: slice) -> torch.Tensor:
    """``[2, L, end-start, H*D]`` of one chunk (keys then values), in ``dtype``."""
    layers = []
    for kind in (doc.keys, doc.values):
        per_layer = []
        for t in kind:
            x = t[heads, start:end]  # [H, T, D]
            per_layer.append(x.permute(1, 0, 2).reshape(end - start, -1))
        layers.append(torch.stack(per_layer))
    return torch.stack(layers).to(dtype).contiguous()


def chunk_header(payload: torch.Tensor, dtype_code: int) -> bytes:
    shape = list(payload.shape) + [0] * (4 - payload.dim())
    return struct.pack("<7i", payload.numel() * payload.element_size(), KV_2LTD, dtype_code, *shape)


# --------------------------------------------------------------------------- export

@dataclass
class LMCacheExportResult:
    directory: Path
    manifest: dict
    n_files: int = 0
    n_bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # documents shorter than one chunk
    token_ids: dict[str, list[int]] = field(default_factory=dict)


def check_chunk_size(chunk_size: int) -> int:
    if chunk_size != LMCACHE_CHUNK_SIZE:
        raise ExportError(
            f"chunk size {chunk_size} is not LMCache's ({LMCACHE_CHUNK_SIZE}); keys and payload "
            "shapes would not match what its ChunkedTokenDatabase looks up",
            hint=f"export with --chunk-size {LMCACHE_CHUNK_SIZE} (LMCache's chunk_size)",
        )
    return chunk_size


def check_exportable(doc: DocumentKV) -> None:
    require_prefix_mode(doc)
    require_plain_attention(doc, "vLLM", "allocates sliding-window layers' KV by their window (a layout of its own)")
    if doc.pruned:
        raise ExportError(
            f"{doc.doc_id} [{doc.label}] is pruned; LMCache and vLLM need every token of a chunk",
            hint="export 'full' or a quantization-only version (e.g. b1-int8)",
        )


def export_lmcache(store, doc_ids: list[str], directory: str | Path, *, label: str = "full",
                   model_name: str, dtype: str = "fp16", chunk_size: int = LMCACHE_CHUNK_SIZE,
                   hash_settings: HashSettings | None = None, world_size: int = 1,
                   fingerprint: str | None = None) -> LMCacheExportResult:
    """Write FSConnector files for every full chunk of ``doc_ids`` [label] plus manifest.json."""
    check_chunk_size(chunk_size)
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", hint="use fp16 or bf16")
    if world_size < 1:
        raise UsageError(f"world size must be >= 1, got {world_size}")
    settings = hash_settings or HashSettings()
    torch_dtype, dtype_name, dtype_code = DTYPES[dtype]
    directory = Path(directory)
    docs = [read_document_kv(store, d, label, fingerprint=fingerprint) for d in doc_ids]
    for doc in docs:
        check_exportable(doc)
    manifest = {
        "format": "kdnctl-lmcache-fs/1",
        "model_name": model_name,
        "dtype": dtype_name,
        "chunk_size": chunk_size,
        "world_size": world_size,
        "memory_format": "KV_2LTD",
        "save_chunk_meta": True,
        "hash_algorithm": settings.algorithm,
        "python_hash_seed": settings.python_hash_seed,
        "none_hash": settings.initial(),
        "documents": [],
    }
    result = LMCacheExportResult(directory, manifest)
    for doc in docs:
        h_kv = doc.keys[0].shape[0]
        if h_kv % world_size:
            raise ExportError(f"{h_kv} KV heads cannot be split over world size {world_size}")
        per = h_kv // world_size
        entry = {"doc_id": doc.doc_id, "doc_version": doc.doc_version, "label": doc.label,
                 "n_tokens": doc.n_tokens, "chunks": []}
        hashes = chunk_hashes(doc.token_ids, chunk_size, settings)
        result.token_ids[doc.doc_id] = doc.token_ids
        if not hashes:
            result.skipped.append(doc.doc_id)
        for i, h in enumerate(hashes):
            start, end = i * chunk_size, (i + 1) * chunk_size
            keys = []
            for worker in range(world_size):
                key = key_string(model_name, world_size, worker, h, dtype_name)
                payload = chunk_payload(doc, start, end, torch_dtype, slice(worker * per, (worker + 1) * per))
                result.n_bytes += write_atomic(directory / file_name(key),
                                               [chunk_header(payload, dtype_code), tensor_bytes(payload)])
                result.n_files += 1
                keys.append(key)
            item = {"key": keys[0], "token_start": start, "token_end": end}
            if world_size > 1:
                item["worker_keys"] = keys
            entry["chunks"].append(item)
        manifest["documents"].append(entry)
    text = json.dumps(manifest, indent=2, sort_keys=False).encode("utf-8")
    write_atomic(directory / MANIFEST, [text])
    return result


# --------------------------------------------------------------------------- engine check

def check_with_lmcache(result: LMCacheExportResult) -> int:
    """Look every exported chunk up with LMCache's own ChunkedTokenDatabase (configured with the
    manifest's hash settings) and read it with its LocalCPUBackend + FSConnector. Returns the
    number of chunks found and read; raises ExportError on the first miss."""
    from .base import require_engine

    require_engine("lmcache", "lmcache", "checking an LMCache export")
    from .lmcache_engine import LMCacheReader

    man = result.manifest
    found = 0
    with LMCacheReader(result.directory, man) as reader:
        for entry in man["documents"]:
            hits = reader.lookup(result.token_ids[entry["doc_id"]])
            want = [c["key"] for c in entry["chunks"]]
            got = [key for key, tensor in hits]
            if got[: len(want)] != want:
                raise ExportError(f"LMCache does not find the chunks of {entry['doc_id']} "
                                  f"({sum(k in got for k in want)} of {len(want)})")
            found += len(want)
    return found
