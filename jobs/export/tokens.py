"""``actlake export RUN --format tokens``: every kept token of the store's windows at one hidden state, exactly once,
in a global random order fixed by the seed, in fixed-size shards (read back by :mod:`actlake.activations`).

The shuffle is out of core, in two passes (Rao's bucket shuffle, which gives every order the same probability):
pass 1 sends each row to one of B buckets drawn at random, appended to a file per bucket and store file; pass 2
reads the buckets in turn, shuffles each in place and writes the shards. Memory: :class:`Plan` sizes the read
batches, the buckets and the shards so that the arrays the export holds at once stay within ``--memory-mb``, and
B >= 10 keeps a bucket at most about a tenth of the data. Pass 1 runs per store file with a random generator of its
own seeded by (seed, file), so ``--workers N`` (Ray tasks) writes the same bytes as one process.

Resuming: pass 1 marks each store file done (``done-I.json``, after its bucket parts); pass 2 records after each
bucket the shards written, the rows carried to the next bucket and the sums so far (``pass2.json``, written last),
and only then removes that bucket's parts. A stopped export rerun with the same request carries on from those
records to the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np

from actlake.errors import ActlakeError, ConfigError
from actlake.fs import remove_tree, write_atomic
from actlake.jobs.export.store import (INDEX, INDEX_DTYPE, Progress, Staging, Store, batches, check_output, output,
                                       run_tasks)

log = logging.getLogger("actlake.export")

MAX_BUCKETS = 4096
"""Most buckets of pass 1 (a smaller ``--memory-mb`` for more data is refused in one line)."""
MANIFEST_VERSION = 1
SHUFFLE_VERSION = 2
"""Changes when the same request would give other bytes (a stopped export of another version is not resumed)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the export holds at most ``memory_mb`` of arrays at once. Pass 1: a read batch about four times (the
    decoded Arrow columns, the float32 copy, the rows sent to each bucket) and Parquet's read buffer. Pass 2: the
    largest bucket (the mean and six standard deviations of the random spread: :meth:`bucket_mean`), the rows
    carried from the last bucket twice (while they grow) and a shard's copy while it is written (each at most
    ``shard_rows``)."""

    rows: int
    d: int
    memory_mb: float
    shard_rows: int
    read_rows: int
    buckets: int

    @property
    def row_bytes(self) -> int:
        return 4 * self.d + INDEX_DTYPE.itemsize

    @classmethod
    def make(cls, rows: int, d: int, memory_mb: float, shard_rows: int | None) -> "Plan":
        if not memory_mb > 0:
            raise ConfigError(f"--memory-mb: must be more than 0, got {memory_mb}")
        row_bytes, budget, given = 4 * d + INDEX_DTYPE.itemsize, memory_mb * 2**20, shard_rows
        default_shard = lambda mb: min(65_536, int(mb * 2**20 / 10 / row_bytes))  # noqa: E731 - 65536, or a tenth
        if shard_rows is None:
            shard_rows = default_shard(memory_mb)
            if shard_rows < 1:
                raise ConfigError(f"--memory-mb: {memory_mb:g} MiB holds no shard of rows of {row_bytes} bytes; give "
                                  f"at least {math.ceil(100 * 80 * row_bytes / 2**20) / 100:g}")
        if shard_rows < 1:
            raise ConfigError(f"--shard-rows: must be at least 1, got {shard_rows}")
        if 2 * shard_rows * row_bytes > budget / 4:
            raise ConfigError(f"--shard-rows: {shard_rows:,} rows of {row_bytes} bytes are held twice while written "
                              f"({2 * shard_rows * row_bytes / 2**20:.3g} MiB), more than a quarter of --memory-mb "
                              f"{memory_mb:g}; give at most {int(budget / 8 / row_bytes):,} rows or more memory")
        if 4 * 64 * row_bytes > budget / 2:
            raise ConfigError(f"--memory-mb: {memory_mb:g} MiB cannot hold pass 1's smallest read batch (64 rows of "
                              f"{row_bytes} bytes, about four times); give at least {math.ceil(80 * 64 * row_bytes / 2**20) / 10:g}")
        read_rows = max(64, min(65_536, int((budget / 2 - 2**20) / 4 / row_bytes)))
        mean = cls.bucket_mean(budget, shard_rows, row_bytes)
        buckets = max(10, math.ceil(rows / mean))
        if buckets > MAX_BUCKETS:
            need = memory_mb
            while need < 2**30 and math.ceil(rows / cls.bucket_mean(need * 2**20, default_shard(need) if given is None
                                                                     else shard_rows, row_bytes)) > MAX_BUCKETS:
                need *= 1.02
            raise ConfigError(f"--memory-mb: {memory_mb:g} MiB would need {buckets} buckets for "
                              f"{rows * row_bytes / 2**20:,.0f} MiB of activations (at most {MAX_BUCKETS}); give at "
                              f"least {math.ceil(need):,}")
        return cls(rows, d, memory_mb, shard_rows, read_rows, buckets)

    @staticmethod
    def bucket_mean(budget: float, shard_rows: int, row_bytes: int) -> float:
        """The most rows a bucket may hold on average: a bucket's rows are binomial, and the mean plus six standard
        deviations (beyond it: a normal tail of 1e-9 per bucket, 4e-6 for 4096 buckets) must fit beside the carried rows
        twice and a shard's copy."""
        cap = (budget - 3 * shard_rows * row_bytes) / row_bytes
        if cap < 1:
            return 1.0
        return ((-6 + math.sqrt(36 + 4 * cap)) / 2) ** 2


