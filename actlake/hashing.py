"""Hashing: deterministic sampling (the same item is in or out whatever the sharding or order), files' sha256."""

from __future__ import annotations

import hashlib

from actlake.fs import open_regular


def unit_hash(key: str) -> float:
    """A number in [0, 1) fixed by ``key`` (blake2b); ``unit_hash(key) < fraction`` samples ``fraction``."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def file_sha256(path) -> str:
    """Hex SHA-256 of a local file's bytes, read in 16 MiB blocks (``hashlib.file_digest`` needs Python 3.11); a
    StorageError naming it when it is not a regular file (a FIFO would hang the hash, a device never end it)."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()
