"""Read an LMCache export back with LMCache's own objects (ChunkedTokenDatabase, LocalCPUBackend,
FSConnector) on CPU. Used by ``kdnctl export lmcache --check`` and the tests.

LMCache takes its hash function and NONE_HASH from vLLM when vLLM is importable. Where it is
not (CPU machines: vLLM's wheels are CUDA builds pinned to their own torch), a manifest made
for ``sha256_cbor`` is read by installing on LMCache's token database the function vLLM's
``get_hash_fn_by_name("sha256_cbor")`` returns (``sha256(cbor2.dumps(x, canonical=True))``,
via cbor2, the library vLLM calls) and the ``NONE_HASH`` vLLM's ``init_none_hash`` computes
(``hash_fn(PYTHONHASHSEED)``), folded by LMCache's own ``_normalize_hash_to_int``. Chunking,
chaining, key formatting, file naming and payload parsing all stay LMCache's code.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
from pathlib import Path

import torch


def vllm_sha256_cbor():
    """vLLM's own sha256_cbor when vLLM is importable, else the same definition over cbor2."""
    try:
        from vllm.utils.hashing import sha256_cbor  # type: ignore

        return sha256_cbor
    except ImportError:
        import cbor2

        def sha256_cbor(obj):
            return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

        return sha256_cbor


class LMCacheReader:
    """LMCache's lookup + read path over an export directory described by its manifest."""

    def __init__(self, directory: str | Path, manifest: dict, *, worker_id: int = 0):
        self.directory = Path(directory)
        self.manifest = manifest
        self.worker_id = worker_id

    def __enter__(self) -> "LMCacheReader":
        from lmcache.v1 import token_database as tdb
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector.fs_connector import FSConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE

        man = self.manifest
        shape = self._payload_shape()
        dtype = STR_DTYPE_TO_TORCH_DTYPE[man["dtype"]]
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=man["chunk_size"], local_cpu=True, max_local_cpu_size=0.25, save_unfull_chunk=False,
            remote_url=None, pre_caching_hash_algorithm=man["hash_algorithm"])
        self.metadata = LMCacheMetadata(
            model_name=man["model_name"], world_size=man["world_size"], local_world_size=man["world_size"],
            worker_id=self.worker_id, local_worker_id=self.worker_id, kv_dtype=dtype,
            kv_shape=(shape[1], 2, man["chunk_size"], 1, shape[3]))
        seed = str(man["python_hash_seed"])
        old = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = seed  # what vLLM's init_none_hash reads, when present
        try:
            self.db = tdb.ChunkedTokenDatabase(self.config, self.metadata)
        finally:
            if old is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = old
        if man["hash_algorithm"] == "sha256_cbor" and importlib.util.find_spec("vllm") is None:
            fn = vllm_sha256_cbor()
            self.db.hash_func = fn
            tdb.NONE_HASH = tdb._normalize_hash_to_int(fn(seed))
        self.loop = asyncio.new_event_loop()
        self.backend = LocalCPUBackend(self.config, self.metadata)
        self.connector = FSConnector(self.loop, self.backend, self.config, base_paths_str=str(self.directory))
        return self

    def _payload_shape(self) -> list[int]:
        import json
        import struct

        for entry in self.manifest["documents"]:
            for chunk in entry["chunks"]:
                name = chunk["key"].replace("/", "-SEP-") + ".data"
                with open(self.directory / name, "rb") as f:
                    head = struct.unpack("<7i", f.read(28))
                return list(head[3:7])
        raise ValueError(f"no chunk in {json.dumps(self.manifest)[:200]}")

    def lookup(self, token_ids: list[int]) -> list[tuple[str, torch.Tensor]]:
        """The stored prefix LMCache finds for ``token_ids``: (key, tensor) per chunk, in order."""
        out = []
        for _start, _end, key in self.db.process_tokens(list(token_ids)):
            if not self.connector.exists_sync(key):
                break
            obj = self.loop.run_until_complete(self.connector.get(key))
            if obj is None:
                break
            out.append((key.to_string(), obj.tensor.clone()))
            obj.ref_count_down()
        return out

    def __exit__(self, *exc) -> None:
        try:
            self.loop.run_until_complete(self.connector.close())
        finally:
            self.loop.close()
