"""actlake: distributed batch analysis of transformer internals.

Public entry points::

    import actlake
    con = actlake.open_run("runs/quickstart")   # DuckDB connection, one view per table
    con.sql("SELECT layer, avg(norm) FROM residual_norms GROUP BY layer").show()
    both = actlake.open_runs(["runs/a", "runs/b"])  # the same views, a leading column run
"""

from actlake.errors import ActlakeError, ConfigError, CorpusError, ModelLoadError, QueryError, StorageError

__version__ = "0.1.0"

__all__ = [
    "ActlakeError",
    "ConfigError",
    "CorpusError",
    "ModelLoadError",
    "QueryError",
    "StorageError",
    "open_run",
    "open_runs",
    "query",
]


def open_run(run_dir, **kwargs):
    """Open a run directory as a read-only DuckDB connection (see ``actlake.storage.sql.open_run``)."""
    from actlake.storage.sql import (  # actlake.storage.sql imports this module; loads pyarrow: imported when used
        open_run as _open_run,
    )

    return _open_run(run_dir, **kwargs)


def open_runs(run_dirs, **kwargs):
    """Open several runs side by side: every view gains a leading column ``run`` (see ``actlake.storage.sql.open_runs``)."""
    from actlake.storage.sql import (  # actlake.storage.sql imports this module; loads pyarrow: imported when used
        open_runs as _open_runs,
    )

    return _open_runs(run_dirs, **kwargs)


def query(run_dir, sql, **kwargs):
    """Run one read-only SQL statement over a run and return a pyarrow Table."""
    from actlake.storage.sql import (  # actlake.storage.sql imports this module; loads pyarrow: imported when used
        query as _query,
    )

    return _query(run_dir, sql, **kwargs)
