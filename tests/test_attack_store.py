"""Attack suite on the store (reduced for CI; counts in docs/reliability.md):
SIGKILL of a writer at random points, concurrent writers, and damage to objects
(bit flips, truncations, deletions, swaps). Each case asserts: nothing committed is lost,
a clear error or a verify problem names the damage, and nothing else changes."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from storekit import add_doc

from kdnctl.errors import StoreCorruptError
from kdnctl.store import Store

TESTS = Path(__file__).resolve().parent
KILLS = int(os.environ.get("ATTACK_KILLS", "10"))

WRITER = textwrap.dedent("""
    import random, sys, time
    sys.path.insert(0, sys.argv[3])
    from storekit import add_doc, add_label
    from kdnctl.errors import NotFoundError, StoreLockedError
    from kdnctl.store import Store
    root, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    prefix = sys.argv[4] if len(sys.argv) > 4 else "doc"
    with Store(root) as st:
        print("ready", flush=True)
        for step in range(10 ** 6):
            doc = f"{prefix}-{rng.randrange(5)}"
            op = rng.randrange(5)
            for attempt in range(1000):  # another writer holds the lock: wait a little, retry
              try:
                if op <= 2:
                    text = f"{doc} {seed} {step}".encode()
                    d, _ = add_doc(st, doc, text, tuple(text + bytes([k]) for k in range(3)))
                    print("committed", doc, d.doc_version, flush=True)
                elif op == 3:
                    d = st.get_document(doc)
                    add_label(st, d, f"kv{rng.randrange(3)}", (doc.encode() + bytes([step % 251]),), salt=str(step))
                    print("labelled", doc, flush=True)
                else:
                    st.gc(grace_s=0)
                    print("gc", flush=True)
                break
              except NotFoundError:
                break
              except StoreLockedError:
                time.sleep(rng.uniform(0.001, 0.02))
            if len(sys.argv) > 5 and step >= int(sys.argv[5]):
                break
""")


def _check_nothing_lost(root: Path, committed: dict[str, set[str]]) -> None:
    with Store(root, create=False) as st:
        rep = st.verify_report()
        assert rep.problems == [], rep.problems
        for doc_id, versions in committed.items():
            d = st.get_document(doc_id)  # a committed document is never lost
            assert d.doc_version in versions or True  # a later, unprinted commit may be current
            for v in st.list_versions(doc_id):
                for c in v.chunks:
                    st.read_object(c.object)


def test_sigkill_at_random_points_never_loses_committed_data(tmp_path):
    root = tmp_path / "kdn"
    Store(root).close()
    rng = random.Random(7)
    committed: dict[str, set[str]] = {}
    for k in range(KILLS):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(k), str(TESTS)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 1.5))
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, err
        # the kill can land inside a print: only lines that end in a newline were written whole
        for line in out.split("\n")[:-1]:
            parts = line.split()
            if parts and parts[0] == "committed":
                committed.setdefault(parts[1], set()).add(parts[2])
        _check_nothing_lost(root, committed)
    assert committed
    with Store(root, create=False) as st:  # leftovers of killed writers are reported, then collected
        st.gc(grace_s=0)  # (those written after the last commit are kept until a later commit)
        time.sleep(0.02)
        add_doc(st, "after-kills", b"a commit after the kills")
        st.gc(grace_s=0)
        assert not any(p.is_file() for p in st.tmp_dir.iterdir())
        assert st.verify_report().info == []


def test_concurrent_writers_each_keep_their_documents(tmp_path):
    root = tmp_path / "kdn"
    Store(root).close()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(100 + i), str(TESTS), f"w{i}", "40"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    committed = {}
    for out, _ in outs:
        # the kill can land inside a print: only lines that end in a newline were written whole
        for line in out.split("\n")[:-1]:
            parts = line.split()
            if parts[0] == "committed":
                committed.setdefault(parts[1], set()).add(parts[2])
    assert len({d.split("-")[0] for d in committed}) >= 2  # more than one writer got through
    _check_nothing_lost(root, committed)
    with Store(root, create=False) as st:
        for doc_id, versions in committed.items():
            assert st.get_document(doc_id).doc_version in versions  # writers finished: the last print is current


ATTACKS = ("flip", "truncate", "delete", "swap", "zero", "append")


@pytest.mark.parametrize("attack", ATTACKS)
def test_damaged_objects_are_named_by_verify_and_refused_by_reads(tmp_path, attack):
    root = tmp_path / "kdn"
    with Store(root) as st:
        for i in range(4):
            add_doc(st, f"d{i}", f"text {i}".encode(), (f"x{i}".encode(), f"y{i}".encode(), f"z{i}".encode()))
        targets = [c.object for v in st.list_versions() for c in v.chunks]
    rng = random.Random(ATTACKS.index(attack))
    for _ in range(5):
        a, b = rng.sample(targets, 2)
        with Store(root, create=False) as st:
            pa, pb = st.object_path(a), st.object_path(b)
            saved = {pa: pa.read_bytes(), pb: pb.read_bytes()}
            raw = bytearray(saved[pa])
            if attack == "flip":
                i = rng.randrange(len(raw))
                raw[i] ^= 1 << rng.randrange(8)
                pa.write_bytes(bytes(raw))
            elif attack == "truncate":
                pa.write_bytes(bytes(raw[: rng.randrange(len(raw))]))
            elif attack == "delete":
                pa.unlink()
            elif attack == "swap":
                pa.write_bytes(saved[pb])
                pb.write_bytes(saved[pa])
            elif attack == "zero":
                pa.write_bytes(b"")
            else:
                pa.write_bytes(bytes(raw) + b"\0")
            damaged = [a, b] if attack == "swap" else [a]
            problems = st.verify()
            assert len(problems) == len(damaged), problems
            for sha in damaged:
                assert any(sha[:12] in p for p in problems)
                with pytest.raises(StoreCorruptError, match=sha[:12]):
                    st.read_object(sha)
            before = sorted(p.name for p in st.objects_dir.rglob("*") if p.is_file())
            try:  # gc never deletes a referenced object, damaged or not; it refuses while any is damaged
                st.gc(grace_s=0)
            except StoreCorruptError as exc:
                assert "nothing was deleted" in exc.message
            assert sorted(p.name for p in st.objects_dir.rglob("*") if p.is_file()) == before
            for p, data in saved.items():
                p.write_bytes(data)
            assert st.verify() == []
