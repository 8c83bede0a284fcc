"""Key basis files: the per-model axes an ``ec`` bundle's keys may be coded in (format 1.7).

A basis file is safetensors with one float32 tensor ``basis [L, H, D, D]`` (columns are axes,
largest variance first), named by the sha256 of its bytes. Bundles name it
(``meta["quant"]["key_basis"]``); encoder and decoder use the very same float32 matrix, read
from the registry: ``kdnctl/bases/`` (shipped with the package) and the directories in
``$KDNCTL_KEY_BASES`` (``os.pathsep``-separated). Each holds ``<sha256>.safetensors`` and
``index.json`` mapping model fingerprints to a basis. How a basis is made:
``kdnctl.quant.basis``.
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
    basis_on.cache_clear()


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


@functools.lru_cache(maxsize=4)
def basis_on(sha: str, device: str) -> torch.Tensor:
    """A key basis on ``device``, copied there once (not once per chunk)."""
    return load_basis(sha).to(device)
