"""Fisher profile records: a model's profile (kdnctl/allocate/fisher_profile.py), measured on the
store's own documents the first time a compress needs it.

One sealed entry in the catalog's ``meta`` database, ``fisher/<model fingerprint>`` ->
``{"profile": base64 of the profile file, "created", "source"}``, written in one txn. A profile
only steers how a compress spends its bytes; no bundle names it and no load reads it, so it
holds no object: ``gc`` has nothing to keep for it, ``rebuild-catalog`` leaves it out (the next
compress measures it again on the same documents), and ``verify`` checks that it reads.
"""

from __future__ import annotations

import base64
import binascii
import sys
import time
from dataclasses import dataclass, field

import torch

from kdnctl.errors import BundleFormatError, StoreCorruptError
from kdnctl.format.fisher_profile import decode

from . import catalog as cat
from .bases import _seal, unseal_model_record
from .records import CATALOG_HINT

KIND = "fisher"  # meta key prefix


@dataclass(frozen=True)
class ProfileRecord:
    fingerprint: str
    data: bytes  # the profile file
    profile: torch.Tensor = field(compare=False)  # what it holds, checked (records compare by their bytes)
    created: float
    source: str  # how it was made (one line)


def parse(key_parts: list[str], raw: bytes) -> ProfileRecord:
    """A profile record from its meta entry; damage -> StoreCorruptError."""
    what = f"Fisher profile record {'/'.join(key_parts)[:80]}"
    try:
        d = unseal_model_record(raw, what)
        data = base64.b64decode(d["profile"], validate=True)
        profile = decode(data, what)
    except (ValueError, UnicodeDecodeError, TypeError, KeyError, binascii.Error, BundleFormatError):
        raise StoreCorruptError(f"{what} is damaged", hint=CATALOG_HINT) from None
    created, source = d.get("created"), d.get("source", "")
    if (len(key_parts) != 2 or not key_parts[1] or not isinstance(created, (int, float)) or isinstance(created, bool)
            or not isinstance(source, str)):
        raise StoreCorruptError(f"{what} is damaged", hint=CATALOG_HINT)
    return ProfileRecord(key_parts[1], data, profile, float(created), source)


def profile_record(store, fingerprint: str) -> ProfileRecord | None:
    """The store's Fisher profile record for ``fingerprint``, or None."""
    with store._env.begin() as txn:
        raw = txn.get(cat.key(KIND, fingerprint), db=store._db["meta"])
    return None if raw is None else parse([KIND, fingerprint], raw)


def commit_profile(store, fingerprint: str, data: bytes, source: str) -> None:
    """Record the profile file ``data`` for ``fingerprint`` in one txn and say so on stderr in
    one line. Takes the writer lock."""
    now = time.time()
    rec = {"profile": base64.b64encode(bytes(data)).decode("ascii"), "created": now, "source": source[:200]}
    with store.writer(), store._env.begin(write=True) as txn:
        txn.put(cat.key(KIND, fingerprint), _seal(rec), db=store._db["meta"])
        store._stamp_commit(txn, now)
    print(f"Fisher profile {source} for model {fingerprint[:12]}; stored in {getattr(store, 'root', 'the store')}",
          file=sys.stderr)