def export_tokens(run_dir, layer: int, out_dir, shard_rows: int | None = None, dtype: str = "float32",
                  file_format: str = "safetensors", seed: int = 0, memory_mb: float = 512, workers: int = 1,
                  address: str | None = None, drop_roles=("bos",), max_tokens: int | None = None, scratch=None) -> dict:
    """Write the token export; returns its manifest. Tokens of ``drop_roles`` are left out (default the leading
    [CLS]/BOS, as SAE trainers do); ``max_tokens`` keeps the first that many of the shuffled order (a uniform
    sample). Pass 1 runs per store file: in this process (``workers`` 1) or as Ray tasks, ``workers`` at a time
    (the same bytes either way); pass 2 here. A stopped export resumes when run again with the same request.
    ``out_dir`` may be an object-store URL: the shards are uploaded as pass 2 writes them, the manifest last, and the
    buckets are written in ``scratch`` (:class:`~actlake.jobs.export.store.Staging`)."""
    out = output(out_dir)
    check_output(out, workers)
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype: float32 or bfloat16, got {dtype!r}")
    if file_format not in ("safetensors", "npy"):
        raise ConfigError(f"--file-format: safetensors or npy, got {file_format!r}")
    if file_format == "npy" and dtype == "bfloat16":
        raise ConfigError("--dtype bfloat16 needs --file-format safetensors (.npy has no bfloat16)")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens: must be at least 1, got {max_tokens}")
    store = Store(run_dir, layer, drop_roles)
    plan = Plan.make(store.rows, store.d, memory_mb, shard_rows)
    want = min(store.rows, max_tokens or store.rows)
    log.info("exporting %s of %s rows of hidden state %d (width %d%s) through %d buckets: at most %.3g MiB of "
             "arrays at once, %.0f MiB of buckets on disk beside %s", f"{want:,}", f"{store.rows:,}", store.layer,
             store.d, f"; {', '.join(store.drop_roles)} tokens left out" if store.drop_roles else "", plan.buckets,
             memory_mb, store.rows * plan.row_bytes / 2**20, out)
    request = {"kind": "tokens", "version": SHUFFLE_VERSION, "store": store.fingerprint, "layer": store.layer,
               "drop_roles": list(store.drop_roles), "max_tokens": max_tokens, "seed": seed, "dtype": dtype,
               "file_format": file_format, **dataclasses.asdict(plan)}
    stage = Staging(out, request, scratch)
    with stage as staging:
        if (staging / "manifest.json").exists():  # finished before a stop: only published now
            manifest = json.loads((staging / "manifest.json").read_text())
        else:
            manifest = shuffle([p for p, _ in store.files], store.layer, staging, plan, dtype, file_format, seed,
                               want, store.drop_roles, workers, address, stage.put)
            manifest.update(run=str(run_dir), layer=store.layer, drop_roles=list(store.drop_roles))
            write_atomic(staging / "manifest.json", json.dumps(manifest, indent=1).encode())
        remove_tree(staging / "buckets")  # once the manifest is written
        (staging / "pass2.json").unlink(missing_ok=True)
    return manifest


