"""End-to-end checks of the foundation with the real SmolLM2 model: stored KV reproduces a full
prefill, prefix lookup works, ingest is resumable after SIGKILL, bad input never corrupts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from conftest import (EXAMPLES, REPO, SOURCE_DIGEST_AT_START, cli_json, kdnctl_argv, kdnctl_env, kdnctl_source_digest,
                      run_cli)

from kdnctl.ingest.corpus import read_corpus
from kdnctl.engine.hf import forward_suffix, full_prefill_generate, generate, load_document, load_prefix
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.ingest.prompting import PromptFormat
from kdnctl.store import Store

pytestmark = pytest.mark.model
DOC = "zephyr-x200-manual.md"


@pytest.fixture(scope="module")
def manual_store(tmp_path_factory, lm):
    """The example manual cut to ~1000 tokens (4+ chunks), ingested once."""
    root = tmp_path_factory.mktemp("store")
    text = (EXAMPLES / DOC).read_text()
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids[:1000]
    docs_dir = tmp_path_factory.mktemp("docs")
    (docs_dir / DOC).write_text(lm.tokenizer.decode(ids))
    docs, _ = read_corpus([docs_dir])
    store = Store(root)
    report = ingest_documents(store, lm, docs, IngestOptions(chunk_tokens=256))
    assert report.ingested == [DOC]
    yield store, docs[0]
    store.close()


def test_loaded_bundles_reproduce_full_prefill(lm, manual_store):
    store, doc = manual_store
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    suffix = fmt.question_ids(lm.tokenizer, "How long does it take to charge the battery to 80 %?")
    ctx = load_document(lm, store, DOC)
    assert len(store.get_version(DOC).chunks) >= 4
    assert ctx.n_tokens == ctx.keys[0].shape[2] and ctx.n_tokens > 900
    cached_logits, _ = forward_suffix(lm, ctx, suffix)
    full_logits, _ = forward_suffix(lm, None, ctx.token_ids + suffix)
    diff = (cached_logits[-1] - full_logits[-1]).abs().max().item()
    assert diff <= 1e-4, diff
    cached = generate(lm, ctx, suffix, max_new_tokens=24)
    full = full_prefill_generate(lm, ctx.token_ids, suffix, max_new_tokens=24)
    assert cached.answer == full.answer and cached.answer


def test_longest_prefix_lookup(lm, manual_store):
    store, doc = manual_store
    full_ids, _ = PromptFormat.for_tokenizer(lm.tokenizer).document_ids(lm.tokenizer, doc.text)
    # A longer sequence that shares the document as prefix, then diverges.
    query = full_ids + lm.tokenizer(" Extra text that was never stored.", add_special_tokens=False).input_ids
    ctx, matched = load_prefix(lm, store, query)
    assert ctx is not None
    n_chunks = len(store.get_version(DOC).chunks)
    # All full chunks match; the stored final partial chunk matches too since its tokens are a prefix
    # only if the query continues exactly at a chunk boundary, so expect at least the full chunks.
    assert matched >= (len(full_ids) // 256) * 256 and matched % 256 == 0 or matched == len(full_ids)
    rest = query[matched:]
    cached_logits, _ = forward_suffix(lm, ctx, rest)
    full_logits, _ = forward_suffix(lm, None, query)
    assert (cached_logits[-1] - full_logits[-1]).abs().max().item() <= 1e-4
    # A sequence that diverges inside chunk 2 matches exactly 2 chunks.
    broken = list(full_ids)
    broken[256 * 2 + 5] = (broken[256 * 2 + 5] + 1) % 1000
    ctx2, matched2 = load_prefix(lm, store, broken)
    assert matched2 == 512 and n_chunks >= 4


def test_ingest_cli_ask_and_unchanged(tmp_path):
    store = tmp_path / "s"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The secret launch code of project Heron is VX-4471. " * 20)
    out = cli_json("ingest", docs, store=store)
    assert out["ingested"] == ["a.txt"] and out["stats_fraction"] < 0.02
    again = cli_json("ingest", docs, store=store)
    assert again["ingested"] == [] and again["unchanged"] == ["a.txt"]
    listing = cli_json("ls", store=store)
    assert [d["id"] for d in listing["documents"]] == ["a.txt"]
    ans = cli_json("ask", "a.txt", "What is the launch code of project Heron?", "--compare", store=store)
    assert set(ans) >= {"answer", "ttft_s", "context_tokens", "full"}
    assert ans["answer"] == ans["full"]["answer"]
    assert "VX-4471" in ans["answer"]
    # A changed document becomes a new version; the old one stays until gc.
    (docs / "a.txt").write_text("The secret launch code of project Heron is QM-1234. " * 20)
    cli_json("ingest", docs, store=store)
    shown = cli_json("show", "a.txt", store=store)
    assert len(shown["history"]) == 2
    gc = cli_json("gc", "--grace", "0", store=store)  # the old version is not in use: no grace needed
    assert gc and cli_json("show", "a.txt", store=store)["history"] == [shown["doc_version"]]
    assert run_cli("verify", store=store).returncode == 0


def _catalog(root):
    with Store(root, create=False) as st:
        return st.catalog_dump()


def test_sigkill_mid_ingest_is_resumable(tmp_path):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in sorted(EXAMPLES.iterdir()):  # shortened copies keep the test quick
        (corpus / (path.stem + ".txt")).write_text(path.read_text()[:1200])
    # Bundles carry their creation time; a fixed SOURCE_DATE_EPOCH makes ingest reproducible to
    # the byte, so the resumed store must equal a clean one exactly, object hashes included.
    sde = {"SOURCE_DATE_EPOCH": "1700000000"}
    # The killed run must be the same code as the in-process runs it is compared with (kdnctl_env,
    # kdnctl_argv): a child importing another checkout writes other bundle bytes under the same
    # document version, which resume then keeps as unchanged.
    env = kdnctl_env(dict(KDN_STORE=str(killed), **sde))
    proc = subprocess.Popen(kdnctl_argv("ingest", corpus), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Kill once the first document is committed but before the corpus is done.
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (killed / "catalog" / "data.mdb").exists():
            try:
                with Store(killed, create=False) as st:
                    if len(st.list_documents()) >= 1:
                        break
            except Exception:
                pass
        time.sleep(0.2)
    assert proc.poll() is None, "ingest finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = _catalog(killed)
    resumed = cli_json("ingest", corpus, store=killed, env=sde)
    assert resumed["unchanged"] and resumed["ingested"]  # committed docs were not redone
    assert run_cli("verify", store=killed).returncode == 0
    run_cli("ingest", corpus, store=clean, check=True, env=sde)
    assert kdnctl_source_digest() == SOURCE_DIGEST_AT_START, "kdnctl's source changed during the run: rerun"
    assert _catalog(killed) == _catalog(clean)
    assert partial != _catalog(clean)


def _snapshot(root):
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "tmp" not in p.parts)
    return files, _catalog(root)


@pytest.fixture()
def small_store(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ok.md").write_text("# Note\nThe depot opens at 06:40 on weekdays.\n")
    store = tmp_path / "s"
    run_cli("ingest", docs, store=store, check=True)
    return store, docs


@pytest.mark.parametrize("case", ["missing", "empty", "binary", "latin1"])
def test_bad_inputs_clear_error_and_unchanged_store(small_store, tmp_path, case):
    store, _ = small_store
    before = _snapshot(store)
    bad = tmp_path / "bad"
    bad.mkdir()
    if case == "missing":
        target = tmp_path / "nope"
    else:
        target = bad / "x.txt"
        target.write_bytes({"empty": b"", "binary": b"\x00\x01\x02ELF\x00" * 50, "latin1": b"caf\xe9 cr\xe8me"}[case])
    proc = run_cli("ingest", target, store=store, own_process=case == "missing")  # one through the real process
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.strip().splitlines() if l]
    assert lines and all(len(l) < 300 for l in lines)
    assert any(w in proc.stderr for w in ("does not exist", "empty", "binary", "UTF-8"))
    assert "Traceback" not in proc.stderr
    assert _snapshot(store) == before


def test_bundle_from_other_model_refused(small_store, tiny_model_dir, tiny_lm):
    store, docs = small_store
    other = store.parent / "other"
    run_cli("ingest", docs, "--model", tiny_model_dir, store=other, check=True)
    before = _snapshot(other)
    # the exit code as a shell sees it: through a real process
    proc = run_cli("ask", "ok.md", "When does the depot open?", store=other, own_process=True)
    assert proc.returncode == 5, proc.stderr
    assert "made with model" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert _snapshot(other) == before


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_object_detected(small_store, damage):
    store, _ = small_store
    with Store(store, create=False) as st:
        ref = st.get_version("ok.md").chunks[0]
        path = st.object_path(ref.object)
    data = bytearray(path.read_bytes())
    os.chmod(path, 0o644)
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    catalog_before = _catalog(store)
    verify = run_cli("verify", store=store)
    assert verify.returncode == 1 and ref.object[:12] in verify.stderr
    ask = run_cli("ask", "ok.md", "When does the depot open?", store=store)
    assert ask.returncode == 6 and len(ask.stderr.strip().splitlines()) == 1
    assert "Traceback" not in ask.stderr
    assert _catalog(store) == catalog_before
