"""DuckDB over a run's committed Parquet files: one view per table, read-only and locked down.

Each table is a view over exactly the files of the run's manifest
(:func:`actlake.storage.manifest.committed_files`), named as ``actlake-ro://`` URLs served by a
read-only file system (:mod:`actlake.storage.readonly_fs`). DuckDB may touch those URLs only
(``allowed_paths``; ``enable_external_access = false``, no allowed directories), and since DuckDB
would let a connection write to an allowed path, that file system opens them for reading only.
Its own database is an empty read-only one, it spills into a private temporary folder of
bounded size, and its configuration is locked: whatever statement runs on the connection, it
cannot write a file, nor read one the manifest does not list.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import warnings
import weakref
from pathlib import Path

from actlake.errors import QueryError, StorageError
from actlake.fs import arrow, location
from actlake.storage.layout import CHECKPOINTS_DIR, RunLayout, sweep_checkpoints
from actlake.storage.manifest import committed_files, is_table_name, read_run, recorded_views, reduced_tables
from actlake.storage.readonly_fs import ReadOnlyFiles, url
from actlake.storage.sql_process import MAX_TEMP_SIZE  # one default for open_run and actlake sql
from actlake.storage.verified import verify_files
from actlake.tables import ALL_SOURCES as ALL
from actlake.tables import BY_INTERVENTION_SUFFIX, BY_SOURCE_SUFFIX, CLEAN, EFFECTS, INTERVENTION, PASS_NAME, SOURCE


def derived_views(layout: RunLayout) -> dict[str, tuple[str, str]]:
    """View name -> (source table, SELECT): the views the job's analyses (built in and custom) declared over
    their tables, as its reduce record names them; created when the source table has committed files.
    Querying a run imports no analysis (no torch) and never code named in the run folder."""
    return recorded_views(layout)


READ_ONLY_STATEMENTS = {"SELECT"}
"""Statement types ``query`` runs; ``EXPLAIN`` / ``EXPLAIN ANALYZE`` of one of them too."""

_EXPLAIN_PREFIX = re.compile(r"\s*EXPLAIN(\s+ANALYZE)?\s+", re.IGNORECASE)



def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _first_line(e: Exception) -> str:
    """DuckDB's message on one line: its first paragraph, hints included (``Did you mean "attention_mass"?``,
    ``Candidate bindings: …``); the ``LINE 1:`` pointer after it is left out."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return " ".join(line.strip() for line in text.split("\n\n")[0].splitlines() if line.strip())


def _parse(sql: str) -> list:
    """DuckDB's own parse of ``sql`` into statements."""
    import duckdb

    try:
        return duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise QueryError(f"cannot parse SQL: {_first_line(e)}") from None


def check_statement(sql: str) -> None:
    """Refuse anything but one SELECT, or EXPLAIN [ANALYZE] of one SELECT.

    Wrapped statements are checked by what they wrap: EXPLAIN's inner statement is parsed again by
    DuckDB and must itself be a SELECT (so ``EXPLAIN ANALYZE COPY …`` is refused); PREPARE, EXECUTE,
    COPY, ATTACH, SET, PRAGMA, CREATE, INSTALL, LOAD, CALL … are refused outright.
    """
    statements = _parse(sql)
    if len(statements) != 1:
        raise QueryError(f"one statement at a time, got {len(statements)}")
    kind = statements[0].type.name
    if kind == "EXPLAIN":
        text = statements[0].query
        prefix = _EXPLAIN_PREFIX.match(text)
        inner = _parse(text[prefix.end():]) if prefix else []
        if len(inner) != 1 or inner[0].type.name not in READ_ONLY_STATEMENTS:
            raise QueryError(f"read-only: EXPLAIN of anything but one SELECT is not allowed: {text.strip()[:80]}")
        return
    if kind == "MULTI":  # DuckDB's form of a PIVOT whose ON has no IN list: it first creates a type (a write)
        raise QueryError("read-only: a PIVOT without the values of its ON column is run by DuckDB as two statements, "
                         "the first creating a type of those values (a write); list them all (SELECT DISTINCT gives them): "
                         "PIVOT ... ON key_category IN ('bos', 'eos', ...) USING ...")
    if kind not in READ_ONLY_STATEMENTS:
        raise QueryError(f"read-only: {kind} statements are not allowed (only SELECT and EXPLAIN SELECT)")


