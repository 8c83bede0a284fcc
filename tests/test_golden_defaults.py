"""The two size-budget defaults store exactly what they stored before: every tensor of every chunk
of the 0.25 and 0.083 versions of one short real document, hashed against digests pinned below,
and the chunk metadata apart from the version's name and the writer's stamps.

The first digest takes ec's code blobs as the integer codes they decode to (what the loader
rebuilds the K/V from), every other tensor byte for byte: it does not move when the same codes
are framed in other bytes. The third takes the code blobs byte for byte.

A change to the first two digests is a change to what the defaults store: make it on purpose,
measure it (bench/quality.py), and pin the new digests with ``python tests/test_golden_defaults.py``.
A version's name does not change them."""

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
from kdnctl.quant.entropy import decode_role_ints

DOC, N_TOKENS = "faq.md", 300
# The digests depend on the machine's float arithmetic (its vector instructions, and whether it
# computes bf16 natively: surprisal's vocabulary projection runs in bf16 there, fp32 elsewhere,
# kdnctl.engine.prefill.native_bf16, and the BLAS kernels its vendor gets), so they are pinned per
# kind of machine (``machine_kinds``: with the CPU's family and model, with the vendor alone, or
# without): a machine of another kind skips the pinned comparison (pin its digests with
# ``python tests/test_golden_defaults.py``).
# machine kind -> budget -> (sha256 of every chunk's tensors, codes as integers; sha256 of every
# chunk's meta without name and stamps; sha256 of every chunk's code blobs)
# Pinned after spread bins became one octave wide (every kind's stored bytes moved; the kinds
# pinned before wait to be pinned again on a machine of their kind); 0.083 again after its steps
# came from the model's Fisher profile.
GOLDEN = {
    "GenuineIntel-6-167-AVX512-bf16": {
        0.25: ("9bdfe68d5f0277137db52964de164170e19314d58c2627b3dab8fe4df7f309d7",
               "4941121e5323e638c46e158a16f12a351976380b4f961c2b7f9bbb64a28adbec",
               "2f1b7457220b4357cd5b80f512ff15cc3e150d83b270141c82eb34f9881642b8"),
        0.083: ("9518d1aa450dcab290f28661163c5ac59ed1ecc7d4d2574b6fddcbc6d4cfe7a6",
                "430a809f16a5262370bd35961b91ea423a42565215c6dd4a1dadcee79716dbcb",
                "194738f7ac4b639a98b652ddffb39f35dbc0afd43f402bc50ef5b8ccf8d01153"),
    },
    "AuthenticAMD-AVX512-bf16": {
        0.25: ("43acd38a45b7931c9f3f0aae34ff49f4f6e0f3d548b8c2d68ee2cb769e5f0450",
               "725ebd26994a69b3348f2502eb328b5ad34e3cb501412bada338b5f3737df9dc",
               "fd539dff1ee9123b61cd9e983be3ffefadd66a9efe060daefdc1fcc0f4a430ba"),
        0.083: ("e800ee3c76a729d1488a13967040d5d1ed6673aa6ea873cf5d3b1422160a4db3",
                "59e7740aa33afaffed237bf20d8c3ea3c2b68f1275be595654fa23042017575a",
                "f09c1cf2af0468f7192524399db1cd860693fa02b4c02bd89e67dcd069e01cb3"),
    },
}
BUDGETS = (0.083, 0.25)


def machine_kinds() -> tuple[str, str, str]:
    """This machine's kinds, the most specific first: with its CPU vendor, family and model, with
    its vendor alone, and without (``GenuineIntel-6-167-AVX512-bf16``, ``AuthenticAMD-AVX2-fp32``,
    ``AVX2-fp32``). Digests are pinned under the first where machines of one vendor and vector
    width still differ in their matmuls (Intel's AMX runs bf16 where another AVX-512 part does not)."""
    from kdnctl.engine.prefill import native_bf16

    kind = f"{torch.backends.cpu.get_cpu_capability()}-{'bf16' if native_bf16('cpu') else 'fp32'}"
    info = {"vendor_id": "unknown", "cpu family": "?", "model": "?"}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() in info and info[k.strip()] in ("unknown", "?"):
                    info[k.strip()] = v.strip()
    except OSError:
        pass
    vendor = info["vendor_id"]
    return f"{vendor}-{info['cpu family']}-{info['model']}-{kind}", f"{vendor}-{kind}", kind


