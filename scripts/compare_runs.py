"""Compare every view of two runs row by row (values exactly; floats also as the largest relative difference).

    python scripts/compare_runs.py RUN_A RUN_B

Rows are ordered by every non-float column; the partials' commit-group ids (``group``) are left out: they
are unique by design. Used to show that a refactor leaves every table as it was (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import sys

import numpy as np

from actlake.storage.sql import open_run


def _views(con) -> list[str]:
    return sorted(r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall())


def compare(a: str, b: str) -> float:
    """Print a line per view; returns the largest relative difference (0: identical, inf: rows or columns differ)."""
    ca, cb = open_run(a), open_run(b)
    va, vb = _views(ca), _views(cb)
    worst = 0.0 if va == vb else math.inf
    print("views only in A:", sorted(set(va) - set(vb)), "only in B:", sorted(set(vb) - set(va)))
    for v in sorted(set(va) & set(vb)):
        types = {r[0]: r[1] for r in ca.execute(f"DESCRIBE {v}").fetchall()}
        if list(types) != [r[0] for r in cb.execute(f"DESCRIBE {v}").fetchall()]:
            print(f"{v}: columns differ")
            worst = math.inf
            continue
        cols = [c for c in types if c != "group"]
        keys = [c for c in cols if not types[c].startswith(("DOUBLE", "FLOAT")) and "[" not in types[c]]
        order = ", ".join(f'"{c}"' for c in keys) or "1"
        listed = ", ".join(f'"{c}"' for c in cols)
        sql = f"SELECT {listed} FROM {v} ORDER BY {order}"
        ta, tb = ca.sql(sql).to_arrow_table(), cb.sql(sql).to_arrow_table()
        if ta.num_rows != tb.num_rows:
            print(f"{v}: {ta.num_rows} rows against {tb.num_rows}")
            worst = math.inf
            continue
        rel = 0.0
        for c in cols:
            x, y = ta[c].to_pylist(), tb[c].to_pylist()
            if x == y:
                continue
            try:
                xa = np.array([np.nan if e is None else e for e in x], float)
                ya = np.array([np.nan if e is None else e for e in y], float)
                same_nan = np.array_equal(np.isnan(xa), np.isnan(ya))
                rel = max(rel, float(np.nanmax(np.abs(xa - ya) / np.maximum(np.abs(ya), 1e-300))) if same_nan else math.inf)
            except (TypeError, ValueError):
                rel = math.inf
        worst = max(worst, rel)
        print(f"{v}: {ta.num_rows} rows, " + ("identical" if rel == 0 else f"largest relative difference {rel:.3g}"))
    return worst


if __name__ == "__main__":
    print("largest relative difference:", compare(sys.argv[1], sys.argv[2]))
