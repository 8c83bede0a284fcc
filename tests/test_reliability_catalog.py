"""Issue 10 items 1-3 and 10: a damaged catalog is never taken for an empty store.

Every command on a store whose catalog is emptied, truncated, deleted or bit-flipped exits
non-zero with one line that names the damage and the recovery path, and writes or deletes
nothing (the store's bytes are compared before and after). Commands run in their own process:
a truncated LMDB file used to kill the process with SIGBUS, which only another process can
show. Most run in a forked child of the test process (own address space, no interpreter start);
one damage kind runs every command as `python -m kdnctl.cli.app`."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
from storekit import FP, add_doc

from kdnctl.errors import StoreCorruptError, UnsupportedError, UsageError
from kdnctl.store import Store

N_DOCS = 6
# The commands run in their own process (see above): the process boundary is the point here.
run_cli = functools.partial(conftest.run_cli, own_process="fork")
SUBPROCESS_DAMAGE = "truncated_half"  # the SIGBUS case, through the real entry point


def _snapshot(root: Path) -> dict[str, str]:
    """Hash of every file (lock files excluded: LMDB's reader table is not data)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in ("lock.mdb", "write.lock"):
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def store_root(tmp_path):
    root = tmp_path / "kdn"
    with Store(root) as st:
        for i in range(N_DOCS):
            add_doc(st, f"doc-{i}", f"text {i}".encode(), (f"a{i}".encode(), f"b{i}".encode()))
    return root


def _commands(root: Path, tmp_path: Path) -> list[list[str]]:
    doc = tmp_path / "new.txt"
    doc.write_text("a new document")
    return [["ls"], ["show", "doc-0"], ["verify"], ["gc"], ["gc", "--grace", "0"], ["serve-files", "--port", "0"],
            ["ingest", str(doc)], ["compress", "doc-0", "--budget", "0.5"], ["ask", "doc-0", "what?"],
            ["pull", "http://127.0.0.1:9/"]]


def _assert_refused(proc, *words):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert 0 < proc.returncode < 128, (proc.returncode, proc.stderr)  # < 0: killed by a signal
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "damaged" in lines[0] and "hint:" in lines[0] and "restore STORE/catalog/ from a backup" in lines[0] and "rebuild-catalog" in lines[0], lines[0]
    for w in words:
        assert w in lines[0], lines[0]


DAMAGE = {
    "zero_bytes": lambda p: p.write_bytes(b""),
    "truncated_8192": lambda p: os.truncate(p, 8192),
    "truncated_half": lambda p: os.truncate(p, p.stat().st_size // 2),
    "deleted": lambda p: p.unlink(),
    "garbage_meta": lambda p: p.write_bytes(b"\xff" * 64 + p.read_bytes()[64:]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_catalog_every_command_refuses_and_writes_nothing(store_root, tmp_path, damage):
    data = store_root / "catalog" / "data.mdb"
    DAMAGE[damage](data)
    before = _snapshot(store_root)
    # every command on the issue's own damage; the read/maintenance commands on the others
    cmds = _commands(store_root, tmp_path) if damage == "zero_bytes" else [["ls"], ["show", "doc-0"], ["verify"], ["gc"]]
    for cmd in cmds:
        proc = run_cli(*cmd, store=store_root, timeout=300, own_process="fork" if damage != SUBPROCESS_DAMAGE else True)
        _assert_refused(proc, str(store_root))
        assert _snapshot(store_root) == before, f"{cmd} changed the damaged store"
    assert len(list((store_root / "objects").rglob("*/*"))) == 3 * N_DOCS  # nothing deleted


def test_library_refuses_damaged_catalog_even_with_create(store_root):
    (store_root / "catalog" / "data.mdb").write_bytes(b"")
    for create in (False, True):
        with pytest.raises(StoreCorruptError, match="empty"):
            Store(store_root, create=create)
    (store_root / "catalog" / "data.mdb").unlink()
    with pytest.raises(StoreCorruptError, match="holds objects but no catalog"):
        Store(store_root, create=True)


def test_store_is_created_only_in_a_missing_or_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    Store(tmp_path / "empty").close()
    Store(tmp_path / "new" / "deeper").close()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty and is not a kdnctl store"):
        Store(tmp_path / "busy")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        Store(tmp_path / "file")
    assert sorted(os.listdir(tmp_path / "busy")) == ["notes.txt"]


def test_ingest_into_a_file_fails_before_loading_the_model(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "d.txt").write_text("text")
    proc = run_cli("ingest", tmp_path / "d.txt", store=tmp_path / "afile")
    assert proc.returncode == 2 and "not a directory" in proc.stderr and "unexpected" not in proc.stderr


def test_read_only_commands_write_nothing(store_root):
    before = _snapshot(store_root)
    mtime = (store_root / "catalog" / "data.mdb").stat().st_mtime_ns
    for cmd in (["ls"], ["show", "doc-1"], ["verify"], ["gc", "--dry-run"]):
        assert run_cli(*cmd, store=store_root).returncode == 0
    assert _snapshot(store_root) == before
    assert (store_root / "catalog" / "data.mdb").stat().st_mtime_ns == mtime


def _put_raw(root: Path, db: str, key: bytes, value: bytes | None) -> None:
    """Write a raw catalog entry behind the Store's back (what a damaged byte can do)."""
    import lmdb

    env = lmdb.open(str(root / "catalog"), max_dbs=8, map_size=1 << 30)
    try:
        handle = env.open_db(db.encode(), create=False)
        with env.begin(write=True) as txn:
            if value is None:
                txn.delete(key, db=handle)
            else:
                txn.put(key, value, db=handle)
    finally:
        env.close()


def test_schema_value_of_wrong_type_is_damage_not_a_version_mismatch(store_root):
    _put_raw(store_root, "meta", b"schema_version", b'"1"')
    with pytest.raises(StoreCorruptError, match="schema version '1' is not an integer"):
        Store(store_root, create=False)
    _put_raw(store_root, "meta", b"schema_version", b"2")
    with pytest.raises(UnsupportedError, match="schema 2; this kdnctl reads schema 1"):
        Store(store_root, create=False)
    _put_raw(store_root, "meta", b"schema_version", None)
    with pytest.raises(StoreCorruptError, match="no schema version"):
        Store(store_root, create=False)


def test_record_with_a_bad_field_is_refused_on_read_and_by_verify(store_root):
    with Store(store_root) as st:
        v = st.get_version("doc-2")
        d = st.get_document("doc-2")
    from dataclasses import asdict

    rec = asdict(v)
    rec["mode"] = "trefix"  # the flip from the issue, written without a checksum
    key = f"doc-2\x00{v.doc_version}\x00full".encode()
    _put_raw(store_root, "versions", key, json.dumps(rec).encode())
    with Store(store_root, create=False) as st:
        with pytest.raises(StoreCorruptError, match="'mode' is 'trefix'"):
            st.get_version("doc-2")
        assert any("trefix" in p for p in st.verify())
    # a value that still parses but changed (n_tokens 8 -> 9) fails the record checksum
    with Store(store_root) as st:
        raw_doc = None
    import lmdb

    env = lmdb.open(str(store_root / "catalog"), max_dbs=8)
    with env.begin() as txn:
        raw_doc = txn.get(f"doc-3\x00{d.doc_version.replace(d.doc_version, '')}".encode(), db=env.open_db(b"docs", txn=txn))
    env.close()
    with Store(store_root) as st:
        d3 = st.get_document("doc-3")
    dkey = f"doc-3\x00{d3.doc_version}".encode()
    env = lmdb.open(str(store_root / "catalog"), max_dbs=8)
    with env.begin() as txn:
        raw_doc = txn.get(dkey, db=env.open_db(b"docs", txn=txn))
    env.close()
    _put_raw(store_root, "docs", dkey, raw_doc.replace(b'"n_tokens":8', b'"n_tokens":9'))
    proc = run_cli("ls", store=store_root)
    assert proc.returncode == 6 and "checksum" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("verify", store=store_root)
    assert proc.returncode == 1 and "checksum" in proc.stderr and "trefix" in proc.stderr


def test_current_entry_pointing_nowhere_is_an_error_not_a_shorter_listing(store_root):
    _put_raw(store_root, "current", b"doc-4", json.dumps("0" * 16).encode())
    proc = run_cli("ls", store=store_root)
    assert proc.returncode == 6 and "doc-4" in proc.stderr, proc.stderr
    before = _snapshot(store_root)
    proc = run_cli("gc", "--grace", "0", store=store_root)
    assert proc.returncode == 6 and "gc refuses" in proc.stderr
    assert _snapshot(store_root) == before


@pytest.mark.parametrize("part", ["doc_version", "label", "doc_id"])
def test_a_flipped_version_key_is_damage_not_a_shorter_listing(store_root, part):
    """A flipped byte in a version record's KEY moves the record out of reach of its
    (document, doc_version) lookup (seen with random flips: `ls` printed a document with no
    versions and exit 0). Listings read the wider range and check every key against its record."""
    import lmdb

    env = lmdb.open(str(store_root / "catalog"), max_dbs=8)
    with env.begin() as txn:
        db = env.open_db(b"versions", txn=txn)
        key = next(k for k, _ in txn.cursor(db=db) if k.startswith(b"doc-4\x00"))
        raw = txn.get(key, db=db)
    env.close()
    doc, dv, label = key.split(b"\x00")
    moved = {"doc_version": doc + b"\x00" + dv[:-1] + bytes([dv[-1] ^ 1]) + b"\x00" + label,
             "label": doc + b"\x00" + dv + b"\x00" + label[:-1] + bytes([label[-1] ^ 2]),
             "doc_id": b"doc-5\x00" + dv + b"\x00" + label}[part]
    _put_raw(store_root, "versions", key, None)
    _put_raw(store_root, "versions", moved, raw)
    proc = run_cli("ls", "--json", store=store_root)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 6 and len(lines) == 1 and "stored under another key" in lines[0], proc.stderr
    if part != "doc_id":  # one document's own listing reads its whole key range too
        with Store(store_root, create=False) as st:
            with pytest.raises(StoreCorruptError, match="another key"):
                st.list_versions("doc-4")


def test_random_byte_flips_in_the_catalog_never_pass_silently(store_root):
    """Each flip: `ls --json` either prints exactly the original listing (the flip hit unused
    bytes) or exits non-zero with one line; never a different listing with exit 0, never a
    signal. 40 flips here (the attack bench runs more)."""
    data = store_root / "catalog" / "data.mdb"
    good = data.read_bytes()
    want = run_cli("ls", "--json", store=store_root)
    assert want.returncode == 0
    rng = random.Random(10)
    outcomes = {"same": 0, "refused": 0}
    used = [i for i, b in enumerate(good) if b]  # flip bytes that hold something
    for _ in range(40):
        raw = bytearray(good)
        pos = rng.choice(used)
        raw[pos] ^= 1 << rng.randrange(8)
        data.write_bytes(bytes(raw))
        proc = run_cli("ls", "--json", store=store_root)
        assert 0 <= proc.returncode < 128, f"flip at {pos}: killed by signal {-proc.returncode}"
        if proc.returncode == 0:
            assert proc.stdout == want.stdout, f"flip at {pos} changed the listing silently"
            outcomes["same"] += 1
        else:
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error:"), (pos, proc.stderr)
            outcomes["refused"] += 1
    data.write_bytes(good)
    assert outcomes["refused"] > 0, outcomes


def _tail_free_catalog(root: Path, entry_bytes: int = 50_000) -> tuple[Path, int]:
    """Leave the catalog's last pages free (a big entry written, then deleted) and return the
    data file and the number of pages LMDB still reads (the highest page not listed free, + 1).
    A 4 MB entry frees ~1000 pages: their list no longer fits a page (LMDB's overflow pages)."""
    from kdnctl.store.lmdb_file import free_pages, read_meta

    _put_raw(root, "meta", b"scratch", b"x" * entry_bytes)
    _put_raw(root, "meta", b"scratch", None)
    data = root / "catalog" / "data.mdb"
    with open(data, "rb") as f:
        first = read_meta(f.read(4096))
        f.seek(4096)
        meta = max(first, read_meta(f.read(4096)), key=lambda m: m["txnid"])
        free = free_pages(f, meta["psize"], meta["free_root"], meta["last_pg"])
    used = max(p for p in range(meta["last_pg"] + 1) if p not in free) + 1
    assert meta["psize"] == 4096 and used < meta["last_pg"]  # the scenario holds: free pages at the end
    return data, used


@pytest.mark.parametrize("entry_bytes", [50_000, 4_000_000])
def test_catalog_ending_before_its_free_pages_is_complete(store_root, entry_bytes):
    """LMDB counts pages it allocated and freed in one txn but never wrote (a SIGKILLed writer's
    store showed it): a file that ends before such pages is whole. Every page LMDB may read is
    there, so reads and a new write succeed, in a child process where a SIGBUS would show."""
    data, used = _tail_free_catalog(store_root, entry_bytes)
    os.truncate(data, used * 4096)
    for cmd in (["verify"], ["ls"], ["show", "doc-5"]):
        proc = run_cli(*cmd, store=store_root)
        assert proc.returncode == 0, (cmd, proc.returncode, proc.stderr)
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from storekit import add_doc; from kdnctl.store import Store\n"
            "with Store(sys.argv[1], create=False) as st:\n"
            "    add_doc(st, 'late', b'late text', (b'l1', b'l2'))\n"
            "    print(len(st.list_documents()), len(st.list_versions()))")
    proc = subprocess.run([sys.executable, "-c", code, str(store_root), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(N_DOCS + 1)] * 2
    assert run_cli("verify", store=store_root).returncode == 0


def test_catalog_missing_a_page_in_use_is_damaged(store_root):
    data, used = _tail_free_catalog(store_root)
    os.truncate(data, (used - 1) * 4096)
    before = _snapshot(store_root)
    for cmd in (["ls"], ["verify"]):
        proc = run_cli(*cmd, store=store_root)
        _assert_refused(proc, "truncated", f"page {used - 1} is missing")
    assert _snapshot(store_root) == before