def pinned_digests(budget: float):
    """The digests pinned for this kind of machine (the vendor's own first), or None."""
    return next((GOLDEN[k][budget] for k in machine_kinds() if budget in GOLDEN.get(k, {})), None)


# The writer's stamp (`created`, a float whose printed length varies) counts toward the byte cap
# the scale is fitted to: a fixed stamp makes what a recipe stores a function of its input alone.
STAMP = "1764000000"
NAME_KEYS = ("label",)  # the only metadata a version's name may change


def _update(h, name: str, t: torch.Tensor) -> None:
    t = t.contiguous()
    h.update(f"{name}|{t.dtype}|{list(t.shape)}\n".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def tensor_digests(tensors: dict[str, torch.Tensor], meta: dict) -> tuple[str, str]:
    """(sha256 over every tensor's name, dtype, shape and bytes, in name order, each ec code blob
    as its int16 codes ``[H * D, T]``; sha256 over the code blobs' bytes)."""
    q = meta.get("quant") or {}
    decoded, blobs = hashlib.sha256(), hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith(".codes") and q.get("scheme") == "ec":
            _update(blobs, name, t)
            layer = int(name.split(".")[1])
            n_tokens = layer_tokens(tensors, layer)
            t = decode_role_ints(t, tensors[name[:-len("codes")] + "params"], q["n_heads"], q["head_dim"], n_tokens,
                                 name, q["coding"])[0].to(torch.int16)
        _update(decoded, name, t)
    return decoded.hexdigest(), blobs.hexdigest()


def layer_tokens(tensors: dict[str, torch.Tensor], layer: int) -> int:
    pos = tensors.get(f"layers.{layer}.positions")
    return int((pos if pos is not None else tensors["positions"]).shape[-1])


def meta_digest(meta: dict) -> str:
    kept = {k: v for k, v in meta.items() if k not in STAMPED_META_KEYS and k not in NAME_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def version_digests(st, label: str) -> tuple[str, str, str]:
    tensors, metas, blobs = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    for c in st.get_version(DOC, label).chunks:
        b = decode_bundle(st.read_object(c.object))
        decoded, blob = tensor_digests(b.tensors, b.meta)
        tensors.update(decoded.encode())
        metas.update(meta_digest(b.meta).encode())
        blobs.update(blob.encode())
    return tensors.hexdigest(), metas.hexdigest(), blobs.hexdigest()


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


@pytest.mark.parametrize("budget", BUDGETS)
def test_default_stores_the_pinned_tensors(lm, store, budget):
    pinned = pinned_digests(budget)
    if pinned is None:
        pytest.skip(f"no digests pinned for b{budget} on a {machine_kinds()[0]} machine")
    with store.writer():
        label = compress_document(store, DOC, CompressRecipe(budget=budget), lm=lm).label
    assert version_digests(store, label) == pinned


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
    print(f"    {machine_kinds()[0]!r}: {{")
    for b in BUDGETS:
        with st.writer():
            made = compress_document(st, DOC, CompressRecipe(budget=b), lm=model).label
        print(f"        {b}: {version_digests(st, made)!r},  # {made}")
    print("    },")


OLD_NAMES = {0.25: "ec-b0.25-p64-lliterals0.3x2k", 0.083: "ec-b0.083-k0.5-p32-lliterals0.3x2k-rf0.01hdf-sentences-gap"}


def test_versions_under_their_old_names_still_load_and_answer(lm, store):
    """A store compressed before versions had short names holds the defaults under their old
    names (the recipe spelled out): they load by those names, store what b0.25 stores, and
    compressing with the default again makes b0.25 beside them."""
    from conftest import run_cli

    with store.writer():
        old = compress_document(store, DOC, CompressRecipe(budget=0.25), lm=lm, label=OLD_NAMES[0.25])
        compress_document(store, DOC, CompressRecipe(budget=0.25), lm=lm, label="b0.25-again")
    assert old.status == "compressed" and version_digests(store, OLD_NAMES[0.25]) == version_digests(store, "b0.25-again")
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