def _file_metadata(path):
    """The Parquet footer of ``path`` (StorageError naming the file if it is not Parquet)."""
    import pyarrow.parquet as pq

    try:
        fs, key = arrow(path)
        with fs.open_input_file(key) as f:
            return pq.read_metadata(f)
    except Exception as e:
        raise StorageError(f"{path}: not a readable Parquet file ({type(e).__name__}: {_first_line(e)})") from None


def _fixed_size_casts(files: list[Path]) -> list[str]:
    """Parquet has no fixed-size list; columns written as one (Arrow schema kept in the file) become FLOAT[d].

    Reads every file's footer, so a committed file that is not Parquet is named before any query. A file with
    no rows says nothing of d (an empty activation sample is written with d = 1); files of one table that
    disagree on d are an error naming both."""
    import pyarrow as pa

    sizes: dict[str, tuple[int, object]] = {}
    empty: dict[str, int] = {}  # a table of empty files only keeps what they say
    for path in files:
        meta = _file_metadata(path)
        for f in meta.schema.to_arrow_schema():
            if not (pa.types.is_fixed_size_list(f.type) and f.type.list_size > 0):
                continue
            if meta.num_rows == 0:
                empty[f.name] = min(empty.get(f.name, f.type.list_size), f.type.list_size)
                continue
            size, first = sizes.setdefault(f.name, (f.type.list_size, path))
            if size != f.type.list_size:
                raise StorageError(f"{path}: column {f.name!r} holds vectors of {f.type.list_size} values, "
                                   f"{first} of {size}")
    found = {name: size for name, (size, _) in sizes.items()} | {n: d for n, d in empty.items() if n not in sizes}
    return [f'CAST({_ident(name)} AS FLOAT[{size}]) AS {_ident(name)}' for name, size in found.items()]


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _view_sql(files: list[Path]) -> str:
    """SELECT over exactly ``files``, read through the read-only file system (hive keys from the folder names)."""

    casts = _fixed_size_casts(files)
    select = f"* REPLACE ({', '.join(casts)})" if casts else "*"
    listed = ", ".join(_quote(url(f)) for f in files)
    return f"SELECT {select} FROM read_parquet([{listed}], hive_partitioning = true, union_by_name = true)"


def _connect(private: str, memory_limit: str, threads: int | None, max_temp_size: str):
    """An empty read-only DuckDB database in ``private``, spilling into ``private/spill``."""
    import duckdb

    db = os.path.join(private, "empty.duckdb")
    duckdb.connect(db).close()
    con = duckdb.connect(db, read_only=True)
    settings = {"temp_directory": os.path.join(private, "spill"), "max_temp_directory_size": max_temp_size,
                "memory_limit": memory_limit, "autoinstall_known_extensions": "false",
                "autoload_known_extensions": "false", "python_enable_replacements": "false",
                "parquet_metadata_cache": "true"}
    if threads:
        settings["threads"] = str(int(threads))
    for name, value in settings.items():
        con.execute(f"SET {name} = {_quote(value)}")
    return con


def _restrict(con, files: list[Path]) -> None:
    """File access only to ``files`` through the read-only file system (the caller then locks the configuration)."""

    con.execute(f"SET allowed_paths = [{', '.join(_quote(url(f)) for f in files)}]")
    con.execute("SET enable_external_access = false")


def _check_view(layout: RunLayout, name: str, sql: str) -> None:
    """A recorded view must be one SELECT under a plain name (the record is a file of the run folder)."""

    try:
        if not is_table_name(name):
            raise QueryError(f"{name!r} is not a view name")
        check_statement(sql)
    except QueryError as e:
        raise StorageError(f"{layout.complete}/reduced.json: view {name!r} refused ({e})") from None


def _without_terminator(sql: str) -> str:
    """One statement without its closing semicolon and what follows it (comments), so that it can stand in a
    subquery; a statement that check_statement passed."""
    import duckdb

    tokens = [(at, kind) for at, kind in duckdb.tokenize(sql) if kind != duckdb.token_type.comment]
    if tokens and sql[tokens[-1][0]] == ";":
        return sql[: tokens[-1][0]]
    return sql


