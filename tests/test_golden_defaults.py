"""The two size-budget defaults store exactly what they stored before: every tensor of every chunk
of the 0.25 and 0.083 versions of one short real document, hashed byte for byte against digests
pinned below, and the chunk metadata apart from the version's name and the writer's stamps.

A change to these digests is a change to what the defaults store: make it on purpose, measure it
(bench/quality.py), and pin the new digests with ``python tests/test_golden_defaults.py``."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch

from budgetkit import trimmed_store

from kdnctl.bundle import STAMPED_META_KEYS, decode_bundle
from kdnctl.compress import CompressRecipe, compress_document

DOC, N_TOKENS = "faq.md", 300
# budget -> (sha256 of every chunk's tensors, sha256 of every chunk's meta without name and stamps)
GOLDEN = {
    0.25: ("", ""),
    0.083: ("", ""),
}
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
    return trimmed_store(tmp_path_factory, lm, {DOC: N_TOKENS})


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
    model = default_lm()
    st = trimmed_store(_Dirs(), model, {DOC: N_TOKENS})
    for b in sorted(GOLDEN):
        with st.writer():
            made = compress_document(st, DOC, CompressRecipe(budget=b), lm=model).label
        print(f"    {b}: {version_digests(st, made)!r},  # {made}")
