"""Bundle headers: the safetensors JSON header and the kdnctl metadata inside it.

Split from ``bundle.py`` (which re-exports these names): parsing and checking the header is
shared by the general decoder, the header-only readers and the cached-layout reader
(kdnctl/format/layout.py)."""

from __future__ import annotations

import json
import re
import struct
from typing import Any

from kdnctl.errors import BundleFormatError

SUPPORTED_MAJOR = 1

# safetensors __metadata__ keys kdnctl writes. The header digest guards the metadata and the
# tensor index (names, dtypes, shapes): a single flipped byte in the header could otherwise
# change a doc id or a dtype and still parse. Payload bytes are guarded by the content
# address of the object in the store.
META_KEY = "kdnctl"
DIGEST_KEY = "kdnctl_sha256"
ALLOWED_METADATA_KEYS = {META_KEY, DIGEST_KEY}

# A header larger than this is certainly a corrupted length field, not a real bundle
# (a 30-layer bundle header is a few KB); refusing early avoids a huge allocation.
MAX_HEADER = 64 << 20


def parse_header(data, total: int | None = None) -> dict[str, Any]:
    """The JSON header of a bundle whose first bytes are ``data`` (the whole bundle, or at least
    its header when ``total``, the bundle's length, is given)."""
    total = len(data) if total is None else total
    if len(data) < 8:
        raise BundleFormatError(f"bundle is truncated ({len(data)} bytes, not even a header length)")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > MAX_HEADER or 8 + n > total or 8 + n > len(data):
        raise BundleFormatError(
            f"bundle is truncated or not a safetensors file (header length {n}, {total} bytes)"
        )
    try:
        header = json.loads(bytes(data[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BundleFormatError("bundle header is not valid safetensors JSON (corrupted?)") from None
    if not isinstance(header, dict):
        raise BundleFormatError("bundle header is not a JSON object (corrupted?)")
    return header


def load_meta(header: dict[str, Any]) -> tuple[dict[str, Any], str, str | None]:
    md = header.get("__metadata__")
    if not isinstance(md, dict) or META_KEY not in md:
        raise BundleFormatError("not a kdnctl bundle: safetensors metadata has no 'kdnctl' entry")
    unknown = sorted(set(md) - ALLOWED_METADATA_KEYS)
    if unknown:
        raise BundleFormatError(f"unexpected safetensors metadata key(s) {unknown} (corrupted?)")
    meta_json = md[META_KEY]
    try:
        meta = json.loads(meta_json)
    except (TypeError, ValueError, RecursionError):
        raise BundleFormatError("bundle metadata 'kdnctl' is not valid JSON (corrupted?)") from None
    if not isinstance(meta, dict):
        raise BundleFormatError("bundle metadata 'kdnctl' is not a JSON object")
    return meta, meta_json, md.get(DIGEST_KEY)


def check_version(meta: dict[str, Any]) -> None:
    v = meta.get("format_version")
    m = re.fullmatch(r"(\d{1,9})\.(\d{1,9})", v) if isinstance(v, str) else None
    if m is None:
        raise BundleFormatError(f"bundle format_version {v!r} is not 'major.minor'")
    if int(m.group(1)) != SUPPORTED_MAJOR:
        raise BundleFormatError(
            f"bundle format version {v} is not supported (this reader supports "
            f"{SUPPORTED_MAJOR}.x); upgrade kdnctl or re-ingest"
        )


def header_size(first8: bytes) -> int:
    """Bytes a bundle's header occupies (8-byte length + JSON), from its first 8 bytes."""
    if len(first8) < 8:
        raise BundleFormatError(f"bundle is truncated ({len(first8)} bytes, not even a header length)")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER:
        raise BundleFormatError(f"bundle header length {n} is not plausible (corrupted?)")
    return 8 + n


def read_meta(head: bytes) -> dict[str, Any]:
    """A bundle's kdnctl metadata from its first ``header_size`` bytes, tensors unread.

    Only as trustworthy as the bytes: use it on verified objects (the store's content address)."""
    meta, _, _ = load_meta(parse_header(bytes(head)))
    check_version(meta)
    return meta
