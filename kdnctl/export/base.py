"""Plumbing every engine export shares: read one stored document version as whole-document
K/V through the public store and bundle API, check what an engine format can hold, write
files atomically, and say how to install a missing engine package.

A target format lives in its own module (``lmcache.py``, ``llamacpp.py``) and is registered
by name in :mod:`kdnctl.export`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..format.bundle import KVBundle, decode_bundle
from ..store.durable import fsync_dir, write_atomic  # noqa: F401  (exports write through it)
from ..errors import EngineMissingError, ExportError
from ..quant import layer_kv


@dataclass
class DocumentKV:
    """One stored document version, chunks concatenated in order.

    ``keys`` / ``values``: per layer ``[H_kv, T_l, D]`` (keys post-RoPE, HF layout), in the
    bundles' dtype (quantized bundles dequantized). ``positions``: per layer ``[H_kv, T_l]``
    original positions. ``token_ids``: the full original context (also for pruned versions);
    ``n_tokens`` is therefore the first position of anything that follows.
    """

    doc_id: str
    label: str
    doc_version: str
    fingerprint: str
    mode: str
    token_ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    model: dict
    chunk_tokens: list[int]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def pruned(self) -> bool:
        return any(k.shape[1] != self.n_tokens for k in self.keys)

    def shared_positions(self) -> torch.Tensor | None:
        """The kept positions when every layer and every KV head keeps the same tokens, else
        None (an engine whose cache cells span all heads and layers needs that)."""
        first = self.positions[0][0]
        for pos in self.positions:
            if pos.shape[1] != first.shape[0] or not bool((pos == first.unsqueeze(0)).all()):
                return None
        return first


def read_document_kv(store, doc_id: str, label: str = "full", doc_version: str | None = None,
                     *, fingerprint: str | None = None) -> DocumentKV:
    """Load a stored version (local store or remote client: any ReadStore) as DocumentKV.

    ``fingerprint``: when given, every bundle must have been made with that model."""
    version = store.get_version(doc_id, label, doc_version)
    bundles: list[KVBundle] = [
        decode_bundle(store.read_object(ref.object), expect_fingerprint=fingerprint) for ref in version.chunks
    ]
    if not bundles:
        raise ExportError(f"{doc_id} [{label}] has no chunks")
    from kdnctl.quant.store_basis import basis_shas, provide_store_bases

    provide_store_bases(store, basis_shas(b.meta for b in bundles))  # a key basis the store holds
    n_layers = bundles[0].n_layers
    biased = [i for i in range(n_layers) if any(b.layer_bias(i) is not None for b in bundles)]
    if biased:  # an engine's cache holds keys and values only: dropping the bias would change the answers
        raise ExportError(
            f"{doc_id} [{label}] adds an attention bias in {len(biased)} layer(s) (a steering edit, or "
            "KV heads masked off evicted tokens by option backfill=L.H), which an engine's KV cache cannot hold",
            hint="export the version it was made from, or load it with kdnctl (transformers)",
        )
    keys, values, positions = [], [], []
    for layer in range(n_layers):
        ks, vs, ps = [], [], []
        for b in bundles:
            k, v = layer_kv(b, layer)
            ks.append(k)
            vs.append(v)
            ps.append(b.layer_positions(layer))
        keys.append(torch.cat(ks, dim=1))
        values.append(torch.cat(vs, dim=1))
        positions.append(torch.cat(ps, dim=1))
    token_ids = [int(t) for b in bundles for t in b.token_ids.tolist()]
    return DocumentKV(
        doc_id=doc_id, label=label, doc_version=version.doc_version, fingerprint=version.fingerprint,
        mode=getattr(version, "mode", "prefix"), token_ids=token_ids, keys=keys, values=values,
        positions=positions, model=dict(bundles[0].meta["model"]),
        chunk_tokens=[b.n_tokens for b in bundles],
    )


def require_prefix_mode(doc: DocumentKV) -> None:
    """Independent-mode chunks were prefilled without their predecessors: not a prefix KV."""
    if doc.mode != "prefix":
        raise ExportError(
            f"{doc.doc_id} [{doc.label}] was ingested in {doc.mode!r} mode; an engine prefix cache "
            "needs KV computed over the whole document",
            hint="re-ingest the document in the default prefix mode",
        )


def require_plain_attention(doc: DocumentKV, engine: str, why: str) -> None:
    """Refuse a model whose layers use a sliding window: ``engine`` keeps those layers' KV apart
    (``why``), in a layout this export does not write."""
    attention = doc.model.get("attention") or []
    sliding = [i for i, a in enumerate(attention) if a.get("kind") == "sliding"]
    if sliding:
        arch = doc.model.get("arch", "this model")
        raise ExportError(f"{arch} has {len(sliding)} sliding-window layer(s) (window {attention[sliding[0]]['window']}); "
                          f"{engine} {why}, which this export does not write",
                          hint="load the version with kdnctl (transformers), which holds every layer whole")


# Engines whose pinned dependencies cannot share kdnctl's environment live in a directory of their
# own (scripts/install.sh --engines puts LMCache there): module -> (environment variable, default).
ENGINE_DIRS = {"lmcache": ("KDNCTL_LMCACHE_PATH", "~/.cache/kdnctl/engines/lmcache-0.5.6")}


def add_engine_path(module: str) -> bool:
    """Make ``module`` importable from its own directory (``ENGINE_DIRS``) when it is not
    importable otherwise; the directory goes to the end of ``sys.path``, so every package of
    kdnctl's environment keeps its version. True when ``module`` is importable after."""
    import sys

    if importlib.util.find_spec(module) is not None:
        return True
    if module not in ENGINE_DIRS:
        return False
    var, default = ENGINE_DIRS[module]
    where = Path(os.environ.get(var) or default).expanduser()
    if (where / module).is_dir() and str(where) not in sys.path:
        sys.path.append(str(where))
        importlib.invalidate_caches()
    return importlib.util.find_spec(module) is not None


def require_engine(module: str, extra: str, what: str) -> None:
    """Raise EngineMissingError with the install command when ``module`` is not importable."""
    if not add_engine_path(module):
        raise EngineMissingError(
            f"{what} needs the Python package '{module}', which is not installed",
            hint="bash scripts/install.sh --engines, or pip install 'kdnctl[" + extra + "]' (see docs/engines.md)",
        )


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw row-major bytes of a CPU tensor, without a copy when already contiguous."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