def shuffle(files: list, layer: int, staging: Path, plan: Plan, dtype: str, file_format: str, seed: int, want: int,
            drop_roles: tuple = (), workers: int = 1, address: str | None = None, put=None) -> dict:
    """Both passes over the store ``files`` into ``staging`` (carrying on from its records), ``want`` rows;
    the manifest (without the run's fields). ``put(*names)`` is called with each shard's files once written."""
    folder = staging / "buckets"
    folder.mkdir(exist_ok=True)
    if not (staging / "pass2.json").exists():
        jobs = [(str(p), i, layer, str(folder), plan.buckets, plan.read_rows, seed, tuple(drop_roles))
                for i, p in enumerate(files)]
        run_tasks(_pass_one_file, jobs, workers, address, "pass 1 (rows to buckets), store files")
    manifest = _pass_two(staging, plan, dtype, file_format, seed, want, put or (lambda *names: None))
    if manifest["rows"] != want:
        raise ActlakeError(f"export: {manifest['rows']} rows written where {want} were asked of the store")
    return manifest


def _pass_one_file(path: str, i: int, layer: int, folder: str, buckets: int, read_rows: int, seed: int,
                   drop_roles: tuple) -> int:
    """Pass 1 over store file ``i``: each row to a random bucket (a generator of its own, seeded by (seed, i): the
    same draws whichever process runs it), appended to ``h-B-I.bin`` (float32 rows) and ``index-B-I.bin`` (INDEX
    records); then ``done-I.json``. A file done already is skipped; one stopped halfway is started again (its parts
    removed). Returns its rows."""
    folder = Path(folder)
    done = folder / f"done-{i:05d}.json"
    if done.exists():
        return json.loads(done.read_text())["rows"]
    for part in folder.glob(f"*-{i:05d}.bin"):
        part.unlink()
    rows = spread(batches(path, layer, read_rows, drop_roles), folder, buckets, np.random.default_rng([seed, 1, i]), i)
    write_atomic(done, json.dumps({"rows": rows}).encode())
    return rows


def spread(parts, folder: Path, buckets: int, rng, part: int) -> int:
    """Each row of ``parts`` ((index, h) pairs) to a bucket ``rng`` draws, appended to ``h-B-PART.bin`` and
    ``index-B-PART.bin`` (files opened per write: open files do not grow with the bucket count)."""
    rows = 0
    for index, h in parts:
        to = rng.integers(0, buckets, len(h))
        order = np.argsort(to, kind="stable")
        bounds = np.searchsorted(to[order], np.arange(buckets + 1))
        for b in np.flatnonzero(np.diff(bounds)):
            take = order[bounds[b]:bounds[b + 1]]
            with open(folder / f"h-{b}-{part:05d}.bin", "ab") as fh:
                fh.write(h[take].tobytes())
            with open(folder / f"index-{b}-{part:05d}.bin", "ab") as fi:
                fi.write(index[take].tobytes())
        rows += len(h)
    return rows


