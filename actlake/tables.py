"""What actlake may call a table, and the name of a reduced table's partials."""

from __future__ import annotations

import re

TABLE_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")
"""Lower-case letters, digits and underscores, a letter first (a plain SQL identifier, a safe folder name)."""

PARTIAL_SUFFIX = "_partial"
"""A commit group's partial of an analysis's reduced table ``t`` is table ``t + PARTIAL_SUFFIX``."""


def is_table_name(name: str) -> bool:
    """A name actlake can give a table (:data:`TABLE_NAME`)."""
    return bool(TABLE_NAME.fullmatch(name))
