"""Records have one validating decoder (used by the local catalog and by RemoteStore), and both
stores implement the ReadStore protocol."""

from __future__ import annotations

import dataclasses

import pytest
from storekit import add_doc

from kdnctl.store.client import RemoteStore
from kdnctl.errors import StoreCorruptError, UsageError
from kdnctl.store import ChunkRef, DocumentRecord, LocalObjects, ReadStore, Store, VersionRecord, check_sha


@pytest.fixture
def version(tmp_path):
    with Store(tmp_path / "kdn") as st:
        d, v = add_doc(st)
    return d, v


BAD_VERSION_FIELDS = [
    ("mode", "trefix"), ("mode", None), ("doc_id", ""), ("doc_id", "a\x00b"), ("doc_id", "x" * 201),
    ("label", 7), ("parent", 5), ("recipe", []), ("fingerprint", ""), ("chunks", {}), ("created", "now"),
    ("created", float("nan")), ("n_tokens", -1), ("n_tokens", True), ("doc_version", "\ud800"),
]
BAD_CHUNK_FIELDS = [("index", -2), ("index", "0"), ("object", "../x"), ("object", "A" * 64), ("token_start", -1),
                    ("token_end", 1.5), ("chain_hash", None), ("nbytes", -3)]


@pytest.mark.parametrize("field,value", BAD_VERSION_FIELDS)
def test_version_from_dict_refuses_bad_fields(version, field, value):
    d = dataclasses.asdict(version[1])
    d[field] = value
    with pytest.raises(StoreCorruptError, match=field):
        VersionRecord.from_dict(d)


@pytest.mark.parametrize("field,value", BAD_CHUNK_FIELDS)
def test_chunk_from_dict_refuses_bad_fields(version, field, value):
    d = dataclasses.asdict(version[1])
    d["chunks"][1][field] = value
    with pytest.raises(StoreCorruptError, match=field):
        VersionRecord.from_dict(d)


def test_round_trip_ignores_unknown_fields_and_refuses_non_objects(version):
    doc, v = version
    assert VersionRecord.from_dict(dataclasses.asdict(v) | {"future": 1}) == v
    assert DocumentRecord.from_dict(dataclasses.asdict(doc) | {"future": [1]}) == doc
    for bad in (None, [], "x", 3):
        with pytest.raises(StoreCorruptError):
            DocumentRecord.from_dict(bad)
    d = dataclasses.asdict(v)
    d["chunks"].append(dict(d["chunks"][0]))
    with pytest.raises(StoreCorruptError, match="duplicate chunk indices"):
        VersionRecord.from_dict(d)
    del d["chunks"][0]["object"]
    with pytest.raises(StoreCorruptError, match="'object' is missing"):
        ChunkRef.from_dict(d["chunks"][0])


def test_one_sha_check():
    assert check_sha("a" * 64) == "a" * 64
    for bad in ("../../etc/passwd", "A" * 64, "a" * 63, None, 5):
        with pytest.raises(UsageError, match="invalid object id"):
            check_sha(bad)


def test_both_stores_implement_read_store(tmp_path):
    with Store(tmp_path / "kdn") as st:
        assert isinstance(st, ReadStore) and isinstance(st, LocalObjects)
    remote = RemoteStore("http://127.0.0.1:9")
    assert isinstance(remote, ReadStore) and not isinstance(remote, LocalObjects)
    remote.close()
