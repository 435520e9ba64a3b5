"""What actlake may call a table, the name of a reduced table's partials and of its rows by source."""

from __future__ import annotations

import re

TABLE_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")
"""Lower-case letters, digits and underscores, a letter first (a plain SQL identifier, a safe folder name)."""

PARTIAL_SUFFIX = "_partial"
"""A commit group's partial of an analysis's reduced table ``t`` is table ``t + PARTIAL_SUFFIX``."""


BY_SOURCE_SUFFIX = "_by_source"
"""With ``analyses.by_source``: a reduced table or view ``t`` by its name holds the rows over every document,
``t + BY_SOURCE_SUFFIX`` every source label's rows and those (``actlake sql``, ``open_run``)."""
SOURCE = "source"
"""The column of a reduced table that names the document source its rows are over."""
ALL_SOURCES = "*"
"""The ``source`` of the rows over every document."""
PASS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""What an intervention may be called (its rows' ``intervention`` label)."""
INTERVENTION = "intervention"
"""With ``interventions:``: the column of a statistics table that names the pass its rows are of."""
CLEAN = "none"
"""The ``intervention`` of the clean pass's rows (equal to a run without interventions)."""
EFFECTS = "intervention_effects"
"""With ``interventions:``: the table of each intervention's paired effects (its rows name the intervention, not a
pass: shown whole by its name)."""
BY_INTERVENTION_SUFFIX = "_by_intervention"
"""With ``interventions:``: a table or view ``t`` by its name holds the clean pass's rows, ``t + BY_INTERVENTION_SUFFIX``
every pass's, with a leading ``intervention`` column (``actlake sql``, ``open_run``)."""


def is_table_name(name: str) -> bool:
    """A name actlake can give a table (:data:`TABLE_NAME`)."""
    return bool(TABLE_NAME.fullmatch(name))
