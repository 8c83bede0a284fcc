"""Export to a llama.cpp sequence-state file (``llama_state_seq_load_file``).

Format (llama.cpp as vendored by llama-cpp-python 0.3.36, ``llama-context.cpp`` and
``llama-kv-cache.cpp``; proven by tests/test_export_llamacpp.py, which loads the file with
llama.cpp's own code and compares answers):

* file: u32 magic ``'ggsq'`` (0x67677371), u32 version 3, u32 n_tokens, n_tokens int32 token
  ids, then the sequence state;
* sequence state: u32 n_stream (1), u32 cell_count, per cell i32 pos, u32 n_seq (1), i32
  seq_id; u32 v_trans, u32 n_layer; per layer K: i32 ggml type, u64 row bytes, one row per
  cell; then per layer V: the same when not transposed, else i32 type, u32 element bytes,
  u32 n_embd_v, and for each of the n_embd_v elements its value in every cell.

Cells carry their positions, so a pruned cache keeps its original positions; but a cell holds
every head of every layer, so a pruned version can only be exported when all layers and heads
keep the same tokens (``kdnctl compress --method shared``, wrapping kvcrush by default), and
the document's last token: llama.cpp's batch check (``llama-batch.cpp``) requires a new batch
to start at the sequence's largest cached position + 1. V is transposed exactly
when the context runs without flash attention (llama-cpp-python's default); a quantized V
cache (q8_0) needs flash attention.

Quantized KV (q8_0): llama.cpp (since ggml-org/llama.cpp PR 21038, in the vendored copy of
llama-cpp-python 0.3.36: ``attn_rot_k`` / ``attn_rot_v`` in ``llama-kv-cache.cpp``) stores
quantized K and V rotated by an orthonormal Walsh-Hadamard matrix, per head, over blocks of
``n`` values (K: the largest power of two >= 64 dividing the head size; V: 64), when the head
size is a multiple of 64 and ``LLAMA_ATTN_ROT_DISABLE`` is not set; it rotates the queries
the same way and the attention output back. An export of unrotated rows loads (types and row
sizes match) but answers garbage, so the export rotates before quantizing.

RoPE layout: llama.cpp runs LLaMA-architecture GGUFs with "normal" RoPE, rotating adjacent
pairs (2i, 2i+1), and the HF -> GGUF conversion permutes each head's Q/K weight rows so that
GGUF row 2i+j is HF row j*D/2+i. HF (and kdnctl) keys use rotate-half pairs (i, i+D/2) with
the same frequency i, so post-RoPE keys map by the same permutation. Architectures that keep
NeoX RoPE in llama.cpp (qwen2, ...) are not permuted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ExportError, UsageError
from .base import (DocumentKV, read_document_kv, require_plain_attention, require_prefix_mode, tensor_bytes,
                   write_atomic)

SEQ_MAGIC = 0x67677371  # 'ggsq'
SEQ_VERSION = 3
GGML_F16, GGML_Q8_0 = 1, 8
KV_TYPES = {"f16": GGML_F16, "q8_0": GGML_Q8_0}
QK8_0 = 32
# GGUF architectures whose conversion permutes Q/K rows (llama.cpp "normal" RoPE) or not (NeoX).
PERMUTED_ARCHS = {"llama"}
NEOX_ARCHS = {"qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "stablelm", "gptneox", "olmo2"}


@dataclass(frozen=True)
class GGUFInfo:
    arch: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    sha256: str


def gguf_for_model(path: str | Path) -> Path:
    """The GGUF llama.cpp loads for a model: a ``.gguf`` file itself, or the GGUF a converted
    model folder was made from; a transformers folder without one is refused (llama.cpp loads
    GGUF files only)."""
    path = Path(path)
    if path.is_file():
        return path
    source = path / "kdnctl-source.json"
    if source.is_file():
        gguf = Path(json.loads(source.read_text()).get("gguf", ""))
        if gguf.is_file():
            return gguf
    raise ExportError(f"{path} is a transformers model folder; llama.cpp loads a GGUF file",
                      hint="pass --gguf FILE: the same weights converted with llama.cpp's convert_hf_to_gguf.py")


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """The model facts an export checks, read once per file state (path, size, mtime, inode):
    ``GGUFReader`` walks every metadata field, the tokenizer's ~49k strings included, which
    takes seconds, and exporting a corpus reads the same GGUF once per document."""
    st = os.stat(path)
    return _gguf_info(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=8)
def _gguf_info(path: str, size: int, mtime_ns: int, inode: int) -> GGUFInfo:
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)

    def field(name: str):
        f = reader.fields.get(name)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode("utf-8") if f.types[0] == GGUFValueType.STRING else int(value[0])

    arch = field("general.architecture")
    n_layers = field(f"{arch}.block_count")
    n_heads = field(f"{arch}.attention.head_count")
    n_kv = field(f"{arch}.attention.head_count_kv") or n_heads
    head_dim = field(f"{arch}.attention.key_length") or field(f"{arch}.embedding_length") // n_heads
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return GGUFInfo(arch, int(n_layers), int(n_kv), int(head_dim), h.hexdigest())


def gguf_key_layout(k: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` rotate-half (HF) keys -> llama.cpp's adjacent-pair layout: out[2i+j] = k[j*D/2+i]."""
    d = k.shape[-1]
    return k.reshape(*k.shape[:-1], 2, d // 2).transpose(-1, -2).reshape(k.shape)


def quantize_q8_0(rows: torch.Tensor) -> bytes:
    """ggml's reference q8_0 of ``[N, C]`` (C a multiple of 32): per block fp16 d, 32 int8."""
    n, c = rows.shape
    x = rows.float().reshape(n, c // QK8_0, QK8_0)
    amax = x.abs().amax(dim=-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    v = x * inv
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8)  # roundf: half away from zero
    block = torch.cat([d.to(torch.float16).view(torch.int8), q], dim=-1)  # [N, nb, 2+32] bytes
    return block.contiguous().numpy().tobytes()


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal ``n x n`` Walsh-Hadamard matrix (Sylvester order, symmetric, H @ H = I),
    as llama.cpp builds it for its KV rotation."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).float()


def rotation_sizes(head_dim: int, kv_type: str) -> tuple[int, int]:
    """(K, V) Hadamard block sizes llama.cpp rotates a ``kv_type`` cache with (0 = none)."""
    if kv_type == "f16" or head_dim % 64:
        return 0, 0
    nk = 64
    while head_dim % (nk * 2) == 0:
        nk *= 2
    return nk, 64


def rotate_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[H, T, D]`` -> each head's vectors times the n x n Hadamard matrix, per block of n."""
    if not n:
        return x
    h, t, d = x.shape
    return (x.float().reshape(h, t, d // n, n) @ hadamard(n)).reshape(h, t, d)


def _rows(kind: list[torch.Tensor], layer: int, permute: bool, rot: int = 0) -> torch.Tensor:
    """``[cells, H*D]`` float rows of one layer in llama.cpp's layout."""
    x = kind[layer]
    if permute:
        x = gguf_key_layout(x)
    x = rotate_heads(x, rot)
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)


def _row_pieces(rows: torch.Tensor, kv_type: str) -> tuple[int, int, list]:
    """(ggml type, row bytes, byte pieces) of ``[cells, C]`` rows."""
    if kv_type == "f16":
        return GGML_F16, rows.shape[1] * 2, [tensor_bytes(rows.to(torch.float16))]
    if rows.shape[1] % QK8_0:
        raise ExportError(f"q8_0 needs rows of a multiple of {QK8_0} values, got {rows.shape[1]}")
    return GGML_Q8_0, rows.shape[1] // QK8_0 * (2 + QK8_0), [quantize_q8_0(rows)]


def state_pieces(doc: DocumentKV, positions: torch.Tensor, kv_type: str, v_trans: bool, *,
                 permute_keys: bool, seq_id: int = 0, rotate: bool = True) -> list:
    """The sequence state (what ``llama_state_seq_get_data`` returns) as byte pieces.
    ``rotate``: apply llama.cpp's Hadamard rotation of quantized caches (see the module doc)."""
    n_cells = int(positions.numel())
    out: list = [struct.pack("<II", 1, n_cells)]
    cells = torch.stack([positions.to(torch.int32), torch.ones(n_cells, dtype=torch.int32),
                         torch.full((n_cells,), seq_id, dtype=torch.int32)], dim=1)
    out.append(cells.numpy().tobytes())
    out.append(struct.pack("<II", int(v_trans), doc.n_layers))
    rot_k, rot_v = rotation_sizes(int(doc.keys[0].shape[-1]), kv_type) if rotate else (0, 0)
    for layer in range(doc.n_layers):
        gtype, row, pieces = _row_pieces(_rows(doc.keys, layer, permute_keys, rot_k), kv_type)
        out.append(struct.pack("<iQ", gtype, row))
        out.extend(pieces)
    for layer in range(doc.n_layers):
        rows = _rows(doc.values, layer, False, rot_v)
        if not v_trans:
            gtype, row, pieces = _row_pieces(rows, kv_type)
            out.append(struct.pack("<iQ", gtype, row))
            out.extend(pieces)
        else:
            if kv_type != "f16":
                raise ExportError("a quantized V cache needs flash attention (non-transposed V)",
                                  hint="export with --flash-attn (and create the context with flash_attn=True)")
            out.append(struct.pack("<iII", GGML_F16, 2, rows.shape[1]))
            out.append(tensor_bytes(rows.t().contiguous().to(torch.float16)))
    return out


@dataclass
class LlamaCppExportResult:
    path: Path
    sidecar: Path
    info: dict
    n_bytes: int


def check_model(doc: DocumentKV, info: GGUFInfo) -> None:
    model = doc.model
    want = (model["n_layers"], model["n_kv_heads"], model["head_dim"])
    have = (info.n_layers, info.n_kv_heads, info.head_dim)
    if want != have:
        raise ExportError(f"the GGUF ({info.arch}: layers, KV heads, head dim = {have}) does not match "
                          f"the stored KV {want}", hint="pass the GGUF the document was ingested with (--gguf)")
    if info.arch not in PERMUTED_ARCHS | NEOX_ARCHS:
        raise ExportError(f"GGUF architecture {info.arch!r} has no known key layout for llama.cpp",
                          hint=f"supported: {', '.join(sorted(PERMUTED_ARCHS | NEOX_ARCHS))}")
    require_plain_attention(doc, "llama.cpp", "keeps sliding-window layers in a second KV cache with its own state")


def kept_positions(doc: DocumentKV) -> torch.Tensor:
    pos = doc.shared_positions()
    if pos is None:
        raise ExportError(
            f"{doc.doc_id} [{doc.label}] keeps different tokens per layer or KV head; a llama.cpp "
            "cache cell holds every head of every layer",
            hint="compress with --method shared (one token set for all heads and layers)",
        )
    if int(pos[-1]) != doc.n_tokens - 1:
        # llama_batch_allocr::init (llama-batch.cpp) accepts a batch after a cached sequence only
        # when it starts at the sequence's largest cached position + 1 ("Y = X + 1"): the question
        # at position n_tokens needs the cell at n_tokens - 1.
        raise ExportError(
            f"{doc.doc_id} [{doc.label}] dropped the document's last token (last kept position "
            f"{int(pos[-1])} of {doc.n_tokens}); llama.cpp decodes a new token only right after the "
            "largest cached position, so the question could not follow at its original position",
            hint="re-compress with the current --method shared (it always keeps the last token)",
        )
    return pos


def export_llamacpp(store, doc_id: str, path: str | Path, *, label: str = "full", gguf: str | Path,
                    kv_type: str = "f16", flash_attn: bool | None = None, fingerprint: str | None = None,
                    suffix_template: str | None = None, kv_rotation: bool = True) -> LlamaCppExportResult:
    """Write ``path`` (sequence state file) and ``path.json`` (what a caller needs next).

    ``kv_rotation``: for quantized KV, rotate as llama.cpp builds with ``attn_rot`` do (the
    default since PR 21038); False for older builds or ``LLAMA_ATTN_ROT_DISABLE=1``."""
    if kv_type not in KV_TYPES:
        raise UsageError(f"unknown KV type {kv_type!r}", hint="use f16 or q8_0")
    flash_attn = (kv_type != "f16") if flash_attn is None else bool(flash_attn)
    v_trans = not flash_attn
    doc = read_document_kv(store, doc_id, label, fingerprint=fingerprint)
    require_prefix_mode(doc)
    info = read_gguf_info(gguf)
    check_model(doc, info)
    positions = kept_positions(doc)
    tokens = torch.tensor(doc.token_ids, dtype=torch.int32)
    header = struct.pack("<III", SEQ_MAGIC, SEQ_VERSION, len(doc.token_ids))
    state = state_pieces(doc, positions, kv_type, v_trans, permute_keys=info.arch in PERMUTED_ARCHS,
                         rotate=kv_rotation)
    rot_k, rot_v = rotation_sizes(info.head_dim, kv_type) if kv_rotation else (0, 0)
    pieces = [header, tokens.numpy().tobytes(), *state]
    path = Path(path)
    n = write_atomic(path, pieces)
    sidecar_info = {
        "format": "kdnctl-llamacpp-seq/1",
        "doc_id": doc.doc_id, "label": doc.label, "doc_version": doc.doc_version,
        "gguf_sha256": info.sha256, "arch": info.arch,
        "kv_type": kv_type, "flash_attn": flash_attn, "seq_id": 0,
        "kv_rotation": {"k": rot_k, "v": rot_v},
        "n_past": doc.n_tokens, "n_cells": int(positions.numel()), "pruned": doc.pruned,
        "suffix_template": suffix_template,
        "load": "llama_state_seq_load_file(ctx, path, 0, tokens, n_past, &n); then decode the "
                "suffix at positions n_past, n_past+1, ...",
    }
    sidecar = path.with_name(path.name + ".json")
    write_atomic(sidecar, [json.dumps(sidecar_info, indent=2).encode("utf-8")])
    return LlamaCppExportResult(path, sidecar, sidecar_info, n)
