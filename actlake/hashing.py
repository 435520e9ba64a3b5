"""Deterministic sampling by hashing: the same item is in or out whatever the sharding or order."""

from __future__ import annotations

import hashlib


def unit_hash(key: str) -> float:
    """A number in [0, 1) fixed by ``key`` (blake2b); ``unit_hash(key) < fraction`` samples ``fraction``."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64
