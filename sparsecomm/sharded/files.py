"""Durable checkpoint files: write to a temporary name, fsync, rename into place; hash what reached the disk.

What :mod:`sparsecomm.sharded.checkpoint` builds its guarantee on: a file
either is in place whole or is not there under its name, and its size and
sha256 are those of the bytes on disk (the manifest records them, ``verify``
checks them).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Dict, IO

__all__ = ["sha256", "fsync_dir", "atomic_write"]


def sha256(path: str) -> str:
    """The hex sha256 of the file at ``path``, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(directory: str) -> None:
    """Make the renames in ``directory`` durable (best effort: some filesystems cannot fsync a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[IO[bytes]], Any]) -> Dict[str, Any]:
    """Write through ``write(file)`` to a temporary file, fsync, rename over ``path``; return size and sha256."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        # Hash what reached the disk, not what we meant to write.
        info = {"bytes": os.path.getsize(tmp), "sha256": sha256(tmp)}
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(path) or ".")
    return info
