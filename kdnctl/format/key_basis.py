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


def basis_for_model(fingerprint: str) -> str | None:
    """The sha256 of the key basis registered for ``fingerprint``, or None."""
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


def encode_basis(basis: torch.Tensor) -> bytes:
    from safetensors.torch import save

    return save({"basis": basis.float().contiguous()}, metadata={"kdnctl": "key_basis"})


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

    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
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
    raise BundleFormatError(f"this bundle's keys are coded in key basis {sha[:12]}, which this kdnctl does not have",
                            hint=f"use the kdnctl that wrote it, or add the basis file to a directory in ${ENV}")


@functools.lru_cache(maxsize=4)
def basis_on(sha: str, device: str) -> torch.Tensor:
    """A key basis on ``device``, copied there once (not once per chunk)."""
    return load_basis(sha).to(device)
