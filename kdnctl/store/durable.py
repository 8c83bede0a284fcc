"""Durable file writes: the one way kdnctl puts a file on disk so that a crash leaves either the
old file or the whole new one (temp file in the same directory, fsync, rename, fsync the
directory). Catalog commits then refer only to files that are already durable."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, chunks, *, mode: int = 0o644) -> int:
    """Write ``chunks`` (bytes-like pieces) to ``path`` with permissions ``mode``: temp file in
    the same directory, fsync, rename, fsync the directory. Returns the number of bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    n = 0
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            for piece in chunks:
                f.write(piece)
                n += len(memoryview(piece).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return n


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable. Filesystems that cannot fsync a
    directory (EINVAL, ENOTSUP) are accepted; any other failure is raised."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
