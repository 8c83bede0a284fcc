"""Attacks on what `gc` may delete, and the last unexpected errors of the store's commands.

A three-document store (one with a second label) is damaged in each way a user or an attacker
can: a foreign catalog copied in, an older backup of its own catalog restored, a chunk record
or a document record forged to point at another document's object (checksums recomputed), an
emptied or truncated catalog. Each case records which objects a trusted record (the catalog
before the attack) references, runs the real `kdnctl gc`, and counts how many of them are gone:
tests/test_attack_total.py asserts the total over the suite's cases is 0.
Also here: empty ids, read-only stores, commands that fail before writing, option ranges."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_cli
from storekit import GC_CASES, add_doc, add_label

from kdnctl.store import Store
from kdnctl.store import catalog as cat
from kdnctl.store.reads import seal_record

def three_docs(root: Path, prefix: str = "d") -> set[str]:
    """A store of three documents (the first with a second label); returns every object a
    record references."""
    with Store(root) as st:
        docs = [add_doc(st, f"{prefix}{i}", f"text of {prefix}{i}".encode(), (f"{prefix}{i}a".encode(),
                                                                              f"{prefix}{i}b".encode()))[0]
                for i in range(3)]
        add_label(st, docs[0], "kv50", (f"{prefix}0-pruned".encode(),), salt=prefix)
        return referenced(st)


def referenced(st: Store) -> set[str]:
    dump = st.catalog_dump()
    refs = {d["text_object"] for d in dump["docs"].values()}
    refs.update(c["object"] for v in dump["versions"].values() for c in v["chunks"])
    return refs


def objects(root: Path) -> set[str]:
    return {p.name for p in (root / "objects").glob("*/*") if p.is_file()}


def gc_case(case: str, root: Path, trusted: set[str], *args: str) -> subprocess.CompletedProcess:
    """Run the real `kdnctl gc` and record how many trusted-referenced objects it removed."""
    proc = run_cli("gc", *args, store=root)
    GC_CASES.append((case, len(trusted - objects(root))))
    return proc


def age_objects(root: Path, seconds: float = 3600) -> None:
    """Make every object look written ``seconds`` ago (older than any commit of the test)."""
    t = time.time() - seconds
    for p in (root / "objects").glob("*/*"):
        os.utime(p, (t, t))


def replace_catalog(root: Path, source: Path) -> None:
    shutil.rmtree(root / "catalog")
    shutil.copytree(source, root / "catalog")


def forge(root: Path, db: str, key: bytes, record) -> None:
    """Overwrite one catalog record with a well-formed, correctly sealed forgery."""
    with Store(root, create=False) as st, st._env.begin(write=True) as txn:
        txn.put(key, seal_record(record), db=st._db[db])


# -- foreign and stale catalogs ----------------------------------------------------------------

def test_foreign_catalog_gc_refuses_and_deletes_nothing(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    trusted = three_docs(a)
    three_docs(b, prefix="other")
    replace_catalog(a, b / "catalog")  # `rm -rf A/catalog; cp -a B/catalog A/catalog`
    age_objects(a)
    before = objects(a)
    assert run_cli("verify", store=a).returncode == 1
    for args in ((), ("--grace", "0")):
        proc = gc_case("foreign catalog", a, trusted, *args)
        assert proc.returncode == 6, proc.stderr
        assert "another store" in proc.stderr and "nothing was deleted" in proc.stderr
    assert objects(a) == before


def test_foreign_catalog_whose_objects_all_exist_is_refused_by_identity(tmp_path):
    """A catalog of another store made from the same content references only objects that are
    here, so verify's checks pass: the store identity alone tells it is not this store's."""
    a, b = tmp_path / "a", tmp_path / "b"
    trusted = three_docs(a)
    with Store(b) as st:
        add_doc(st, "d1", b"text of d1", (b"d1a", b"d1b"))  # the same objects as a's d1
    replace_catalog(a, b / "catalog")
    age_objects(a)
    assert run_cli("verify", store=a).returncode == 0  # consistent, just not a's
    proc = gc_case("foreign catalog, same content", a, trusted, "--grace", "0")
    assert proc.returncode == 6 and "another store" in proc.stderr, proc.stderr
    assert objects(a) >= trusted


def test_older_backup_of_the_catalog_keeps_newer_objects(tmp_path):
    root = tmp_path / "kdn"
    three_docs(root)
    age_objects(root)
    backup = tmp_path / "catalog.bak"
    shutil.copytree(root / "catalog", backup)
    time.sleep(0.05)
    with Store(root, create=False) as st:  # two newer compressed versions
        for doc_id in ("d1", "d2"):
            add_label(st, st.get_document(doc_id), "q4", (f"{doc_id}-q4".encode(),), salt=doc_id)
        trusted = referenced(st)
    replace_catalog(root, backup)
    proc = gc_case("older backup", root, trusted, "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert objects(root) >= trusted
    assert json.loads(run_cli("gc", "--dry-run", "--json", store=root).stdout)["kept_newer"] == 2


def test_catalog_without_identity_of_a_store_with_one_is_refused(tmp_path):
    root = tmp_path / "kdn"
    trusted = three_docs(root)
    age_objects(root)
    with Store(root, create=False) as st, st._env.begin(write=True) as txn:
        txn.delete(cat.STORE_ID_KEY, db=st._db["meta"])
        txn.put(cat.key("d9"), b'"0000000000000000"', db=st._db["current"])  # and inconsistent
    proc = gc_case("catalog without id", root, trusted, "--grace", "0")
    assert proc.returncode == 6 and "nothing was deleted" in proc.stderr, proc.stderr
    assert objects(root) >= trusted


def test_store_made_before_identities_adopts_one_on_first_write(tmp_path):
    root = tmp_path / "kdn"
    trusted = three_docs(root)
    with Store(root, create=False) as st:
        orphan = st.put_object(b"an old orphan")
    age_objects(root)
    with Store(root, create=False) as st, st._env.begin(write=True) as txn:  # as an older kdnctl left it
        txn.delete(cat.STORE_ID_KEY, db=st._db["meta"])
        txn.delete(cat.LAST_COMMIT_KEY, db=st._db["meta"])
    (root / "objects" / cat.IDENTITY_FILE).unlink()
    assert run_cli("verify", store=root).returncode == 0  # reads need no identity
    proc = gc_case("store without identity", root, trusted, "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert orphan not in objects(root) and objects(root) >= trusted
    with Store(root, create=False) as st:
        assert st.catalog_identity() == st.objects_identity() is not None


# -- forged records --------------------------------------------------------------------------

def test_forged_chunk_record_makes_gc_refuse(tmp_path):
    root = tmp_path / "kdn"
    trusted = three_docs(root)
    age_objects(root)
    with Store(root, create=False) as st:
        v0, v1 = st.get_version("d0"), st.get_version("d1")
    real = v0.chunks[0].object
    v0.chunks[0].object = v1.chunks[0].object  # d0's chunk 0 now "is" d1's chunk 0
    forge(root, "versions", cat.key(v0.doc_id, v0.doc_version, v0.label), v0)
    assert run_cli("verify", store=root).returncode == 1
    proc = gc_case("forged chunk record", root, trusted, "--grace", "0")
    assert proc.returncode == 6 and "nothing was deleted" in proc.stderr, proc.stderr
    assert real in objects(root)


def test_forged_text_object_fails_verify_and_makes_gc_refuse(tmp_path):
    root = tmp_path / "kdn"
    trusted = three_docs(root)
    age_objects(root)
    with Store(root, create=False) as st:
        d0, d1 = st.get_document("d0"), st.get_document("d1")
    real = d0.text_object
    d0.text_object = d1.text_object
    forge(root, "docs", cat.key(d0.doc_id, d0.doc_version), d0)
    proc = run_cli("verify", store=root)
    assert proc.returncode == 1 and "another text" in proc.stderr, proc.stderr
    proc = gc_case("forged text record", root, trusted, "--grace", "0")
    assert proc.returncode == 6, proc.stderr
    assert real in objects(root)


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_damaged_catalog_file_gc_refuses(tmp_path, damage):
    root = tmp_path / "kdn"
    trusted = three_docs(root)
    age_objects(root)
    data = root / "catalog" / "data.mdb"
    data.write_bytes(b"" if damage == "empty" else data.read_bytes()[: 4096 + 100])
    proc = gc_case(f"{damage} catalog", root, trusted, "--grace", "0")
    assert proc.returncode == 6, proc.stderr
    assert objects(root) >= trusted


def test_flipped_catalog_bytes_never_make_gc_delete_a_referenced_object(tmp_path):
    """Seeded bit flips anywhere in the catalog file (a forked `kdnctl gc` each: LMDB maps the file)."""
    import random

    root = tmp_path / "kdn"
    trusted = three_docs(root)
    age_objects(root)
    data = root / "catalog" / "data.mdb"
    clean = data.read_bytes()
    rng = random.Random(20261129)
    outcomes = {}
    for _ in range(20):
        raw = bytearray(clean)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(raw))
            raw[i] ^= 1 << rng.randrange(8)
        data.write_bytes(bytes(raw))
        proc = run_cli("gc", "--grace", "0", store=root, own_process="fork")
        GC_CASES.append(("flipped catalog bytes", len(trusted - objects(root))))
        assert proc.returncode in (0, 6), proc.stderr
        outcomes[proc.returncode] = outcomes.get(proc.returncode, 0) + 1
        assert objects(root) >= trusted
        data.write_bytes(clean)
    print(f"20 flipped catalogs: gc exit codes {outcomes}")


def test_damaged_objects_make_gc_refuse(tmp_path):
    root = tmp_path / "kdn"
    trusted = three_docs(root)
    age_objects(root)
    with Store(root, create=False) as st:
        v = st.get_version("d2")
    victim = root / "objects" / v.chunks[1].object[:2] / v.chunks[1].object
    victim.unlink()  # one referenced object lost: the rest must survive gc
    trusted -= {v.chunks[1].object}
    proc = gc_case("missing object", root, trusted, "--grace", "0")
    assert proc.returncode == 6, proc.stderr
    assert objects(root) == trusted


def test_healthy_gc_still_collects_and_keeps_what_records_use(tmp_path):
    root = tmp_path / "kdn"
    trusted = three_docs(root)
    with Store(root, create=False) as st:
        orphan = st.put_object(b"nobody refers to me")
    age_objects(root)
    proc = gc_case("healthy", root, trusted, "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert orphan not in objects(root)


# -- ids, options, read-only stores, failed commands ----------------------------------------

def test_empty_or_invalid_document_id_is_a_usage_error(tmp_path):
    root = tmp_path / "kdn"
    three_docs(root)
    for args in (("show", ""), ("show", "a\x00b"), ("ask", "", "what?")):
        proc = run_cli(*args, store=root)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "rebuild-catalog" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_option_ranges(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a short document")
    for window in ("-1", "0"):
        proc = run_cli("ingest", str(corpus), "--window", window, store=tmp_path / "w")
        assert proc.returncode == 2 and "--window" in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()
    root = tmp_path / "kdn"
    three_docs(root)
    for keep in ("0", "2", "nan", "-0.5"):
        proc = run_cli("compress", "d0", "--keep", keep, store=root)
        assert proc.returncode == 2 and "--keep" in proc.stderr and "--budget" not in proc.stderr, proc.stderr


def test_commands_failing_before_writing_leave_no_store(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a short document")
    new = tmp_path / "new"
    proc = run_cli("ingest", str(corpus), "--model", "/nonexistent", store=new)
    assert proc.returncode == 8, proc.stderr
    assert not new.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("pull", "http://127.0.0.1:9", store=empty)  # nothing listens there
    assert proc.returncode != 0
    assert empty.is_dir() and list(empty.iterdir()) == []  # the directory the user made stays, empty


def _mount_read_only(src: Path, dst: Path) -> bool:
    dst.mkdir()
    ok = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True).returncode == 0
    if ok and subprocess.run(["mount", "-o", "remount,ro,bind", str(dst)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(dst)], capture_output=True)
        ok = False
    return ok


def test_read_only_store_one_line_and_reads_work(tmp_path):
    root, ro = tmp_path / "kdn", tmp_path / "ro"
    three_docs(root)
    if not _mount_read_only(root, ro):
        pytest.skip("needs a read-only bind mount (mount privileges)")
    try:
        corpus = tmp_path / "c.txt"
        corpus.write_text("a short document")
        for args in (("gc",), ("gc", "--dry-run"), ("rebuild-catalog", "--force"), ("ingest", str(corpus)),
                     ("compress", "d0", "--budget", "0.5")):
            proc = run_cli(*args, store=ro)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 7 and len(lines) == 1 and "is read-only" in lines[0], (args, proc.stderr)
        for args in (("ls",), ("verify",), ("show", "d0")):
            assert run_cli(*args, store=ro).returncode == 0, args
    finally:
        cat.forget_env(ro / "catalog")  # the in-process commands' shared LMDB mapping holds the mount
        if subprocess.run(["umount", str(ro)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)
