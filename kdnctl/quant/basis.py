"""Key bases: per-model principal axes that ``ec`` codes keys in (option ``key_basis=model``, format 1.7).

The channels of one head's keys are strongly correlated (a key is ``W_k`` times a hidden state),
so an entropy coder spends bits on redundancy that a rotation into principal axes removes:
energy piles into a few axes and the rest code to nearly all zeros. ``ec`` rotates each head's
keys in its step-normalised space ``u = (x - mean) / step`` (every channel one step wide, steps
``~ 1/sqrt(query energy)``), so an orthonormal basis leaves ec's attention-weighted error as it
is and changes only the rate. Measured on stored bytes (``research/probes/basis_probe.py``, the library's
own frames): axes calibrated on *other* documents cut the keys' code bytes by ~16%; a document's
or chunk's own axes cost more to store than they save, so a basis is a per-model asset, made
once from real text (``scripts/calibrate_key_basis.py``) and named by the sha256 of its file.

A basis file is safetensors with one float32 tensor ``basis [L, H, D, D]`` (columns are axes,
largest variance first). Bundles name it (``meta["quant"]["key_basis"]``); encoder and decoder
use the very same float32 matrix, read from the registry: ``kdnctl/bases/`` (shipped with the
package) and the directories in ``$KDNCTL_KEY_BASES`` (``os.pathsep``-separated). Each holds
``<sha256>.safetensors`` and ``index.json`` mapping model fingerprints to a basis.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from kdnctl.errors import BundleFormatError, UsageError

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "bases"
ENV = "KDNCTL_KEY_BASES"
ORTHO_TOL = 1e-4  # |U^T U - I| a stored basis may show (float32 rounding of float64 axes: ~1e-6)


def registry_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    return extra + [PACKAGE_DIR]


# Bases this process took from a store (kdnctl/quant/store_basis.py): sha256 -> file bytes (content
# addressed: harmless to keep), and, only while a compress for that store runs (``model_basis``),
# model fingerprint -> sha256. Directories win; a store only adds what they lack.
_FROM_STORE: dict[str, bytes] = {}
_STORE_FOR_MODEL: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("store_for_model", default={})


def basis_for_model(fingerprint: str) -> str | None:
    """The sha256 of the key basis registered for ``fingerprint`` (a basis directory, else a store
    basis this process was given), or None."""
    found = shipped_basis_for_model(fingerprint)
    return found if found is not None else _STORE_FOR_MODEL.get().get(fingerprint)


def shipped_basis_for_model(fingerprint: str) -> str | None:
    """The sha256 of the basis a basis directory (shipped, or ``$KDNCTL_KEY_BASES``) maps ``fingerprint`` to."""
    for d in registry_dirs():
        index = d / "index.json"
        if index.is_file():
            try:
                found = json.loads(index.read_text()).get(fingerprint)
            except (OSError, ValueError, AttributeError):
                raise UsageError(f"{index} is not a JSON object of fingerprint -> basis sha256",
                                 hint=f"fix or remove it (${ENV} names extra basis directories)") from None
            if found:
                return found
    return None


def encode_basis(basis: torch.Tensor, fingerprint: str | None = None) -> bytes:
    """The basis file's bytes; a store basis also names its model (``rebuild-catalog`` reads it back)."""
    from safetensors.torch import save

    meta = {"kdnctl": "key_basis"} if fingerprint is None else {"kdnctl": "key_basis", "fingerprint": fingerprint}
    return save({"basis": basis.float().contiguous()}, metadata=meta)


def decode_basis(data: bytes, what: str) -> tuple[torch.Tensor, str | None]:
    """(basis, the model fingerprint its file names or None) of a basis file's bytes, checked."""
    from safetensors.torch import load

    try:
        basis = load(bytes(data))["basis"]
        header_len = int.from_bytes(bytes(data[:8]), "little")
        meta = json.loads(bytes(data[8:8 + header_len])).get("__metadata__") or {}
    except Exception as exc:  # safetensors raises its own error types
        raise BundleFormatError(f"{what} is not a readable key basis file: {str(exc)[:120]}") from None
    if meta.get("kdnctl") != "key_basis":
        raise BundleFormatError(f"{what} is not a key basis file")
    check_basis(basis, what)
    fp = meta.get("fingerprint")
    return basis, fp if isinstance(fp, str) else None


def provide(data: bytes) -> str:
    """Make a store basis file known to this process (``load_basis`` finds it); checked first.
    Returns its sha256."""
    data = bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    if sha not in _FROM_STORE:
        decode_basis(data, f"key basis {sha[:12]}")
        _FROM_STORE[sha] = data
    return sha


@contextlib.contextmanager
def model_basis(fingerprint: str, sha: str | None):
    """Within the block, ``basis_for_model(fingerprint)`` is ``sha`` where no basis directory has
    one (a compress for a store whose basis it is; nothing with ``sha`` None)."""
    if sha is None:
        yield
        return
    token = _STORE_FOR_MODEL.set({**_STORE_FOR_MODEL.get(), fingerprint: sha})
    try:
        yield
    finally:
        _STORE_FOR_MODEL.reset(token)


def known(sha: str) -> bool:
    """Whether ``load_basis(sha)`` finds a file without asking a store."""
    if not is_sha(sha):
        return False
    return sha in _FROM_STORE or any((d / f"{sha}.safetensors").is_file() for d in registry_dirs())