def _bucket(folder: Path, b: int, d: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Bucket ``b``: every store file's part of it, in the files' order, read straight into one array each (no
    second copy of a part); None when empty."""
    parts = sorted(folder.glob(f"h-{b}-*.bin"))
    if not parts:
        return None
    n = sum(p.stat().st_size for p in parts) // (4 * d)
    h, index, at = np.empty((n, d), np.float32), np.empty(n, INDEX_DTYPE), 0
    for p in parts:
        k = p.stat().st_size // (4 * d)
        for path, target in ((p, h[at:at + k]), (folder / p.name.replace("h-", "index-", 1), index[at:at + k])):
            with open(path, "rb") as f:
                if f.readinto(memoryview(target).cast("B")) != target.nbytes:
                    raise ActlakeError(f"export: {path} is shorter than its rows (changed while the export ran?)")
        at += k
    return h, index


def shard_files(entry: dict) -> list[str]:
    """The files of a shard the manifest lists: the shard, and its index beside a ``.npy`` one."""
    name = entry["file"]
    return [name, name[:-4] + "-index.npy"] if name.endswith(".npy") else [name]


class _Progress:
    """Pass 2's record (``pass2.json``): the next bucket, the shards written, the float64 norm sum and the rows so far,
    and the rows carried (``carry-B-h.npy`` / ``carry-B-index.npy``, B the bucket that left them)."""

    def __init__(self, staging: Path, d: int, put):
        self.path, self.staging, self.d, self.put = staging / "pass2.json", staging, d, put
        got = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.next, self.shards = got.get("next", 0), got.get("shards", [])
        self.norm_sum, self.rows, self.carry_name = got.get("norm_sum", 0.0), got.get("rows", 0), got.get("carry")
        if self.carry_name:
            self.carry_h = np.load(staging / f"{self.carry_name}-h.npy")
            self.carry_i = np.load(staging / f"{self.carry_name}-index.npy")
        else:
            self.carry_h, self.carry_i = np.empty((0, d), np.float32), np.empty(0, INDEX_DTYPE)
        kept = {f for s in self.shards for f in shard_files(s)} | {f"{self.carry_name}-{x}.npy" for x in ("h", "index")}
        for p in staging.iterdir():  # what a stopped pass wrote after its last record
            if p.is_file() and p.name.startswith(("shard-", "carry-", ".")) and p.name not in kept:
                p.unlink()

    def add(self, entry: dict) -> None:
        """A shard written: listed, and its files handed on (uploaded for an object store)."""
        self.shards.append(entry)
        self.put(*shard_files(entry))

    def commit(self, b: int) -> None:
        """Bucket ``b`` is written: record it (the carried rows first, the record last), then remove its parts."""
        name = None
        if len(self.carry_h):
            name = f"carry-{b:05d}"
            for suffix, a in (("h", self.carry_h), ("index", self.carry_i)):
                tmp = self.staging / f".{name}-{suffix}.npy"
                np.save(tmp, a)
                tmp.rename(self.staging / f"{name}-{suffix}.npy")
        old, self.carry_name, self.next = self.carry_name, name, b + 1
        write_atomic(self.path, json.dumps({"next": self.next, "shards": self.shards, "norm_sum": self.norm_sum,
                                            "rows": self.rows, "carry": name}).encode())
        if old and old != name:
            for suffix in ("h", "index"):
                (self.staging / f"{old}-{suffix}.npy").unlink(missing_ok=True)
        for p in (self.staging / "buckets").glob(f"*-{b}-*.bin"):
            p.unlink()


def _pass_two(staging: Path, plan: Plan, dtype: str, file_format: str, seed: int, want: int, put) -> dict:
    """The buckets in turn from where the record says, each shuffled in place and cut into shards (rows short of a
    shard carried to the next bucket), until ``want`` rows are written; the manifest."""
    p = _Progress(staging, plan.d, put)
    progress = Progress("pass 2 (buckets shuffled into shards), buckets", plan.buckets - p.next)
    for b in range(p.next, plan.buckets):
        got = _bucket(staging / "buckets", b, plan.d) if p.rows < want else None
        if got is not None:
            _add_bucket(staging, p, plan, *got, seed, b, want, dtype, file_format)
            del got  # before the next bucket is read: one bucket at a time
        if b == plan.buckets - 1 and len(p.carry_h):
            p.add(_write_shard(staging, len(p.shards), p.carry_h, p.carry_i, dtype, file_format))
            p.carry_h, p.carry_i = p.carry_h[:0], p.carry_i[:0]
        p.commit(b)
        progress.step()
    return {"format": "actlake-tokens", "version": MANIFEST_VERSION, "d_model": plan.d, "dtype": dtype,
            "file_format": file_format, "rows": p.rows, "mean_norm": p.norm_sum / max(p.rows, 1), "seed": seed,
            "shards": p.shards}


def _add_bucket(staging: Path, p: _Progress, plan: Plan, h: np.ndarray, index: np.ndarray, seed: int, b: int,
                want: int, dtype: str, file_format: str) -> None:
    """Bucket ``b`` (``h`` (n, d), ``index`` (n,)) shuffled in place, its first rows up to ``want`` in all added to
    the norm's sum and cut into shards after the rows carried from the last bucket; the rest carried."""
    for x in (h, index):  # one permutation of both: the same draws for the same length
        np.random.default_rng([seed, 2, b]).shuffle(x)
    h, index = h[:want - p.rows], index[:want - p.rows]
    step = max(1, plan.read_rows // 8)  # the norm's float64 sums, a chunk at a time (a float64 copy)
    for start in range(0, len(h), step):
        chunk = h[start:start + step]
        p.norm_sum += float(np.sqrt(np.einsum("ij,ij->i", chunk, chunk, dtype=np.float64)).sum())
    p.rows += len(h)
    at = 0
    if len(p.carry_h):  # the rows the last bucket left short of a shard, first
        at = min(plan.shard_rows - len(p.carry_h), len(h))
        p.carry_h, p.carry_i = np.concatenate([p.carry_h, h[:at]]), np.concatenate([p.carry_i, index[:at]])
        if len(p.carry_h) == plan.shard_rows:
            p.add(_write_shard(staging, len(p.shards), p.carry_h, p.carry_i, dtype, file_format))
            p.carry_h, p.carry_i = p.carry_h[:0], p.carry_i[:0]
    while len(h) - at >= plan.shard_rows:
        p.add(_write_shard(staging, len(p.shards), h[at:at + plan.shard_rows], index[at:at + plan.shard_rows],
                           dtype, file_format))
        at += plan.shard_rows
    if at < len(h):
        p.carry_h, p.carry_i = h[at:].copy(), index[at:].copy()


def _write_shard(staging: Path, i: int, h: np.ndarray, index: np.ndarray, dtype: str, file_format: str) -> dict:
    """Shard ``i`` (through a dot-file renamed into place: a stopped write leaves no shard)."""
    entry = {"file": f"shard-{i:05d}.{file_format}", "rows": int(len(h))}
    name = entry["file"]
    if file_format == "npy":
        for target, a in zip(shard_files(entry), (h, index)):
            with open(staging / f".{target}", "wb") as f:
                np.save(f, a)
            (staging / f".{target}").rename(staging / target)
    else:
        import torch
        from safetensors.torch import save_file

        tensors = {"activations": torch.from_numpy(np.ascontiguousarray(h)).to(getattr(torch, dtype))}
        tensors.update({k: torch.from_numpy(np.ascontiguousarray(index[k])) for k, _ in INDEX})
        save_file(tensors, str(staging / f".{name}"), metadata={"rows": str(len(h))})
        (staging / f".{name}").rename(staging / name)
    return entry
