"""Seeded bundle-header mutations, checked the way a store would meet them: every mutated
bundle goes through `verify`'s bundle check (the file, as stored under its own hash) and through
the loaders' parsers (the general decoder and the placed reader's cached header parser).

Mutations are structured rewrites of the safetensors JSON header: wrong types for every tensor
index field (a dtype that is a list, a dict, a number ...), shapes and offsets out of range,
metadata fields replaced by values of the wrong type, and in half of the cases the header
digest recomputed over the forgery (as an attacker would). The test asserts: 0 errors outside
kdnctl's own classes, and 0 bundles that pass verify but that a load then refuses.
``HEADER_CASES`` (env) sets the count; CI runs the default 6,000 (a few seconds: no model)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import struct

import pytest
from test_attack_fuzz import _seeds

from kdnctl.format.bundle import decode_bundle, header_size
from kdnctl.format.layout import parse_head_cached
from kdnctl.errors import KdnError
from kdnctl.store.maintenance import _bundle_meta
from kdnctl.format.tensor_views import _DTYPES

CASES = int(os.environ.get("HEADER_CASES", "6000"))
ODD_VALUES = [None, True, -1, 0, 1.5, "", "x", [], ["F16"], [1, 2], {}, {"a": 1}, 1 << 70, float("nan")]


def _reseal(header: dict) -> None:
    """Recompute the header digest over the (mutated) metadata and tensor index."""
    md = header["__metadata__"]
    meta_json = md.get("kdnctl")
    if not isinstance(meta_json, str):
        return
    h = hashlib.sha256(meta_json.encode("utf-8", "surrogatepass"))
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        if not isinstance(info, dict):
            continue
        dt = info.get("dtype")
        dt = _DTYPES.get(dt, dt) if isinstance(dt, str) else dt
        shape = info.get("shape")
        h.update(f"\n{name}|{dt}|{list(shape) if isinstance(shape, list) else shape}".encode("utf-8", "surrogatepass"))
    md["kdnctl_sha256"] = h.hexdigest()


def mutate_header(data: bytes, rng: random.Random) -> bytes:
    pick = lambda values: copy.deepcopy(rng.choice(values))  # noqa: E731 - never share one list twice
    n = header_size(data)
    header = json.loads(data[8:n])
    meta = json.loads(header["__metadata__"]["kdnctl"])
    names = [k for k in header if k != "__metadata__"]
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(6)
        names = [k for k in names if isinstance(header[k], dict)] or names
        if kind < 3 and not isinstance(header[names[0]], dict):
            kind = 4
        if kind == 0:  # tensor dtype of any type
            header[rng.choice(names)]["dtype"] = pick(ODD_VALUES + ["F64", "U8", "BOOL", "I32", "F8_E4M3"])
        elif kind == 1:
            header[rng.choice(names)]["shape"] = pick(ODD_VALUES + [[-1], [1 << 62, 2], [0], [2, "3"],
                                                                   [True]])
        elif kind == 2:
            header[rng.choice(names)]["data_offsets"] = pick(ODD_VALUES + [[0, 1 << 60], [5, 2], [0, "8"]])
        elif kind == 3:
            header[rng.choice(names)] = pick(ODD_VALUES)
        elif kind == 4:  # a meta field of the wrong type
            meta[rng.choice(sorted(meta))] = pick(ODD_VALUES)
        else:  # a field of the model summary of the wrong type
            model = meta.get("model")
            if isinstance(model, dict) and model:
                model[rng.choice(sorted(model))] = pick(ODD_VALUES)
    header["__metadata__"]["kdnctl"] = json.dumps(meta)
    if rng.random() < 0.5:
        _reseal(header)
    text = json.dumps(header).encode("utf-8", "surrogatepass")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[n:]


def _outcome(fn, *args):
    """'ok', 'refused' (a kdnctl error) or the foreign exception."""
    try:
        fn(*args)
        return "ok"
    except KdnError:
        return "refused"
    except Exception as exc:  # noqa: BLE001 - the point of the test
        return exc


def test_seeded_header_mutations_verify_checks_what_a_load_parses(tmp_path):
    rng = random.Random(20261129)
    seeds = _seeds()
    path = tmp_path / "object"
    counts = {"verify ok": 0, "verify refused": 0, "verify ok, load refused": 0}
    foreign = []
    for case in range(CASES):
        data = mutate_header(rng.choice(seeds), rng)
        path.write_bytes(data)
        verified = _outcome(_bundle_meta, path)
        header_only = _outcome(lambda p: _bundle_meta(p, full=False), path)
        loaded = _outcome(decode_bundle, bytearray(data))
        placed = _outcome(parse_head_cached, data, len(data))
        for what, got in (("verify", verified), ("gc's header check", header_only), ("decode", loaded),
                          ("placed parse", placed)):
            if isinstance(got, Exception):
                foreign.append(f"case {case} {what}: {type(got).__name__}: {str(got)[:120]}")
        if verified == "ok":
            counts["verify ok"] += 1
            if loaded != "ok":
                counts["verify ok, load refused"] += 1
        else:
            counts["verify refused"] += 1
    print(f"{CASES} header mutations: {counts}, {len(foreign)} errors outside kdnctl's classes")
    assert foreign == [], foreign[:5]
    assert counts["verify ok, load refused"] == 0
    assert counts["verify refused"] > CASES // 2  # the mutations do reach the checks


@pytest.mark.parametrize("dtype", [["F16"], {"a": 1}, 3, None])
def test_tensor_dtype_of_another_type_is_a_bundle_format_error(dtype):
    from kdnctl.errors import BundleFormatError

    data = _seeds()[0]
    n = header_size(data)
    header = json.loads(data[8:n])
    header["layers.0.keys"]["dtype"] = dtype
    _reseal(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    bad = struct.pack("<Q", len(text)) + text + data[n:]
    with pytest.raises(BundleFormatError, match="dtype"):
        decode_bundle(bad)
