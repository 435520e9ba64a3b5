"""``actlake sql``: one statement in a child process whose limits the operating system enforces.

DuckDB's own limits are advice to DuckDB: ``memory_limit`` does not bound every allocation (a
``list_sort`` of 50 million numbers reached 8 GB under a 2 GB limit) and an interrupt is only seen
between operators (the same query ran 128 s past a 2 s time limit). So the command line runs the
statement in a child process with

- a hard memory cap: the parent reads the child's resident memory every :data:`POLL_S` seconds and
  kills it beyond the memory limit plus :data:`HEADROOM` (Python, Arrow, the batches in flight).
  Resident memory, not address space: DuckDB reserves about a gigabyte of address space it never
  touches, so an ``RLIMIT_AS``/``RLIMIT_DATA`` cap would refuse ordinary queries;
- a wall-clock kill: the parent kills the child at the time limit, whatever it is doing;
- rows streamed: the result is read in batches of :data:`BATCH_ROWS` and written as it comes (CSV,
  JSON lines or Parquet), so a large result never sits whole in memory; the parent relays the
  child's output.

The child reports a failure as one line ``KIND<TAB>message`` on its standard error and exits with
:data:`FAILED`; the parent raises it as a :class:`QueryError` or :class:`StorageError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from actlake.errors import QueryError, StorageError, printable, printable_lines
from actlake.sizes import memory_bytes

MAX_TEMP_SIZE = "4GB"
"""Default bound on what the query may spill into its private temporary folder."""
BATCH_ROWS = 65536
"""Rows per batch read from DuckDB and written to the output."""
HEADROOM = 1 << 30
"""Bytes the child may use beyond DuckDB's memory limit (Python, Arrow, batches in flight)."""
POLL_S = 0.05
"""Seconds between two readings of the child's resident memory and clock."""
TABLE_ROWS = 200
"""Rows the ``table`` format shows."""
FAILED = 3
"""The child's exit status when it reports a failure."""


