"""``actlake export RUN --format tokens|saelens --layer L -o DIR``: a run's activation store as what sparse-autoencoder
trainers read (issue 52): SAELens's activation cache (:func:`export_saelens`), or token-level shuffled shards for any
trainer (:func:`export_tokens`).

The store must be complete (every planned shard committed: :func:`~actlake.storage.activations.verify_store`) and
finite; it is read file by file (one shard's file at a time, local or object storage). The output is a new local
folder, written into ``DIR.partial-*`` beside it and renamed to DIR when whole; an existing DIR is refused (nothing
is overwritten). A killed export leaves its ``DIR.partial-*`` folder (the next export to DIR names it).

**tokens**: every token of the store's windows at hidden state L, exactly once, in a global random order fixed by
``--seed``, cut into shards of ``--shard-rows`` rows (the last one shorter): ``shard-00000.safetensors`` (or
``.npy`` with ``-index.npy``) holding ``activations`` (N, d) in float32 or bfloat16 and the row index (``doc_id``,
``window_index``, ``position``, ``token_id``), and ``manifest.json``: layer, width, dtype, rows, the mean activation
norm (the usual SAE input scaling: ``sqrt(d) / mean_norm``), the seed and each shard's rows.
:func:`actlake.activations.iterate` streams it. The shuffle is out of core, in two passes (Rao's bucket shuffle,
which gives every order the same probability): pass 1 sends each row to one of B buckets drawn at random, appended to
a file per bucket; pass 2 reads the buckets in turn, shuffles each in memory and writes the shards. B is chosen so
that a bucket holds about half of ``--memory-mb`` (and at most a tenth of the data, B <= :data:`MAX_BUCKETS`): pass 2
holds a bucket twice (read, then reordered) and a shard; pass 1 a read batch. Pass 1 runs per store file, each with
its own random generator seeded by (seed, file), so ``--workers N`` (Ray tasks) writes the same bytes as one
process; its buckets are files every task writes to a folder of its own name (``-o``'s parent, shared on a cluster).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from actlake.errors import ActlakeError, ConfigError, printable

log = logging.getLogger("actlake.export")

INDEX = (("doc_id", np.int64), ("window_index", np.int32), ("position", np.int32), ("token_id", np.int32))
"""The row index kept beside each activation, and its dtypes."""
READ_ROWS = 65_536
"""Rows per record batch read from a store file."""
MAX_BUCKETS = 4096
"""Most buckets of pass 1 (a smaller ``--memory-mb`` for more data is refused in one line)."""
MANIFEST_VERSION = 1


def export_tokens(run_dir, layer: int, out_dir, shard_rows: int = 65_536, dtype: str = "float32",
                  file_format: str = "safetensors", seed: int = 0, memory_mb: float = 512, workers: int = 1,
                  address: str | None = None) -> dict:
    """Write the token export; returns its manifest. Pass 1 runs per store file: in this process (``workers`` 1)
    or as Ray tasks, ``workers`` at a time (the same bytes either way); pass 2 here."""
    out = Path(out_dir)
    _check_arguments(out, shard_rows, dtype, file_format, memory_mb)
    if workers < 1:
        raise ConfigError(f"--workers: must be at least 1, got {workers}")
    files, rows, d = _store(run_dir, layer)
    row_bytes = 4 * d + np.dtype(list(INDEX)).itemsize
    buckets = max(10, math.ceil(rows * row_bytes / (memory_mb * 2**20 / 2)))
    if buckets > MAX_BUCKETS:
        raise ConfigError(f"--memory-mb: {memory_mb:g} MiB would need {buckets} buckets for "
                          f"{rows * row_bytes / 2**20:,.0f} MiB of activations (at most {MAX_BUCKETS}); give more")
    bucket_mb = rows / buckets * row_bytes / 2**20
    log.info("exporting %s rows of hidden state %d (width %d) through %d buckets of about %.0f MiB: about %.0f MiB "
             "in memory at once, %.0f MiB of buckets on disk beside %s", f"{rows:,}", layer, d, buckets, bucket_mb,
             2.4 * bucket_mb + (READ_ROWS + shard_rows) * row_bytes / 2**20, rows * row_bytes / 2**20, out)
    with _staging(out) as staging:
        (staging / "buckets").mkdir()
        jobs = [(str(p), i, int(layer), str(staging / "buckets"), buckets, seed) for i, (p, _) in enumerate(files)]
        _run_tasks(_pass_one_file, jobs, workers, address)
        manifest = _pass_two(staging, buckets, d, shard_rows, dtype, file_format, seed)
        manifest.update(run=str(run_dir), layer=int(layer))
        shutil.rmtree(staging / "buckets")
        if manifest["rows"] != rows:
            raise ActlakeError(f"export: {manifest['rows']} rows written where the store holds {rows}")
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def export_saelens(run_dir, layer: int, out_dir, context_size: int | None = None, hook_name: str | None = None,
                   workers: int = 1, address: str | None = None) -> dict:
    """SAELens's activation cache (``CacheActivationsRunner``'s format, read by ``ActivationsStore`` with
    ``cached_activations_path``): a Hugging Face ``datasets`` folder (``save_to_disk``'s layout) with one row per
    window of exactly ``context_size`` tokens (default: the store's longest), a column named by TransformerLens's hook
    (default ``blocks.L.hook_resid_pre``: hidden state L is the residual stream entering block L) of
    ``Array2D((context_size, d), float32)``, and ``token_ids``, ``Sequence(int32, length=context_size)``. Windows
    of another length are left out and counted (shorter: a document's end; longer: a smaller ``context_size`` than
    the store's windows). Rows in the store's order (SAELens shuffles as it reads).

    Each store file (one shard's) becomes one Arrow file of the dataset, written by its own task: in this process
    (``workers`` 1), or as Ray tasks, ``workers`` at a time, on an embedded Ray or the cluster at ``address`` (the
    folder must then be one every node writes to); ``state.json`` lists the files, so no process gathers the
    corpus. Returns what was written."""
    out = Path(out_dir)
    _check_arguments(out, 1, "float32", "safetensors", 1)
    if context_size is not None and context_size < 1:
        raise ConfigError(f"--context-size: must be at least 1, got {context_size}")
    if workers < 1:
        raise ConfigError(f"--workers: must be at least 1, got {workers}")
    files, _, d = _store(run_dir, layer)
    lengths = np.array([n for (n,) in _window_lengths(run_dir, layer)])
    T = context_size or int(lengths.max())
    counts = {"rows": int((lengths == T).sum()), "shorter": int((lengths < T).sum()), "longer": int((lengths > T).sum())}
    if not counts["rows"]:
        raise ConfigError(f"--context-size {T}: no stored window has exactly {T} tokens (the longest has "
                          f"{int(lengths.max())})")
    hook = hook_name or f"blocks.{int(layer)}.hook_resid_pre"
    with _staging(out) as staging:
        jobs = [(str(p), i, len(files), int(layer), T, hook, d, str(staging)) for i, (p, _) in enumerate(files)]
        written = _run_tasks(_saelens_file, jobs, workers, address)
        written = [w for w in written if w is not None]
        _saelens_state(staging, [name for name, _ in written])
        if sum(n for _, n in written) != counts["rows"]:
            raise ActlakeError(f"export: {sum(n for _, n in written)} windows written where the store holds "
                               f"{counts['rows']} of {T}")
    log.info("wrote %d windows of %d tokens (%s) in %d file(s); left out %d shorter and %d longer window(s)",
             counts["rows"], T, hook, len(written), counts["shorter"], counts["longer"])
    return {"rows": counts["rows"], "context_size": T, "d_model": d, "hook_name": hook, "files": len(written),
            "left_out_shorter": counts["shorter"], "left_out_longer": counts["longer"]}


def _saelens_file(path: str, i: int, n: int, layer: int, T: int, hook: str, d: int, staging: str):
    """One store file's windows of T tokens as ``data-I-of-N.arrow`` in ``staging`` (``save_to_disk``'s own
    writer, through a scratch folder of its own); (file name, rows), or None when it has none. Holds the file's
    hidden states twice at most (read, then the windows taken)."""
    import datasets

    from actlake.fs import location

    datasets.disable_progress_bars()  # the command prints its own line
    windows = [(index, h, lengths) for index, h, lengths in _file_windows([(location(path), None)], layer)]
    if not windows:
        return None
    index, h, lengths = windows[0]
    starts = np.r_[0, np.cumsum(lengths)[:-1]][lengths == T]
    if not len(starts):
        return None
    take = (starts[:, None] + np.arange(T)).reshape(-1)  # (rows T,) in the store's order
    features = datasets.Features({hook: datasets.Array2D((T, d), "float32"),
                                  "token_ids": datasets.Sequence(datasets.Value("int32"), length=T)})
    ds = datasets.Dataset.from_dict({hook: h[take].reshape(-1, T, d), "token_ids": index["token_id"][take].reshape(-1, T)},
                                    features=features)
    del windows, index, h
    scratch = Path(staging) / f".task-{i:05d}"
    ds.save_to_disk(str(scratch), num_shards=1)
    (arrow,) = [p for p in scratch.iterdir() if p.suffix == ".arrow"]
    name = f"data-{i:05d}-of-{n:05d}.arrow"
    os.rename(arrow, Path(staging) / name)
    os.replace(scratch / "dataset_info.json", Path(staging) / "dataset_info.json")  # the same in every task's
    shutil.rmtree(scratch)
    return name, len(starts)


def _saelens_state(staging: Path, names: list[str]) -> None:
    """``state.json`` naming every task's Arrow file in the store's order: ``load_from_disk`` then reads them as one
    dataset."""
    state = {"_data_files": [{"filename": name} for name in names], "_fingerprint": uuid.uuid4().hex[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    (staging / "state.json").write_text(json.dumps(state, indent=2))


def _run_tasks(fn, jobs: list[tuple], workers: int, address: str | None) -> list:
    """``fn(*job)`` for every job, results in the jobs' order: in this process (``workers`` 1) or as Ray tasks,
    ``workers`` in flight at a time (a task that fails is retried twice, then the export stops with its error)."""
    if workers == 1:
        return [fn(*job) for job in jobs]
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
            running[task.remote(*job)] = k
        for ref, k in running.items():
            results[k] = ray.get(ref)
        return [results[k] for k in range(len(jobs))]
    finally:
        if started:
            ray.shutdown()


def _window_lengths(run_dir, layer: int) -> list:
    """Each stored window's token count at hidden state ``layer`` (a scan of the index columns only)."""
    from actlake.storage.sql import open_run

    return open_run(str(run_dir)).sql(f"SELECT count(*) FROM activations WHERE layer = {int(layer)} "
                                      "GROUP BY doc_id, window_index").fetchall()


# --------------------------------------------------------------------------- reading the store


def _store(run_dir, layer: int) -> tuple[list, int, int]:
    """(committed activation files, rows of hidden state ``layer``, width), or one line saying what is missing."""
    from actlake.storage.activations import verify_store
    from actlake.storage.sql import open_run

    con = open_run(str(run_dir))
    if "activations" not in {r[0] for r in con.sql("SELECT table_name FROM information_schema.tables").fetchall()}:
        raise ConfigError(f"{run_dir}: the run has no activation store; run the job with activations.layers: [{layer}]")
    files = verify_store(run_dir)["files"]  # every planned shard committed, else refused naming them
    rows = con.sql(f"SELECT count(*) FROM activations WHERE layer = {int(layer)}").fetchall()[0][0]
    if not rows:
        layers = sorted(r[0] for r in con.sql("SELECT DISTINCT layer FROM activations").fetchall())
        raise ConfigError(f"--layer: the activation store has no rows for hidden state {layer} (it holds {layers})")
    d = con.sql(f"SELECT len(h) FROM activations WHERE layer = {int(layer)} LIMIT 1").fetchall()[0][0]
    return files, rows, d


def _batches(files, layer: int):
    """(index record array, h (n, d) float32) of hidden state ``layer``, a store file's record batch at a time; a
    non-finite vector is refused naming its file and token."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from actlake.fs import arrow

    columns = [name for name, _ in INDEX] + ["layer", "h"]
    index_dtype = np.dtype(list(INDEX))
    for path, _ in files:
        fs, key = arrow(path)
        with fs.open_input_file(key) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=READ_ROWS, columns=columns):
                batch = batch.filter(pc.equal(batch.column("layer"), layer))
                n = batch.num_rows
                if not n:
                    continue
                h = batch.column("h").flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(n, -1)
                index = np.empty(n, index_dtype)
                for name, _ in INDEX:
                    index[name] = batch.column(name).to_numpy(zero_copy_only=False)
                bad = np.flatnonzero(~np.isfinite(h).all(axis=1))
                if len(bad):
                    r = index[bad[0]]
                    raise ConfigError(f"{path}: hidden state {layer} of doc_id {r['doc_id']}, window "
                                      f"{r['window_index']}, position {r['position']} is not finite (and {len(bad) - 1} "
                                      "more in that batch); the export refuses NaN and inf")
                yield index, h


def _file_windows(files, layer: int):
    """Per store file (one shard: its documents' windows are all in it): (index, h) sorted by (doc_id, window_index,
    position) and each window's length, in that order."""
    for path, meta in files:
        parts = list(_batches([(path, meta)], layer))
        if not parts:
            continue
        index = np.concatenate([i for i, _ in parts])
        h = np.concatenate([v for _, v in parts])
        order = np.lexsort((index["position"], index["window_index"], index["doc_id"]))
        index, h = index[order], h[order]
        new = np.r_[True, (index["doc_id"][1:] != index["doc_id"][:-1])
                    | (index["window_index"][1:] != index["window_index"][:-1])]
        yield index, h, np.diff(np.r_[np.flatnonzero(new), len(index)])


# --------------------------------------------------------------------------- the token shuffle


def _check_arguments(out: Path, shard_rows: int, dtype: str, file_format: str, memory_mb: float) -> None:
    if "://" in str(out):
        raise ConfigError(f"-o: {out}: the export is written to a local folder (copy it to object storage after)")
    if os.path.lexists(out):
        raise ConfigError(f"-o: {out} exists; the export writes a new folder and overwrites nothing")
    if not out.parent.is_dir():
        raise ConfigError(f"-o: {out.parent} is not a folder")
    left = sorted(out.parent.glob(f"{out.name}.partial-*"))
    if left:
        log.warning("%s: left by an export that was stopped; delete it", printable(str(left[0])))
    if shard_rows < 1:
        raise ConfigError(f"--shard-rows: must be at least 1, got {shard_rows}")
    if not memory_mb > 0:
        raise ConfigError(f"--memory-mb: must be more than 0, got {memory_mb}")
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype: float32 or bfloat16, got {dtype!r}")
    if file_format not in ("safetensors", "npy"):
        raise ConfigError(f"--file-format: safetensors or npy, got {file_format!r}")
    if file_format == "npy" and dtype == "bfloat16":
        raise ConfigError("--dtype bfloat16 needs --file-format safetensors (.npy has no bfloat16)")


class _staging:
    """``DIR.partial-*`` beside DIR (the same file system: the last rename never copies), renamed to DIR when the
    block ends without an error, removed when it raises."""

    def __init__(self, out: Path):
        self.out, self.path = out, out.parent / f"{out.name}.partial-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> Path:
        self.path.mkdir()
        return self.path

    def __exit__(self, kind, *_):
        if kind is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        if os.path.lexists(self.out):  # made meanwhile: a rename would take over an empty folder
            shutil.rmtree(self.path, ignore_errors=True)
            raise ConfigError(f"-o: {self.out} appeared while the export ran; nothing written there")
        os.rename(self.path, self.out)


def _pass_one_file(path: str, i: int, layer: int, folder: str, buckets: int, seed: int) -> int:
    """Pass 1 over store file ``i``: each row to a random bucket (a generator of its own, seeded by (seed, i): the
    same draws whichever process runs it), appended to ``h-B-I.bin`` (float32 rows) and ``index-B-I.bin`` (INDEX
    records); files are opened per write (open files do not grow with the bucket count). Returns its rows."""
    from actlake.fs import location

    return _spread(_batches([(location(path), None)], layer), Path(folder), buckets, np.random.default_rng([seed, 1, i]), i)


def _spread(batches, folder: Path, buckets: int, rng, part: int) -> int:
    """Each row of ``batches`` to a bucket ``rng`` draws, appended to ``h-B-PART.bin`` and ``index-B-PART.bin``."""
    rows = 0
    for index, h in batches:
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
    """Bucket ``b``: every store file's part of it, in the files' order, read into one array (and its parts
    removed); None when empty."""
    parts = sorted(folder.glob(f"h-{b}-*.bin"))
    if not parts:
        return None
    index_dtype = np.dtype(list(INDEX))
    n = sum(p.stat().st_size for p in parts) // (4 * d)
    h, index, at = np.empty((n, d), np.float32), np.empty(n, index_dtype), 0
    for p in parts:  # read straight into the bucket's arrays: no second copy of a part
        k = p.stat().st_size // (4 * d)
        for path, target in ((p, h[at:at + k]), (folder / p.name.replace("h-", "index-", 1), index[at:at + k])):
            with open(path, "rb") as f:
                if f.readinto(memoryview(target).cast("B")) != target.nbytes:
                    raise ActlakeError(f"export: {path} is shorter than its rows (changed while the export ran?)")
            path.unlink()
        at += k
    return h, index


def _pass_two(staging: Path, buckets: int, d: int, shard_rows: int, dtype: str, file_format: str,
              seed: int) -> dict:
    """The buckets in turn, each shuffled in memory, cut into shards (rows short of a shard carried to the next
    bucket); the manifest."""
    index_dtype = np.dtype(list(INDEX))
    folder = staging / "buckets"
    carry_h, carry_i = np.empty((0, d), np.float32), np.empty(0, index_dtype)
    shards, norm_sum, rows = [], 0.0, 0
    for b in range(buckets):
        got = _bucket(folder, b, d)
        if got is None:
            continue
        h, index = got
        perm = np.random.default_rng([seed, 2, b]).permutation(len(h))
        h, index = h[perm], index[perm]  # the bucket twice, briefly
        for start in range(0, len(h), READ_ROWS):  # the norm's float64 sums, a chunk at a time
            chunk = h[start:start + READ_ROWS]
            norm_sum += float(np.sqrt(np.einsum("ij,ij->i", chunk, chunk, dtype=np.float64)).sum())
        rows += len(h)
        at = 0
        if len(carry_h):  # the rows the last bucket left short of a shard, first
            at = min(shard_rows - len(carry_h), len(h))
            carry_h, carry_i = np.concatenate([carry_h, h[:at]]), np.concatenate([carry_i, index[:at]])
            if len(carry_h) == shard_rows:
                shards.append(_write_shard(staging, len(shards), carry_h, carry_i, dtype, file_format))
                carry_h, carry_i = carry_h[:0], carry_i[:0]
        while len(h) - at >= shard_rows:
            shards.append(_write_shard(staging, len(shards), h[at:at + shard_rows], index[at:at + shard_rows], dtype,
                                       file_format))
            at += shard_rows
        if at < len(h):
            carry_h, carry_i = h[at:].copy(), index[at:].copy()
        del h, index
    if len(carry_h):
        shards.append(_write_shard(staging, len(shards), carry_h, carry_i, dtype, file_format))
    return {"format": "actlake-tokens", "version": MANIFEST_VERSION, "d_model": d, "dtype": dtype,
            "file_format": file_format, "rows": rows, "mean_norm": norm_sum / max(rows, 1), "seed": seed,
            "shards": shards}


def _write_shard(staging: Path, i: int, h: np.ndarray, index: np.ndarray, dtype: str, file_format: str) -> dict:
    name = f"shard-{i:05d}.{file_format}"
    if file_format == "npy":
        np.save(staging / name, h)
        np.save(staging / f"shard-{i:05d}-index.npy", index)
    else:
        import torch
        from safetensors.torch import save_file

        tensors = {"activations": torch.from_numpy(np.ascontiguousarray(h)).to(getattr(torch, dtype))}
        tensors.update({k: torch.from_numpy(np.ascontiguousarray(index[k])) for k, _ in INDEX})
        save_file(tensors, str(staging / name), metadata={"rows": str(len(h))})
    return {"file": name, "rows": int(len(h))}