def is_sha(sha) -> bool:
    return isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)


def forget_provided() -> None:
    """Drop the store bases this process was given (tests: a fresh process)."""
    _FROM_STORE.clear()
    clear_caches()


def register(basis: torch.Tensor, fingerprint: str, directory: Path) -> str:
    """Write ``basis`` into ``directory`` (file named by its sha256, written atomically) and map
    ``fingerprint`` to it in the directory's ``index.json``; returns the sha256."""
    check_basis(basis, "new basis")
    data = encode_basis(basis)
    sha = hashlib.sha256(data).hexdigest()
    directory.mkdir(parents=True, exist_ok=True)
    index_path = directory / "index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    index[fingerprint] = sha
    for path, payload in ((directory / f"{sha}.safetensors", data),
                          (index_path, (json.dumps(index, indent=1, sort_keys=True) + "\n").encode())):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    clear_caches()
    return sha


def clear_caches() -> None:
    """Forget bases read so far (after registering one, or in tests that remove a file)."""
    load_basis.cache_clear()
    from kdnctl.quant import entropy

    entropy._basis_on.cache_clear()


def check_basis(basis: torch.Tensor, what: str) -> None:
    if basis.dim() != 4 or basis.shape[-1] != basis.shape[-2] or basis.dtype != torch.float32:
        raise BundleFormatError(f"{what}: a key basis must be float32 [L, H, D, D], got {basis.dtype} {list(basis.shape)}")
    eye = torch.eye(basis.shape[-1])
    err = float((basis.transpose(-1, -2) @ basis - eye).abs().amax()) if basis.numel() else 0.0
    if not err <= ORTHO_TOL:
        raise BundleFormatError(f"{what}: its axes are not orthonormal (|U^T U - I| = {err:.2g})")


@functools.lru_cache(maxsize=8)
def load_basis(sha: str) -> torch.Tensor:
    """The float32 ``[L, H, D, D]`` basis whose file has sha256 ``sha`` (checked on read)."""
    from safetensors.torch import load

    if not is_sha(sha):
        raise BundleFormatError(f"key basis id {str(sha)[:70]!r} is not a sha256")
    for d in registry_dirs():
        path = d / f"{sha}.safetensors"
        if path.is_file():
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != sha:
                raise BundleFormatError(f"key basis file {path} does not match its sha256 (damaged)",
                                        hint="reinstall kdnctl, or restore the file")
            try:
                basis = load(data)["basis"]
            except Exception as exc:  # safetensors raises its own error types
                raise BundleFormatError(f"key basis file {path} is not readable: {exc}") from None
            check_basis(basis, str(path))
            return basis
    if sha in _FROM_STORE:
        return decode_basis(_FROM_STORE[sha], f"key basis {sha[:12]}")[0]
    raise BundleFormatError(f"this bundle's keys are coded in key basis {sha[:12]}, which this kdnctl does not have",
                            hint=f"load it from the store that holds the bundle, use the kdnctl that wrote it, "
                                 f"or add the basis file to a directory in ${ENV}")


def calibrate(samples) -> torch.Tensor:
    """Principal axes ``[L, H, D, D]`` (float32, columns by decreasing variance) of step-normalised
    keys: ``samples`` yields ``u [L, H, T, D]`` (any number of tokens per sample)."""
    cov = None
    for u in samples:
        u = u.double()
        c = u.transpose(-1, -2) @ u
        cov = c if cov is None else cov + c
    if cov is None:
        raise UsageError("calibrating a key basis needs at least one document")
    axes = torch.linalg.eigh(cov)[1].flip(-1)
    # one sign per axis (largest component positive): the same text gives the same file
    idx = axes.abs().argmax(-2, keepdim=True)
    axes = axes * torch.sign(torch.gather(axes, -2, idx))
    return axes.float().contiguous()


def key_samples(lm, token_lists, chunk_tokens: int = 256):
    """Step-normalised keys ``u [L, H, T, D]`` of each document (``token_lists``: token ids),
    what :func:`calibrate` takes: keys before RoPE (the key projection's output, what ``ec`` stores),
    each chunk's mean removed, divided by ec's relative steps from the document's own queries."""
    from kdnctl.allocate.rate import relative_steps
    from kdnctl.models import adapter_for
    from kdnctl.quant.sensitivity import key_weights

    adapter = adapter_for(lm.model)
    n_layers, h, d = adapter.n_layers, adapter.n_kv_heads, adapter.head_dim
    for ids in token_lists:
        keys: list = [None] * n_layers

        def grab(i, _role, k):
            keys[i] = k.float().cpu().transpose(0, 1)

        with adapter.capture(("k",), on=grab), torch.no_grad():
            adapter.decoder(torch.tensor([list(ids)], device=lm.model.device), use_cache=False)
        w = key_weights(lm, list(ids), n_layers, h, d)
        u = []
        for i, x in enumerate(keys):
            step = relative_steps(x, w[i]).clamp_min(1e-6)
            centred = torch.cat([c - c.mean(1, keepdim=True) for c in x.split(chunk_tokens, 1)], 1)
            u.append(centred / step[:, None, :])
        yield torch.stack(u)