def run_sql(run_dir: str | list[str], sql: str, fmt: str, output: str | None, timeout_s: float, memory_limit: str,
            max_temp_size: str) -> None:
    """Run ``sql`` over ``run_dir`` (a list: those runs side by side, :func:`~actlake.storage.sql.open_runs`) in a
    child process and write its rows to standard output (or ``output`` for Parquet) in ``fmt``; the lines naming
    views left out go to standard error. QueryError/StorageError for what failed, the time limit or the memory cap."""

    cap = memory_bytes(memory_limit) + HEADROOM
    # the child's DuckDB folder and spills: removed here, also when the child was killed at a limit
    scratch = tempfile.mkdtemp(prefix="actlake-query-")
    try:
        _run_child(run_dir, sql, fmt, output, timeout_s, memory_limit, max_temp_size, cap, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_child(run_dir, sql: str, fmt: str, output: str | None, timeout_s: float, memory_limit: str,
               max_temp_size: str, cap: int, scratch: str) -> None:
    import psutil

    job = {"run_dir": [str(r) for r in run_dir] if isinstance(run_dir, list) else str(run_dir), "sql": sql,
           "fmt": fmt, "output": output, "memory_limit": memory_limit, "max_temp_size": max_temp_size,
           "tmp_dir": scratch}
    proc = subprocess.Popen([sys.executable, "-m", "actlake.storage.sql_process"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    part = output and _part_path(output, proc.pid)
    err: list[bytes] = []
    closed = threading.Event()  # the reader of standard output went away (`| head`)
    relays = [threading.Thread(target=_relay, args=(proc.stdout, sys.stdout.buffer, closed), daemon=True),
              threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)]
    for t in relays:
        t.start()
    try:
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        child, deadline = psutil.Process(proc.pid), time.monotonic() + timeout_s
        while proc.poll() is None:
            if closed.is_set():  # nobody reads the rows: the query ends here, quietly, like any Unix tool
                proc.kill()
                proc.wait()
                return
            if time.monotonic() > deadline:
                raise QueryError(f"query stopped after the {timeout_s:g}s time limit")
            try:
                if child.memory_info().rss > cap:
                    raise QueryError(f"query stopped: it needed more memory than the {memory_limit} limit (--memory-limit)")
            except psutil.NoSuchProcess:
                pass
            time.sleep(POLL_S)
    except BaseException:  # a limit, or Ctrl-C: the child goes too
        proc.kill()
        proc.wait()
        raise
    finally:
        if output and proc.returncode:  # killed here or by the system, or failed: the Parquet it was writing
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
        for t in relays:
            t.join(timeout=10)
        if not closed.is_set():
            sys.stdout.flush()
    stderr = b"".join(err).decode("utf-8", "replace")
    for line in stderr.splitlines():  # first: they may say why a query names a view that is not there
        if line.startswith("note\t"):
            print(f"actlake: note: {printable(line.partition(chr(9))[2])}", file=sys.stderr)
    if proc.returncode:
        _raise(proc.returncode, stderr, memory_limit)


def _part_path(output: str, pid: int) -> str:
    """Where the child with ``pid`` writes the Parquet output before renaming it to ``output``."""
    return f"{output}.part-{pid}"


def _relay(src, dest, closed: threading.Event) -> None:
    """Copy the child's rows to ``dest`` as they come; a closed pipe sets ``closed`` and points standard output at
    /dev/null (so that no later flush, ours or the interpreter's at exit, meets the broken pipe)."""
    try:
        for block in iter(lambda: src.read1(1 << 20), b""):
            dest.write(block)
            dest.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        closed.set()


def _raise(code: int, stderr: str, memory_limit: str) -> None:
    lines = [line for line in stderr.splitlines() if "\t" in line]
    kind, _, message = (lines[-1] if lines else "").partition("\t")
    if code == FAILED and kind == "memory":
        raise QueryError(f"query stopped: it needed more memory than the {memory_limit} limit (--memory-limit)")
    if code < 0:
        raise QueryError(f"the query process was killed by signal {-code}")
    if code == FAILED and kind in ("query", "storage"):
        raise (QueryError if kind == "query" else StorageError)(message)
    tail = " ".join(stderr.split())[-500:]
    raise QueryError(f"the query process failed (exit {code}): {tail or 'no message'}")


# --------------------------------------------------------------------------- the child


def _flat(batch):
    """``batch`` with nested columns (list, struct, map) as JSON text, which CSV can hold."""
    import pyarrow as pa

    for i, f in enumerate(batch.schema):
        if pa.types.is_nested(f.type):
            text = pa.array([None if v is None else json.dumps(v, default=str) for v in batch.column(i).to_pylist()],
                            pa.string())
            batch = pa.RecordBatch.from_arrays([text if j == i else c for j, c in enumerate(batch.columns)],
                                               names=batch.schema.names)
    return batch


def _write(reader, fmt: str, output: str | None) -> None:
    """Stream ``reader``'s batches to standard output (or ``output``) in ``fmt``."""
    import pyarrow as pa

    if output and fmt in ("csv", "json"):  # a file: written whole under a temporary name, then renamed
        tmp = _part_path(output, os.getpid())
        try:
            with open(tmp, "wb") as f:
                rows = _text(reader, fmt, f)
            os.replace(tmp, output)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        sys.stdout.buffer.write(f"wrote {rows} rows to {output}\n".encode())
        sys.stdout.flush()
        return
    out = sys.stdout.buffer
    if fmt in ("csv", "json"):
        _text(reader, fmt, out)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        tmp, rows = _part_path(output, os.getpid()), 0
        try:
            with pq.ParquetWriter(tmp, reader.schema, compression="zstd") as w:
                for batch in reader:
                    w.write_batch(batch)
                    rows += batch.num_rows
            os.replace(tmp, output)  # whole or not at all
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        out.write(f"wrote {rows} rows to {output}\n".encode())
    else:
        head, total = [], 0
        for batch in reader:
            total += batch.num_rows
            if sum(b.num_rows for b in head) < TABLE_ROWS:
                head.append(batch)
        shown = pa.Table.from_batches(head, reader.schema).slice(0, TABLE_ROWS)
        sys.stdout.flush()
        show_table(shown, TABLE_ROWS)
        if total > TABLE_ROWS:
            print(f"({total:,} rows in all, the first {TABLE_ROWS} shown; --format csv or json for every row)")
    sys.stdout.flush()


def show_table(table, max_rows: int = TABLE_ROWS) -> None:
    """Print an Arrow table as DuckDB draws one, for a terminal: every character a terminal acts on is escaped
    (:func:`~actlake.errors.printable`) in values, column names and nested types alike, so a source label, a token
    piece or a file name cannot clear the screen, retitle the window or overwrite a line. DuckDB escapes C0 controls
    in top-level values itself, but not C1 ones (``\\x9b`` is a CSI) nor a struct's key in the type line: text
    columns and names are escaped before the drawing (their widths then count the escapes), the drawing after."""
    import contextlib
    import io

    import duckdb
    import pyarrow as pa

    safe = pa.Table.from_arrays([_printable_column(c) for c in table.columns],
                                names=[printable(n) for n in table.column_names])
    drawn = io.StringIO()
    with contextlib.redirect_stdout(drawn):
        duckdb.from_arrow(safe).show(max_rows=max_rows, max_width=200)
    sys.stdout.write(printable_lines(drawn.getvalue()))
    sys.stdout.flush()


def _printable_column(col):
    """A text column (plain or dictionary-encoded) with :func:`~actlake.errors.printable` values; others as they are."""
    import pyarrow as pa

    t = col.type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)):
        return col
    return pa.array([None if v is None else printable(v) for v in col.to_pylist()], pa.string())