class _Run:
    """One run's committed tables as SELECTs over their files, and its recorded views (checked) over them."""

    def __init__(self, run_dir):
        self.layout = RunLayout(location(run_dir))
        files = committed_files(self.layout)
        if not files:
            raise StorageError(f"{self.layout.root}: no committed tables (has a job finished a shard here?)")
        self.files = [f for fs in files.values() for f in fs]
        self.tables = {t: _view_sql(fs) for t, fs in files.items()}
        labelled = self._over_every_document(reduced_tables(self.layout) & set(files), files)
        self.views = {}
        for name, (source, sql) in derived_views(self.layout).items():
            if source in self.tables and name not in self.tables:
                _check_view(self.layout, name, sql)
                self.views[name] = _without_terminator(sql)
        if labelled:  # analyses.by_source: each view again over every label's rows
            ctes = [(t, labelled[t]) for t in labelled] + list(self.views.items())
            for i, (name, sql) in enumerate(list(self.views.items())):
                self.views[name + BY_SOURCE_SUFFIX] = _with_ctes(ctes[: len(labelled) + i], sql)
        if self.passes:
            self._by_intervention(sorted(self.full), bool(labelled))

    def _by_intervention(self, reduced: list[str], split: bool) -> None:
        """``<name>_by_intervention`` for every reduced table and recorded view: each pass's rows over every document
        (the tables bound to that pass's rows, so a view computes over one pass), under a leading ``intervention``;
        in a ``by_source`` run also ``<name>_by_source_by_intervention``: each pass's rows of every label."""
        recorded = [v for v in self.views if not v.endswith(BY_SOURCE_SUFFIX)]  # as the run recorded them
        out = {}
        for suffix, every_source in [("", False)] + [(BY_SOURCE_SUFFIX, True)] * split:
            for n in reduced + recorded:
                name = n + suffix + BY_INTERVENTION_SUFFIX
                if name in self.tables or name in self.views or not is_table_name(name):
                    raise StorageError(f"{self.layout.root}: {n + suffix!r} has no free name for its rows by "
                                       "intervention")
                arms = []
                for iv in self.passes:
                    bound = [(t, _one_pass(self.full[t], iv, every_source)) for t in reduced]
                    ctes = [(t, q) for t, q in self.tables.items() if t not in self.full] + bound
                    body = dict(bound)[n] if n in self.full else _with_ctes(
                        ctes + [(v, self.views[v]) for v in recorded[: recorded.index(n)]], self.views[n])
                    arms.append(f"SELECT {_quote(iv)} AS {INTERVENTION}, * FROM (\n{body}\n)")
                out[name] = "\nUNION ALL\n".join(arms)
        self.views.update(out)

    def _over_every_document(self, reduced: set, files: dict) -> dict:
        """Make each reduced table's name hold its rows over every document (``source = '*'``) and, in a
        ``by_source`` run, ``<table>_by_source`` every label's rows too; returns those tables' full SELECTs."""
        config = read_run(self.layout).get("config") or {}
        split = bool((config.get("analyses") or {}).get("by_source"))
        self.passes = _passes(self.layout, config.get("interventions"))
        self.full = {t: self.tables[t] for t in sorted(reduced) if t != EFFECTS} if self.passes else {}
        """With interventions: each reduced table's every row (every pass, every source)."""
        labelled = {}
        for t in sorted(reduced):
            if split and not is_table_name(t + BY_SOURCE_SUFFIX) or t + BY_SOURCE_SUFFIX in self.tables:
                raise StorageError(f"{self.layout.root}: table {t!r} has no free name for its rows by source")
            clean = _clean_pass(self.tables[t]) if t in self.full else self.tables[t]
            if split:
                labelled[t] = self.tables[t + BY_SOURCE_SUFFIX] = clean
            self.tables[t] = f"SELECT * FROM ({clean}) WHERE {SOURCE} = {_quote(ALL)}"
        return labelled

    @property
    def name(self) -> str:
        return self.layout.root.name

    def select(self, name: str) -> str:
        """A SELECT of table or view ``name`` of this run alone: a view's tables, and the views recorded before
        it, given to it as common table expressions (several runs share one connection, and their tables one name)."""
        if name in self.tables:
            return self.tables[name]
        views = list(self.views)
        before = list(self.tables.items()) + [(v, self.views[v]) for v in views[: views.index(name)]]
        return _with_ctes(before, self.views[name])


def _passes(layout: RunLayout, interventions) -> list[str]:
    """The passes a run recorded (``none`` first), or [] without interventions; a run.json whose interventions are
    not a list of names (written by hand) is refused naming it."""
    if not interventions:
        return []
    names = [iv.get("name") if isinstance(iv, dict) else None for iv in interventions] \
        if isinstance(interventions, list) else [None]
    if not all(isinstance(n, str) and PASS_NAME.fullmatch(n) and n != CLEAN for n in names) \
            or len(set(names)) < len(names):
        raise StorageError(f"{layout.run_json}: its config's interventions are not a list of distinct names")
    return [CLEAN, *names]


