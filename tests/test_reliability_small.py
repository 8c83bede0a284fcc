"""Issue 10 item 10: small validation holes, each refused before any work is done."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
from conftest import run_cli
from storekit import add_doc, bundle_bytes

from kdnctl.format.bundle import decode_bundle, header_size
from kdnctl.errors import BundleFormatError
from kdnctl.store import Store


@pytest.fixture
def small_store(tmp_path):
    root = tmp_path / "kdn"
    with Store(root) as st:
        add_doc(st, "doc-a", b"some text", (b"a0", b"a1", b"a2"))
    return root


def _objects(root):
    return sorted(p.name for p in (root / "objects").rglob("*") if p.is_file())


def test_long_label_is_refused_before_any_object_is_written(small_store):
    before = _objects(small_store)
    for cmd in (["compress", "doc-a", "--budget", "0.5", "--label", "x" * 100],
                ["compress", "doc-a", "--budget", "0.5", "--label", "bad\x01\x00label"[:3] + "x" * 70]):
        proc = run_cli(*cmd, store=small_store)
        assert proc.returncode == 2 and "--label" in proc.stderr, proc.stderr
    # a recipe whose own spelled-out name passes the limit: the hint says to name it
    proc = run_cli("compress", "doc-a", "--budget", "0.083", "--option", "layers=even", store=small_store)
    assert proc.returncode == 2 and "name the version with --label NAME" in proc.stderr, proc.stderr
    assert _objects(small_store) == before


def test_max_new_tokens_must_be_positive(small_store):
    proc = run_cli("ask", "doc-a", "q?", "--max-new-tokens", "-5", store=small_store)
    assert proc.returncode == 2 and "--max-new-tokens" in proc.stderr


def test_bad_jsonl_ids_are_refused_before_the_model_loads(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text(json.dumps({"id": "ok", "text": "fine"}) + "\n" + json.dumps({"id": "a" * 300, "text": "long"}) + "\n")
    proc = run_cli("ingest", f, store=tmp_path / "kdn", env={"KDN_MODEL_DIR": "/nonexistent"})
    assert proc.returncode == 2 and "200 bytes" in proc.stderr, proc.stderr
    assert "loading model" not in proc.stderr


def test_bundle_header_nesting_and_huge_version_are_bundle_format_errors():
    good = bundle_bytes(b"x", doc_id="d", doc_version="v", index=0, start=0, end=2, chain_hash="a" * 64)
    n = header_size(good)
    header = json.loads(good[8:n])
    for meta_text in ('{"format_version": "1' + "0" * 5000 + '.0"}', "[" * 100000 + "]" * 100000,
                      '{"format_version": ' + "9" * 5000 + "}"):
        h = dict(header, __metadata__=dict(header["__metadata__"], kdnctl=meta_text))
        text = json.dumps(h).encode()
        text += b" " * (-len(text) % 8)
        with pytest.raises(BundleFormatError):
            decode_bundle(struct.pack("<Q", len(text)) + text + good[n:])
    deep = b"[" * 100000 + b"]" * 100000
    deep += b" " * (-len(deep) % 8)
    with pytest.raises(BundleFormatError):
        decode_bundle(struct.pack("<Q", len(deep)) + deep)


def test_temp_files_of_a_killed_writer_are_reported_and_collected_at_once(small_store):
    # a writer that died: its pid is gone (a child that already exited)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    dead = small_store / "tmp" / f"{'a' * 16}.{socket.gethostname()[:32]}.{child.stdout.strip()}.deadbeef.tmp"
    dead.write_bytes(b"\0" * 6_000_000)
    live = small_store / "tmp" / f"{'b' * 16}.{socket.gethostname()[:32]}.{os.getpid()}.cafebabe.tmp"
    live.write_bytes(b"live")
    proc = run_cli("verify", store=small_store)
    assert proc.returncode == 0 and "2 temp file(s)" in proc.stderr and "1 left by a writer that is gone" in proc.stderr
    proc = run_cli("gc", "--json", store=small_store)
    assert proc.returncode == 0 and json.loads(proc.stdout)["tmp_removed"] == 1
    assert not dead.exists() and live.exists()


def test_gc_grace_option(small_store):
    assert run_cli("gc", "--grace", "soon", store=small_store).returncode == 2
    report = json.loads(run_cli("gc", "--grace", "30s", "--json", store=small_store).stdout)
    assert report["grace_s"] == 30.0
