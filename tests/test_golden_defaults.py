"""The two size-budget defaults store exactly what they stored before: every tensor of every chunk
of the 0.25 and 0.083 versions of one short real document, hashed byte for byte against digests
pinned below, and the chunk metadata apart from the version's name and the writer's stamps.

A change to these digests is a change to what the defaults store: make it on purpose, measure it
(bench/quality.py), and pin the new digests with ``python tests/test_golden_defaults.py``. A
version's name does not change them."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest
import torch

from budgetkit import trimmed_store

from kdnctl.format.bundle import STAMPED_META_KEYS, decode_bundle
from kdnctl.compress.document import CompressRecipe, compress_document

DOC, N_TOKENS = "faq.md", 300
# budget -> (sha256 of every chunk's tensors, sha256 of every chunk's meta without name and stamps)
GOLDEN = {
    0.25: ("0543f1ca94eaa09956586ba74b7349df3f7e478b9ea247a5059034ce9663f005",
           "96f889996e979f1f0a31f2592593d93864d863021f6c09fbccceaf5aa07f6d07"),
    0.083: ("29df25cec4c97e62d4bab86801adb5493d737d6f16e8b1c7d5a904202306d81f",
            "c3661997504fa5f898772c59c4baff266012f1820e163890f8f4779a6ced92e3"),
}
# The writer's stamp (`created`, a float whose printed length varies) counts toward the byte cap
# the scale is fitted to: a fixed stamp makes what a recipe stores a function of its input alone.
STAMP = "1764000000"
NAME_KEYS = ("label",)  # the only metadata a version's name may change


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def meta_digest(meta: dict) -> str:
    kept = {k: v for k, v in meta.items() if k not in STAMPED_META_KEYS and k not in NAME_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def version_digests(st, label: str) -> tuple[str, str]:
    tensors, metas = hashlib.sha256(), hashlib.sha256()
    for c in st.get_version(DOC, label).chunks:
        b = decode_bundle(st.read_object(c.object))
        tensors.update(tensor_digest(b.tensors).encode())
        metas.update(meta_digest(b.meta).encode())
    return tensors.hexdigest(), metas.hexdigest()


@pytest.fixture(scope="module")
def store(tmp_path_factory, lm):
    old = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = STAMP
    try:
        yield trimmed_store(tmp_path_factory, lm, {DOC: N_TOKENS})
    finally:
        if old is None:
            del os.environ["SOURCE_DATE_EPOCH"]
        else:
            os.environ["SOURCE_DATE_EPOCH"] = old


@pytest.mark.parametrize("budget", sorted(GOLDEN))
def test_default_stores_the_pinned_tensors(lm, store, budget):
    with store.writer():
        label = compress_document(store, DOC, CompressRecipe(budget=budget), lm=lm).label
    assert version_digests(store, label) == GOLDEN[budget]


if __name__ == "__main__":  # prints the digests of the code on the path, to pin them above
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import default_lm

    class _Dirs:
        def mktemp(self, name):
            return Path(tempfile.mkdtemp(prefix=name))

    torch.set_num_threads(1)
    os.environ["SOURCE_DATE_EPOCH"] = STAMP
    model = default_lm()
    st = trimmed_store(_Dirs(), model, {DOC: N_TOKENS})
    for b in sorted(GOLDEN):
        with st.writer():
            made = compress_document(st, DOC, CompressRecipe(budget=b), lm=model).label
        print(f"    {b}: {version_digests(st, made)!r},  # {made}")


OLD_NAMES = {0.25: "ec-b0.25-p64-lliterals0.3x2k", 0.083: "ec-b0.083-k0.5-p32-lliterals0.3x2k-rf0.01hdf-sentences-gap"}


def test_versions_under_their_old_names_still_load_and_answer(lm, store):
    """A store compressed before versions had short names holds the defaults under their old
    names (the recipe spelled out): they load by those names, store what b0.25 stores, and
    compressing with the default again makes b0.25 beside them."""
    from conftest import run_cli

    with store.writer():
        old = compress_document(store, DOC, CompressRecipe(budget=0.25), lm=lm, label=OLD_NAMES[0.25])
    assert old.status == "compressed" and version_digests(store, OLD_NAMES[0.25]) == GOLDEN[0.25]
    asked = run_cli("ask", DOC, "What is the return policy?", "--version", OLD_NAMES[0.25], "--json", store=store.root)
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["answer"].strip()
    shown = run_cli("show", DOC, "--version", OLD_NAMES[0.25], store=store.root)
    assert shown.returncode == 0 and "lift=\"literals\"" in shown.stdout and "step=\"compress\"" in shown.stdout
    again = run_cli("compress", DOC, "--json", store=store.root)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["results"][0]["label"] == "b0.25"


def test_keep_alone_evicts_without_a_budget(store):
    res = run_cli_json(store, "compress", DOC, "--keep", "0.5")
    assert res["label"] == "kvcrush-k0.5" and res["status"] == "compressed" and 0.45 < res["kept"] <= 0.55


def run_cli_json(store, *args):
    from conftest import run_cli

    proc = run_cli(*args, "--json", store=store.root)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["results"][0]