def _clean_pass(sql: str) -> str:
    """A reduced table's rows of the clean pass, without the ``intervention`` column: as in a run without
    interventions."""
    return _one_pass(sql, CLEAN, every_source=True)


def _one_pass(sql: str, intervention: str, every_source: bool = False) -> str:
    """One pass's rows of a reduced table (over every document unless ``every_source``), without the
    ``intervention`` column."""
    rows = "" if every_source else f" AND {SOURCE} = {_quote(ALL)}"
    return f"SELECT * EXCLUDE ({INTERVENTION}) FROM ({sql}) WHERE {INTERVENTION} = {_quote(intervention)}{rows}"


def _with_ctes(ctes: list[tuple[str, str]], sql: str) -> str:
    """``sql`` with ``ctes`` (name, SELECT) as common table expressions: its table names bound to them."""
    if not ctes:
        return sql
    listed = ", ".join(f"{_ident(n)} AS (\n{q}\n)" for n, q in ctes)
    return f"WITH {listed} SELECT * FROM (\n{sql}\n)"


def _side_by_side(con, runs: list[_Run], column: str = "run") -> list[str]:
    """Create, for every table and view of the runs, one view of their rows with a leading ``column`` (the run
    folder's name: ``run``, or ``checkpoint`` in a sweep), where every run has it with the same columns; the
    lines saying which were left out and why."""
    import duckdb

    names = [r.name for r in runs]
    if len(set(names)) < len(names):
        raise StorageError(f"runs opened together need distinct folder names, got {names}")
    notes, every = [], list(dict.fromkeys(n for r in runs for n in list(r.tables) + list(r.views)))
    for name in every:
        missing = [r.name for r in runs if name not in r.tables and name not in r.views]
        if missing:
            notes.append(f"{name}: not offered, missing in {', '.join(missing)}")
            continue
        try:
            columns = [[tuple(c[:2]) for c in con.execute(f"DESCRIBE {r.select(name)}").fetchall()] for r in runs]
        except duckdb.Error as e:  # a recorded view that does not run
            notes.append(f"{name}: not offered, the recorded view does not run ({_first_line(e)})")
            continue
        if column in (c for c, _ in columns[0]):
            notes.append(f"{name}: not offered, it has a column named {column}")
            continue
        differ = next((i for i, cols in enumerate(columns) if cols != columns[0]), None)
        if differ is not None:
            a, b = set(columns[0]), set(columns[differ])
            notes.append(f"{name}: not offered, columns differ: {runs[0].name} has {sorted(a - b) or 'no others'}, "
                         f"{runs[differ].name} has {sorted(b - a) or 'no others'}")
            continue
        union = "\nUNION ALL\n".join(f"SELECT {_quote(r.name)} AS {column}, * FROM (\n{r.select(name)}\n)" for r in runs)
        con.execute(f"CREATE TEMP VIEW {_ident(name)} AS {union}")
    return notes


CHECKPOINT_COLUMNS = (("checkpoint", "VARCHAR"), ("ordinal", "INTEGER"), ("step", "BIGINT"), ("path", "VARCHAR"),
                      ("revision", "VARCHAR"), ("sha256", "VARCHAR"), ("same_as", "VARCHAR"))
"""The ``checkpoints`` table of a sweep (``ordinal``: its place in ``model.checkpoints``, from 0)."""


def _checkpoints_sql(rows: list[dict]) -> str:
    """A SELECT of a sweep's checkpoints (its record's rows) as literal values."""
    def literal(v) -> str:
        return "NULL" if v is None else str(int(v)) if isinstance(v, int) else _quote(str(v))

    values = ", ".join("(" + ", ".join(literal(i if c == "ordinal" else r.get(c)) for c, _ in CHECKPOINT_COLUMNS) + ")"
                       for i, r in enumerate(rows))
    cast = ", ".join(f"{_ident(c)}::{t} AS {_ident(c)}" for c, t in CHECKPOINT_COLUMNS)
    return f"SELECT {cast} FROM (VALUES {values}) AS v({', '.join(_ident(c) for c, _ in CHECKPOINT_COLUMNS)})"


