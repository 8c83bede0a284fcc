"""The store: content-addressed objects + an LMDB catalog, and the ReadStore interface.

- records.py     ChunkRef / DocumentRecord / VersionRecord and their one validating ``from_dict``
- catalog.py     the LMDB file: checked before mapping, created atomically, shared per process
- local.py       Store: objects, commits; ObjectDir: the objects alone (distributed workers)
- reads.py       catalog reads (every record checksum-checked and validated)
- maintenance.py verify and gc (grace period)
- protocol.py    ReadStore (what readers need), implemented by Store and client.RemoteStore
"""

from .catalog import DBS, MAP_SIZE, SCHEMA_VERSION
from .local import ObjectDir, Store, default_store_root
from .reads import chunk_sizes_of
from .maintenance import DEFAULT_GRACE_S, TMP_GRACE_S, VerifyReport
from .protocol import LocalObjects, ReadStore, read_bundle_meta
from .records import (
    CATALOG_HINT,
    SEP,
    SHA_RE,
    ChunkRef,
    DocumentRecord,
    VersionRecord,
    bundle_mismatch,
    check_id,
    check_sha,
    is_sha,
)

__all__ = [
    "CATALOG_HINT", "DBS", "DEFAULT_GRACE_S", "MAP_SIZE", "SCHEMA_VERSION", "SEP", "SHA_RE", "TMP_GRACE_S",
    "ChunkRef", "DocumentRecord", "LocalObjects", "ObjectDir", "ReadStore", "Store", "VerifyReport", "VersionRecord",
    "bundle_mismatch", "check_id", "read_bundle_meta", "check_sha", "chunk_sizes_of", "default_store_root", "is_sha",
]
