"""SIGKILL during a real `kdnctl compress` (real SmolLM2 bundles, int8 quantization needs no
model load): after every kill the store verifies clean, the source version is intact, and a
rerun finishes with the same objects as an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest
from conftest import EXAMPLES, cli_json, kdnctl_argv, kdnctl_env, run_cli

from kdnctl.ingest.corpus import read_corpus
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.store import Store

pytestmark = pytest.mark.model
KILLS = int(os.environ.get("ATTACK_COMPRESS_KILLS", "3"))


def test_sigkill_during_compress(tmp_path, lm):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in sorted(EXAMPLES.iterdir())[:3]:
        (corpus / (path.stem + ".txt")).write_text(path.read_text()[:1500])
    root = tmp_path / "kdn"
    docs, _ = read_corpus([corpus])
    with Store(root) as st:
        ingest_documents(st, lm, docs, IngestOptions(chunk_tokens=64, stats=False))
        source = {v.doc_id: v.chunks for v in st.list_versions()}
    cmd = kdnctl_argv("compress", "--budget", "1", "--quant", "int8", "--label", "q8", "--store", root)
    sde = {"SOURCE_DATE_EPOCH": "1700000000"}  # equal bundles -> equal bytes -> equal object names
    rng = random.Random(3)
    for _ in range(KILLS):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=kdnctl_env(sde))
        time.sleep(rng.uniform(1.0, 6.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        assert run_cli("verify", store=root).returncode == 0
        with Store(root, create=False) as st:
            assert {v.doc_id: v.chunks for v in st.list_versions() if v.label == "full"} == source
    out = cli_json("compress", "--budget", "1", "--quant", "int8", "--label", "q8", store=root, env=sde)
    assert {r["status"] for r in out["results"]} <= {"compressed", "unchanged"}
    clean = tmp_path / "clean"
    with Store(clean) as st:
        ingest_documents(st, lm, docs, IngestOptions(chunk_tokens=64, stats=False))
    cli_json("compress", "--budget", "1", "--quant", "int8", "--label", "q8", store=clean, env=sde)
    with Store(root, create=False) as a, Store(clean, create=False) as b:
        objs = lambda s: sorted(c.object for v in s.list_versions() if v.label == "q8" for c in v.chunks)  # noqa: E731
        assert objs(a) == objs(b)
    assert run_cli("gc", "--grace", "0", store=root).returncode == 0
    assert run_cli("verify", store=root).returncode == 0