def _text(reader, fmt: str, out) -> int:
    """``reader``'s rows as CSV or JSON lines into the binary stream ``out``; returns the row count."""
    import pyarrow as pa

    rows = 0
    if fmt == "json":
        for batch in reader:
            rows += batch.num_rows
            out.write("".join(json.dumps(row, default=str) + "\n" for row in batch.to_pylist()).encode())
        return rows
    import pyarrow.csv as pacsv

    writer = None
    for batch in reader:
        batch = _flat(batch)
        rows += batch.num_rows
        writer = writer or pacsv.CSVWriter(out, batch.schema)
        writer.write_batch(batch)
    if writer is None:  # no rows: the header alone
        empty = pa.RecordBatch.from_arrays([pa.array([], f.type) for f in reader.schema], schema=reader.schema)
        pacsv.write_csv(pa.Table.from_batches([_flat(empty)]), out)
    else:
        writer.close()
    return rows


def _child(job: dict) -> int:
    try:
        import duckdb

        from actlake.storage.sql import (  # actlake.storage.sql imports this module; loads pyarrow: imported when used
            _first_line,
            _open,
            check_statement,
        )

        check_statement(job["sql"])
        con, _, notes = _open(job["run_dir"], memory_limit=job["memory_limit"], max_temp_size=job["max_temp_size"],
                              tmp_dir=job["tmp_dir"])
        for note in notes:
            sys.stderr.write(f"note\t{' '.join(note.split())}\n")
        try:
            _write(con.sql(job["sql"]).to_arrow_reader(BATCH_ROWS), job["fmt"], job["output"])
        except duckdb.OutOfMemoryException:
            return _report("memory", "")
        except MemoryError:
            return _report("memory", "")
        except duckdb.Error as e:
            return _report("query", _first_line(e))
        finally:
            con.close()
    except QueryError as e:
        return _report("query", str(e))
    except StorageError as e:
        return _report("storage", str(e))
    except MemoryError:
        return _report("memory", "")
    return 0


def _report(kind: str, message: str) -> int:
    sys.stderr.write(f"{kind}\t{' '.join(message.split())}\n")
    sys.stderr.flush()
    return FAILED


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.stdin.read())))
