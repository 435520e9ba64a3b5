"""Compare every view of two runs row by row (values exactly; floats also as the largest relative difference).

    python scripts/compare_runs.py RUN_A RUN_B
    python scripts/compare_runs.py --dump RUN DIR   # every view of RUN as DIR/<view>.parquet

Rows are ordered by every non-float column; the partials' commit-group ids (``group``) are left out: they
are unique by design. Used to show that a refactor leaves every table as it was (docs/benchmarks.md).
A run of an older run format is read by the code that wrote it: dump it with that checkout's Python
(``--dump``, which needs only ``open_run``), then compare the two dumps (a folder of ``.parquet`` files
and no ``run.json`` is read as a dump).
"""

from __future__ import annotations

import math
import os
import sys

import duckdb
import numpy as np
import pyarrow.parquet as pq

from actlake.storage.sql import open_run


def _open(path: str):
    """A run's read-only connection, or a dump's: a view per ``.parquet`` file of the folder."""
    if os.path.exists(os.path.join(path, "run.json")) or not os.path.isdir(path):
        return open_run(path)
    con = duckdb.connect()
    for f in sorted(os.listdir(path)):
        if f.endswith(".parquet"):
            con.execute(f"CREATE VIEW \"{f[:-8]}\" AS SELECT * FROM read_parquet('{os.path.join(path, f)}')")
    return con


def dump(run: str, out: str) -> int:
    """Write every view of ``run`` as ``out/<view>.parquet``; returns how many."""
    con = open_run(run)
    os.makedirs(out, exist_ok=False)
    views = _views(con)
    for v in views:
        pq.write_table(con.sql(f'SELECT * FROM "{v}"').to_arrow_table(), os.path.join(out, f"{v}.parquet"))
    return len(views)


def _views(con) -> list[str]:
    return sorted(r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall())


def compare(a: str, b: str) -> float:
    """Print a line per view; returns the largest relative difference (0: identical, inf: rows or columns differ)."""
    ca, cb = _open(a), _open(b)
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
    if sys.argv[1] == "--dump":
        print(f"{dump(sys.argv[2], sys.argv[3])} views written to {sys.argv[3]}")
    else:
        print("largest relative difference:", compare(sys.argv[1], sys.argv[2]))
