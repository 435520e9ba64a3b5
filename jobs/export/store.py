"""What both export formats share: the checked store, its rows read a record batch at a time, the Ray tasks, and the
output folder (``DIR.partial`` while the export runs, resumed by the same request, renamed to DIR when whole)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from actlake.categories import ROLE
from actlake.errors import ActlakeError, ConfigError, printable
from actlake.fs import ObjectPath

log = logging.getLogger("actlake.export")

INDEX = (("doc_id", np.int64), ("window_index", np.int32), ("position", np.int32), ("token_id", np.int32))
"""The row index kept beside each activation, and its dtypes."""
INDEX_DTYPE = np.dtype(list(INDEX))
READ_BUFFER = 1 << 20
"""Bytes Parquet reads from a store file at a time (no pre-buffering: a row group is never held whole)."""


class Store:
    """A complete activation store's hidden state ``layer``: its committed files (``files``: (path, record entry)),
    the rows kept (``rows``: those of a role not in ``drop_roles``), the width ``d`` and the store's fingerprint
    (:func:`~actlake.storage.activations.verify_store`); one line saying what is missing otherwise."""

    def __init__(self, run_dir, layer: int, drop_roles: tuple[str, ...] = ()):
        from actlake.storage.activations import verify_store
        from actlake.storage.sql import open_run

        self.run_dir, self.layer, self.drop_roles = run_dir, int(layer), tuple(sorted(set(drop_roles)))
        bad = [r for r in self.drop_roles if r not in ROLE]
        if bad:
            raise ConfigError(f"--drop-roles: {', '.join(bad)} is not a token role (roles: {', '.join(ROLE)}; "
                              "none keeps every token)")
        con = open_run(str(run_dir))
        tables = {r[0] for r in con.sql("SELECT table_name FROM information_schema.tables").fetchall()}
        if "activations" not in tables:
            raise ConfigError(f"{run_dir}: the run has no activation store; run the job with activations.layers: [{layer}]")
        verified = verify_store(run_dir)  # every planned shard committed, else refused naming them
        self.files, self.fingerprint = verified["files"], verified["fingerprint"]
        columns = {r[0] for r in con.sql("DESCRIBE activations").fetchall()}
        if self.drop_roles and "role" not in columns:
            raise ConfigError(f"{run_dir}: the activation store has no role column (written before actlake stored "
                              "it): export with --drop-roles none, or extract a new run (a new output.run_id) to "
                              f"leave {', '.join(self.drop_roles)} tokens out")
        self.where = f"layer = {self.layer}" + (f" AND role NOT IN ({', '.join(repr(r) for r in self.drop_roles)})"
                                                if self.drop_roles else "")
        self.rows = con.sql(f"SELECT count(*) FROM activations WHERE {self.where}").fetchall()[0][0]
        if not con.sql(f"SELECT count(*) FROM activations WHERE layer = {self.layer}").fetchall()[0][0]:
            layers = sorted(r[0] for r in con.sql("SELECT DISTINCT layer FROM activations").fetchall())
            raise ConfigError(f"--layer: the activation store has no rows for hidden state {layer} (it holds {layers})")
        if not self.rows:
            raise ConfigError(f"--drop-roles: every stored token of hidden state {layer} is a "
                              f"{' or '.join(self.drop_roles)} token; nothing is left to export")
        self.d = con.sql(f"SELECT len(h) FROM activations WHERE layer = {self.layer} LIMIT 1").fetchall()[0][0]

    def window_lengths(self) -> np.ndarray:
        """Each stored window's token count at the hidden state (a scan of the index columns only)."""
        from actlake.storage.sql import open_run

        return np.array([n for (n,) in open_run(str(self.run_dir)).sql(
            f"SELECT count(*) FROM activations WHERE layer = {self.layer} GROUP BY doc_id, window_index").fetchall()],
            np.int64)