def _open(run_dirs, memory_limit: str = "2GB", threads: int | None = None, max_temp_size: str = MAX_TEMP_SIZE,
          tmp_dir: str | None = None):
    """(connection, cleanup, notes): the locked connection of :func:`open_run` (one run folder) or of
    :func:`open_runs` (a list of them), a callable that closes it and removes its folder, and the lines naming
    the tables and views left out. ``tmp_dir``: where its private folder is made (the system's temporary
    folder by default; ``actlake sql`` passes one its parent process removes, also when it kills the query)."""
    import duckdb

    side_by_side = isinstance(run_dirs, (list, tuple))  # else one run: a path, a URL or an ObjectPath
    column, sweep = "run", None if side_by_side else sweep_checkpoints(location(run_dirs))
    if sweep is not None:  # a checkpoint sweep: its checkpoints' runs side by side
        run_dirs = [location(run_dirs) / CHECKPOINTS_DIR / c["checkpoint"] for c in sweep]
        side_by_side, column = True, "checkpoint"
    runs = [_Run(d) for d in (run_dirs if side_by_side else [run_dirs])]
    if not runs:
        raise StorageError("no run to open")
    every = [f for r in runs for f in r.files]
    verify_files(every)  # page checksums, once per version of a file (storage/verified.py)
    private = tempfile.mkdtemp(prefix="actlake-duckdb-", dir=tmp_dir)
    try:
        con = _connect(private, memory_limit, threads, max_temp_size)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    finalizer = weakref.finalize(con, shutil.rmtree, private, True)

    def cleanup():
        con.close()
        finalizer()

    notes = []
    try:
        con.register_filesystem(ReadOnlyFiles(every))
        if not side_by_side:
            for t, sql in runs[0].tables.items():
                con.execute(f"CREATE TEMP VIEW {_ident(t)} AS {sql}")
            _restrict(con, every)  # the recorded views below are the run folder's text: bound with no access outside
            for name, sql in runs[0].views.items():
                try:  # a view that does not run (a custom one, written wrong) leaves every other name usable
                    con.execute(f"CREATE TEMP VIEW {_ident(name)} AS {sql}")
                except duckdb.Error as e:
                    notes.append(f"{name}: not offered, the recorded view does not run ({_first_line(e)})")
        else:
            _restrict(con, every)
            notes = _side_by_side(con, runs, column)
        if sweep is not None:
            con.execute(f"CREATE TEMP VIEW checkpoints AS {_checkpoints_sql(sweep)}")
        con.execute("SET lock_configuration = true")
    except duckdb.Error as e:
        cleanup()
        where = runs[0].layout.root if len(runs) == 1 else ", ".join(str(r.layout.root) for r in runs)
        raise StorageError(f"{where}: cannot set up the views ({_first_line(e)})") from None
    except BaseException:
        cleanup()
        raise
    return con, cleanup, notes


def open_run(run_dir: str | os.PathLike, memory_limit: str = "2GB", threads: int | None = None,
             max_temp_size: str = MAX_TEMP_SIZE):
    """A DuckDB connection with a view per committed table of the run; it can read nothing else and write nothing.

    Spills go to a private temporary folder (at most ``max_temp_size``), removed when the
    connection is garbage-collected (``query`` removes it when it closes the connection). A recorded view that
    does not run is left out with a warning naming it.
    """
    con, _, notes = _open(run_dir, memory_limit, threads, max_temp_size)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return con


def open_runs(run_dirs: list, memory_limit: str = "2GB", threads: int | None = None,
              max_temp_size: str = MAX_TEMP_SIZE):
    """Several runs side by side: :func:`open_run`'s connection, where each table and view holds every run's rows
    under a leading column ``run`` (the run folder's name). A table or view is offered only where every run has
    it with the same columns; a warning names each one left out and why."""
    con, _, notes = _open(list(run_dirs), memory_limit, threads, max_temp_size)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return con


def query(run_dir, sql: str, timeout_s: float = 60.0, **kwargs):
    """Run one read-only statement over a run (a list of run folders: side by side, as :func:`open_runs`); returns a
    pyarrow Table."""
    import duckdb

    check_statement(sql)
    con, cleanup, _ = _open(run_dir, **kwargs)
    try:
        timer = threading.Timer(timeout_s, con.interrupt)
        timer.start()
        try:
            return con.sql(sql).to_arrow_table()
        except duckdb.InterruptException:
            raise QueryError(f"query stopped after the {timeout_s:g}s time limit") from None
        except duckdb.Error as e:
            raise QueryError(_first_line(e)) from None
        finally:
            timer.cancel()
    finally:
        cleanup()
