"""`kdnctl export lmcache`, proven with LMCache's own code: its ChunkedTokenDatabase finds every
exported chunk for the document's tokens (plus a question), its LocalCPUBackend + FSConnector
read each file, and the tensors equal kdnctl's stored K/V bit for bit after the dtype cast.

Hash settings: with vLLM importable LMCache hashes with vLLM's sha256_cbor and NONE_HASH =
sha256_cbor(PYTHONHASHSEED); without it, Python's hash and 0. The 'builtin' case runs LMCache
exactly as installed here (no vLLM). The 'sha256_cbor' case runs LMCache's chunking, chaining,
folding and key code with vLLM's hash installed (vLLM's own function when importable, else the
same one-line definition over cbor2, the library vLLM calls) - see docs/engines.md.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import EXAMPLES, run_cli

from kdnctl.export.base import add_engine_path  # noqa: E402 (scripts/install.sh --engines: LMCache in its own directory)

add_engine_path("lmcache")
pytest.importorskip("lmcache", reason="LMCache is not installed (pip install 'kdnctl[lmcache]'; CI installs it)")

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.ingest.corpus import read_corpus  # noqa: E402
from kdnctl.errors import ExportError  # noqa: E402
from kdnctl.export import EXPORTERS  # noqa: E402
from kdnctl.export.base import read_document_kv  # noqa: E402
from kdnctl.export.lmcache import (  # noqa: E402
    HashSettings, cbor_encode, chunk_hashes, export_lmcache, sha256_cbor,
)
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.store import Store  # noqa: E402

pytestmark = pytest.mark.model
DOC = "faq.md"
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def store(tmp_path_factory, lm):
    docs_dir = tmp_path_factory.mktemp("docs")
    (docs_dir / DOC).write_text((EXAMPLES / DOC).read_text())
    docs, _ = read_corpus([docs_dir])
    st = Store(tmp_path_factory.mktemp("store"))
    # kdnctl chunks of 128 tokens: the export re-cuts them into LMCache's 256-token chunks
    ingest_documents(st, lm, docs, IngestOptions(chunk_tokens=128))
    with st.writer():
        compress_document(st, DOC, CompressRecipe(budget=None, keep=1.0, quant="int8"), lm=lm)
        compress_document(st, DOC, CompressRecipe(budget=None, keep=0.5, method="streaming", scorer="window"), lm=lm)
    yield st
    st.close()


def lmcache_db(man, monkeypatch):
    """LMCache's own objects for the manifest's settings (CPU)."""
    import asyncio

    from lmcache.v1 import token_database as tdb
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE

    monkeypatch.setenv("PYTHONHASHSEED", man["python_hash_seed"])
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=True, max_local_cpu_size=0.25,
                                            save_unfull_chunk=False, remote_url=None,
                                            pre_caching_hash_algorithm=man["hash_algorithm"])
    meta = LMCacheMetadata(model_name=man["model_name"], world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=STR_DTYPE_TO_TORCH_DTYPE[man["dtype"]],
                           kv_shape=(30, 2, 256, 3, 64))
    db = tdb.ChunkedTokenDatabase(cfg, meta)
    try:
        import vllm  # noqa: F401
        has_vllm = True
    except ImportError:
        has_vllm = False
    if man["hash_algorithm"] == "sha256_cbor" and not has_vllm:
        from kdnctl.export.lmcache_engine import vllm_sha256_cbor

        fn = vllm_sha256_cbor()
        db.hash_func = fn
        monkeypatch.setattr(tdb, "NONE_HASH", tdb._normalize_hash_to_int(fn(man["python_hash_seed"])))
    if man["hash_algorithm"] == "builtin":
        assert db.hash_func is hash and tdb.NONE_HASH == 0  # LMCache's own fallback, untouched
    loop = asyncio.new_event_loop()
    return db, LocalCPUBackend(cfg, meta), cfg, loop


def expected_chunk(doc, start, end, dtype):
    ks = [k[:, start:end].permute(1, 0, 2).reshape(end - start, -1) for k in doc.keys]
    vs = [v[:, start:end].permute(1, 0, 2).reshape(end - start, -1) for v in doc.values]
    return torch.stack([torch.stack(ks), torch.stack(vs)]).to(dtype)


@pytest.mark.parametrize("algorithm,dtype,label", [
    ("builtin", "fp16", "full"), ("sha256_cbor", "fp16", "full"),
    ("sha256_cbor", "bf16", "full"), ("sha256_cbor", "fp16", "k1-int8"),
])
def test_lmcache_finds_and_reads_every_chunk_bit_exact(store, lm, tmp_path, monkeypatch, algorithm, dtype, label):
    from lmcache.v1.storage_backend.connector.fs_connector import FSConnector

    out = tmp_path / "lmc"
    res = export_lmcache(store, [DOC], out, label=label, model_name=MODEL_NAME, dtype=dtype,
                         hash_settings=HashSettings(algorithm, "0"))
    man = json.loads((out / "manifest.json").read_text())
    assert man == res.manifest and man["none_hash"] == HashSettings(algorithm, "0").initial()
    entry = man["documents"][0]
    doc = read_document_kv(store, DOC, label)
    assert len(entry["chunks"]) == doc.n_tokens // 256 >= 2
    db, backend, cfg, loop = lmcache_db(man, monkeypatch)
    conn = FSConnector(loop, backend, cfg, base_paths_str=str(out))
    question = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, "What is the warranty?")
    hits = list(db.process_tokens(doc.token_ids + question))
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    for chunk, (start, end, key) in zip(entry["chunks"], hits):
        assert key.to_string() == chunk["key"] and (start, end) == (chunk["token_start"], chunk["token_end"])
        assert conn.exists_sync(key)
        obj = loop.run_until_complete(conn.get(key))
        want = expected_chunk(doc, start, end, torch_dtype)
        assert obj.tensor.dtype == torch_dtype and torch.equal(obj.tensor, want), chunk["key"]
    loop.close()


def test_keys_follow_the_document_tokens(store):
    doc = read_document_kv(store, DOC)
    settings = HashSettings("sha256_cbor", "0")
    base = chunk_hashes(doc.token_ids, 256, settings)
    changed = list(doc.token_ids)
    changed[300] += 1  # a token in chunk 1: chunk 0 keeps its key, every later one changes
    other = chunk_hashes(changed, 256, settings)
    assert base[0] == other[0] and all(a != b for a, b in zip(base[1:], other[1:]))
    assert chunk_hashes(doc.token_ids, 256, HashSettings("sha256_cbor", "1"))[0] != base[0]


def test_cbor_and_sha256_cbor_match_cbor2():
    cbor2 = pytest.importorskip("cbor2", reason="cbor2 comes with kdnctl[lmcache]")
    rng = random.Random(0)
    samples = ["0", "12345", "", "ü", (0, (), ()), (2**64 - 1, (1, 2, 3), ()), (-5, (2**32,), ()),
               [2**64, -(2**64) - 1, -(2**64), 23, 24, 255, 256, 65535, 65536, 2**32 - 1]]
    samples += [(rng.getrandbits(64), tuple(rng.randrange(0, 50000) for _ in range(rng.randrange(0, 300))), ())
                for _ in range(50)]
    for obj in samples:
        assert cbor_encode(obj) == cbor2.dumps(obj, canonical=True), obj
    from kdnctl.export.lmcache_engine import vllm_sha256_cbor

    assert sha256_cbor((7, (1, 2), ())) == vllm_sha256_cbor()((7, (1, 2), ()))


def test_refuses_pruned_version_and_other_chunk_sizes(store, tmp_path):
    with pytest.raises(ExportError, match="pruned"):
        export_lmcache(store, [DOC], tmp_path / "a", label="streaming-k0.5-window", model_name=MODEL_NAME)
    with pytest.raises(ExportError, match="chunk size 128"):
        export_lmcache(store, [DOC], tmp_path / "b", model_name=MODEL_NAME, chunk_size=128)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert set(EXPORTERS) == {"lmcache", "llama-cpp"}


def test_cli_export_check_and_errors(store, tmp_path):
    out = tmp_path / "cli"
    proc = run_cli("export", "lmcache", "--to", out, "--check", DOC, store=store.root)
    assert proc.returncode == 0, proc.stderr
    man = json.loads((out / "manifest.json").read_text())
    n = len(man["documents"][0]["chunks"])
    assert f"LMCache found and read back {n} chunks" in proc.stderr
    assert man["hash_algorithm"] == "sha256_cbor" and man["python_hash_seed"] == "0"
    bad = run_cli("export", "lmcache", "--to", tmp_path / "x", "--version", "streaming-k0.5-window", DOC,
                  store=store.root)
    assert bad.returncode == 13 and "pruned" in bad.stderr and "hint:" in bad.stderr
    bad = run_cli("export", "lmcache", "--to", tmp_path / "y", "--chunk-size", "512", DOC, store=store.root)
    assert bad.returncode == 13 and "chunk size 512" in bad.stderr
