"""Sizes people write (``30GiB``, ``500 MB``) as bytes: for the config and the command line alike,
without importing either (``actlake sql`` starts with this alone)."""

from __future__ import annotations

import re

MEMORY_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
"""Units of ``model.max_memory`` values (case-insensitive; bytes, never bits)."""


def memory_bytes(value: int | str) -> int:
    """A ``max_memory`` value (bytes, or e.g. ``"30GiB"``, ``"500 MB"``) as a whole number of bytes;
    ValueError for anything else."""

    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", str(value))
        if not m or m.group(2).upper() not in MEMORY_UNITS:
            raise ValueError(f"expected bytes or a size such as 30GiB or 500MB, got {value!r}")
        n = int(float(m.group(1)) * MEMORY_UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"must be more than 0 bytes, got {value!r}")
    return n