def batches(path, layer: int, read_rows: int, drop_roles: tuple[str, ...] = ()):
    """(index record array, h (n, d) float32) of hidden state ``layer`` in the store file at ``path``, ``read_rows``
    rows at a time (tokens of ``drop_roles`` left out); a non-finite vector is refused naming its file and token."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from actlake.fs import arrow, location

    path = location(path)
    columns = [name for name, _ in INDEX] + ["layer", "h"] + (["role"] if drop_roles else [])
    fs, key = arrow(path)
    with fs.open_input_file(key) as f:
        reader = pq.ParquetFile(f, buffer_size=READ_BUFFER, pre_buffer=False)
        for batch in reader.iter_batches(batch_size=read_rows, columns=columns):
            keep = pc.equal(batch.column("layer"), layer)
            if drop_roles:
                keep = pc.and_(keep, pc.invert(pc.is_in(batch.column("role"), pa.array(drop_roles))))
            batch = batch.filter(keep)
            n = batch.num_rows
            if not n:
                continue
            h = batch.column("h").flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(n, -1)
            index = np.empty(n, INDEX_DTYPE)
            for name, _ in INDEX:
                index[name] = batch.column(name).to_numpy(zero_copy_only=False)
            del batch
            bad = np.flatnonzero(~np.isfinite(h).all(axis=1))
            if len(bad):
                r = index[bad[0]]
                raise ConfigError(f"{path}: hidden state {layer} of doc_id {r['doc_id']}, window "
                                  f"{r['window_index']}, position {r['position']} is not finite (and {len(bad) - 1} "
                                  "more in that batch); the export refuses NaN and inf")
            yield index, h


PROGRESS_S = 10.0
"""Seconds between two progress lines of a long export."""


class Progress:
    """One log line every :data:`PROGRESS_S` seconds while a part of an export runs (``what``: e.g. "pass 1: store
    files"), with its share done and the time left at the rate so far, and one when it ends."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.done = what, total, 0
        self.t0 = self.last = time.monotonic()

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.done >= self.total or now - self.last >= PROGRESS_S:
            self.last = now
            left = (now - self.t0) / self.done * (self.total - self.done) if self.done else 0.0
            log.info("export %s: %d of %d (%.0f %%)%s", self.what, self.done, self.total,
                     100 * self.done / max(self.total, 1), f", about {left:,.0f} s left" if self.done < self.total else "")


def run_tasks(fn, jobs: list[tuple], workers: int, address: str | None, what: str = "store files") -> list:
    """``fn(*job)`` for every job, results in the jobs' order: in this process (``workers`` 1) or as Ray tasks,
    ``workers`` in flight at a time (a task that fails is retried twice, then the export stops with its error);
    progress as they finish."""
    progress = Progress(what, len(jobs))
    if workers == 1:
        out = []
        for job in jobs:
            out.append(fn(*job))
            progress.step()
        return out
    import ray

    from actlake.jobs.common.ray_env import init_ray

    started = init_ray(address)
    try:
        task = ray.remote(num_cpus=1, max_retries=2)(fn)
        running, results = {}, {}
        for k, job in enumerate(jobs):
            if len(running) >= workers:
                (done,), _ = ray.wait(list(running), num_returns=1)
                results[running.pop(done)] = ray.get(done)
                progress.step()
            running[task.remote(*job)] = k
        for ref, k in running.items():
            results[k] = ray.get(ref)
            progress.step()
        return [results[k] for k in range(len(jobs))]
    finally:
        if started:
            ray.shutdown()


def check_output(out, workers: int) -> None:
    """The output (a local folder or an object-store prefix) and ``--workers``: one line naming the bad one."""
    if isinstance(out, ObjectPath):
        for name in ("manifest.json", "state.json"):
            if (out / name).exists():
                raise ConfigError(f"-o: {out} holds an export ({name}); the export writes a new prefix and overwrites "
                                  "nothing")
    else:
        if os.path.lexists(out):
            raise ConfigError(f"-o: {out} exists; the export writes a new folder and overwrites nothing")
        if not out.parent.is_dir():
            raise ConfigError(f"-o: {out.parent} is not a folder")
    if workers < 1:
        raise ConfigError(f"--workers: must be at least 1, got {workers}")


def output(value):
    """``-o`` as a local Path or an ObjectPath (an object-store URL)."""
    from actlake.fs import location

    return location(str(value))


class Staging:
    """Where an export is written: ``DIR.partial`` beside a local DIR (the same file system: the last rename never
    copies), or, for an object-store prefix, a folder in ``scratch`` named by it (default the system's temporary
    folder; with ``--workers`` on a cluster, one every node writes to) whose finished files :meth:`put` uploads as
    they come, the last ones (``manifest.json`` / ``state.json``: what readers read first) uploaded at the end.
    It holds ``request.json`` until the export is published. An export that stops (killed, interrupted, a failed
    task) leaves it: the same request resumes it (each part of the work says itself what it finished, and a
    finished one is only published), another request is refused naming what differs. A deterministic refusal (an
    :class:`ActlakeError`: a NaN in the store, rows that do not add up) removes it. One export at a time works on
    it: an ``flock`` on the folder, taken before anything in it is read."""

    LAST = ("dataset_info.json", "manifest.json", "state.json")
    """Uploaded last, in this order: a reader sees an export once these are there."""

    def __init__(self, out, request: dict, scratch=None):
        self.out, self.request, self.remote = out, request, isinstance(out, ObjectPath)
        if self.remote:
            folder = Path(scratch or tempfile.gettempdir()) / "actlake-exports"
            folder.mkdir(parents=True, exist_ok=True)
            self.path = folder / f"{hashlib.sha256(str(out).encode()).hexdigest()[:16]}.partial"
        else:
            self.path = out.parent / f"{out.name}.partial"
        self.resumed, self.fd = False, None

    def __enter__(self) -> Path:
        if self.path.is_dir():
            self.fd = self._hold(self.path)
            try:
                self._check_request()
            except ConfigError:
                os.close(self.fd)
                raise
            self.resumed = True
            log.info("resuming the stopped export in %s", printable(str(self.path)))
            return self.path
        if self.remote and self.out.files():
            raise ConfigError(f"-o: {self.out} holds objects, and {self.path.parent} no stopped export to it: resume a "
                              "stopped export with the --scratch it ran with, or give an empty prefix")
        fresh = self.path.with_name(f".{self.path.name}.new-{os.getpid()}")
        shutil.rmtree(fresh, ignore_errors=True)
        fresh.mkdir()
        self.fd = self._hold(fresh)  # held before it has a name another export looks for
        (fresh / "request.json").write_text(json.dumps(self.request | {"out": str(self.out)}, indent=1, sort_keys=True))
        try:
            os.rename(fresh, self.path)
        except OSError:  # another export made it meanwhile
            os.close(self.fd)
            shutil.rmtree(fresh, ignore_errors=True)
            raise ConfigError(f"-o: {self.out} is being written by another export; wait for it to end") from None
        return self.path

    def _hold(self, folder: Path) -> int:
        """An ``flock`` on the folder itself (no lock file to leave behind or to delete while another waits on it),
        checked to be still the folder of that name once held."""
        import fcntl

        busy = ConfigError(f"-o: {self.out} is being written by another export; wait for it to end")
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:  # renamed meanwhile: finished by another export
            raise busy from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not os.path.samestat(os.fstat(fd), os.stat(folder)):
                raise FileNotFoundError(folder)
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            raise busy from None
        return fd

    def put(self, *names: str) -> None:
        """Files of the staging folder that are finished: uploaded (and removed here) for an object store."""
        if self.remote:
            for name in names:
                upload(self.path / name, self.out / name)
                (self.path / name).unlink()

    def _check_request(self) -> None:
        try:
            got = json.loads((self.path / "request.json").read_text())
        except (OSError, ValueError):
            got = None
        if not isinstance(got, dict):
            raise ConfigError(f"-o: {self.path} is not a stopped export's folder (no readable request.json); move it away")
        want = self.request | {"out": str(self.out)}
        differ = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        if differ:
            shown = ", ".join(f"{k} {got.get(k)!r} there, {want.get(k)!r} now" for k in differ)
            raise ConfigError(f"-o: {self.path} holds a stopped export of another request ({shown}): repeat that "
                              "request to resume it, or delete the folder to start again")

    def __exit__(self, kind, value, _tb):
        try:
            if kind is not None:
                if issubclass(kind, ActlakeError):
                    shutil.rmtree(self.path, ignore_errors=True)
                else:
                    log.warning("the export stopped; %s is kept: the same command resumes it", printable(str(self.path)))
                return
            if self.remote:  # request.json stays until every file is up: a stop here publishes on the next run
                rest = sorted(p.name for p in self.path.iterdir() if p.is_file() and p.name not in self.LAST
                              and p.name != "request.json")
                self.put(*rest, *[n for n in self.LAST if (self.path / n).exists()])
                shutil.rmtree(self.path)
                return
            if os.path.lexists(self.out):  # made meanwhile: a rename would take over an empty folder
                raise ConfigError(f"-o: {self.out} appeared while the export ran; the export is left in {self.path}")
            os.rename(self.path, self.out)
            (self.out / "request.json").unlink()  # (a stop just before leaves it in the finished folder, harmless)
        finally:
            os.close(self.fd)


def upload(local: Path, target) -> None:
    """``local`` to the object ``target`` (an object appears whole when its upload closes)."""
    with open(local, "rb") as src, target.open("wb") as dst:
        shutil.copyfileobj(src, dst, 8 << 20)
