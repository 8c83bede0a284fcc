"""Bundle-decoder fuzzer: random mutations of valid bundles (fixed seed) may only ever raise
kdnctl's own errors (BundleFormatError / ModelMismatchError), never a Python or pyo3 error.

Mutations: bit flips, byte overwrites, truncations, insertions, deletions, header-length
changes, and structured header rewrites (deep nesting, huge numbers, wrong types, missing keys).
``FUZZ_CASES`` (env) raises the count for a longer run; CI runs the default."""

from __future__ import annotations

import json
import os
import random
import struct

import pytest
import torch
from storekit import bundle_bytes

from kdnctl.format.bundle import KVBundle, decode_bundle, encode_bundle, header_size, make_meta, read_meta
from kdnctl.errors import BundleFormatError, KdnError, ModelMismatchError

CASES = int(os.environ.get("FUZZ_CASES", "3000"))


def _seeds() -> list[bytes]:
    plain = bundle_bytes(b"seed-bundle", doc_id="d", doc_version="v", index=0, start=0, end=6,
                         chain_hash="a" * 64)
    # a pruned bundle with per-layer positions and a bias, two layers
    n = 5
    tensors = {"token_ids": torch.arange(n, dtype=torch.int64)}
    for i in range(2):
        tensors[f"layers.{i}.keys"] = torch.randn(1, 3, 2).half()
        tensors[f"layers.{i}.values"] = torch.randn(1, 3, 2).half()
        tensors[f"layers.{i}.positions"] = torch.tensor([[0, 2, 4]], dtype=torch.int64)
    meta = make_meta(model_fingerprint="f" * 64, model={"n_layers": 2, "n_kv_heads": 1, "head_dim": 2,
                                                        "n_q_heads": 1},
                     doc_id="d", doc_version="v", chunk_index=0, n_chunks=1, token_start=0, token_end=n,
                     chain_hash="b" * 64, label="kv50", parent="full", recipe={"steps": []}, dtype="float16")
    pruned = encode_bundle(KVBundle(meta=meta, tensors=tensors))
    return [plain, pruned]


def _rewrite_header(data: bytes, rng: random.Random) -> bytes:
    n = header_size(data)
    header = json.loads(data[8:n])
    md = header["__metadata__"]
    meta = json.loads(md["kdnctl"])
    key = rng.choice(sorted(meta))
    choice = rng.randrange(9)
    if choice == 0:
        meta[key] = "__NEST__"  # replaced by 5000 nested arrays in the meta JSON text below
    elif choice == 1:
        meta[key] = int("9" * rng.choice([20, 400, 4000]))
    elif choice == 2:
        meta["format_version"] = rng.choice(["1" + "0" * 5000 + ".0", "1.", "01.0", "x", None, 1.0, ["1", "0"]])
    elif choice == 3:
        meta.pop(key)
    elif choice == 4:
        meta[key] = rng.choice([None, True, -1, 1.5, "", {}, [], "\ud800"])
    elif choice == 5:
        md["kdnctl"] = "[" * 100000
    elif choice == 6:
        name = rng.choice([k for k in header if k != "__metadata__"])
        header[name]["shape"] = rng.choice([[], [-1], [1 << 62, 2], [0, 0, 0], "x"])
    elif choice == 7:
        name = rng.choice([k for k in header if k != "__metadata__"])
        header[name]["dtype"] = rng.choice(["F64", "BOOL", "U8", "??", 3])
    else:
        name = rng.choice([k for k in header if k != "__metadata__"])
        header[name]["data_offsets"] = rng.choice([[0, 1 << 60], [5, 2], [-1, 3], None])
    if choice != 5:
        md["kdnctl"] = json.dumps(meta, ensure_ascii=rng.random() < 0.5).replace('"__NEST__"', "[" * 5000 + "]" * 5000)
    text = json.dumps(header).encode("utf-8", "surrogatepass")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[n:]


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(8)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind == 1:
        i = rng.randrange(len(b))
        b[i:i + 4] = bytes(rng.randrange(256) for _ in range(4))
    elif kind == 2:
        b = b[: rng.randrange(len(b))]
    elif kind == 3:
        i = rng.randrange(len(b))
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == 4:
        i = rng.randrange(len(b))
        del b[i:i + rng.randint(1, 16)]
    elif kind == 5:
        b[0:8] = struct.pack("<Q", rng.choice([0, 1, 7, len(b), len(b) - 8, 1 << 40, (1 << 64) - 1,
                                               header_size(data) - 8 + rng.randint(-8, 8)]))
    elif kind == 6:
        n = header_size(data)  # flip inside the JSON header only: the digest must catch it
        i = rng.randrange(8, n)
        b[i] = rng.randrange(32, 127)
    else:
        return _rewrite_header(data, rng)
    return bytes(b)


def test_bundle_decoder_fuzz_raises_only_kdnctl_errors():
    rng = random.Random(20261122)
    seeds = _seeds()
    for s in seeds:
        decode_bundle(s)  # the seeds are valid
    outcomes = {"BundleFormatError": 0, "ModelMismatchError": 0, "decoded": 0}
    for case in range(CASES):
        data = _mutate(rng.choice(seeds), rng)
        try:
            decode_bundle(data, expect_fingerprint="f" * 64)
            outcomes["decoded"] += 1  # a mutation that left a valid bundle (e.g. padding bytes)
        except (BundleFormatError, ModelMismatchError) as exc:
            outcomes[type(exc).__name__] += 1
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {case}: {type(exc).__name__}: {str(exc)[:200]}")
        try:
            read_meta(data[: max(8, min(len(data), header_size(data)))] if len(data) >= 8 else data)
        except KdnError:
            pass
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"case {case} (read_meta): {type(exc).__name__}: {str(exc)[:200]}")
    print(f"{CASES} mutations: {outcomes}")
    assert outcomes["BundleFormatError"] > CASES // 2
