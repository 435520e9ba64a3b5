"""``actlake export RUN --format tokens|saelens --layer L -o DIR``: a run's activation store as what sparse-autoencoder
trainers read (issue 52): SAELens's activation cache (:func:`export_saelens`), or token-level shuffled shards for any
trainer (:func:`export_tokens`, below).

Every token of the store's windows at hidden state L, exactly once, in a global random order fixed by ``--seed``,
cut into shards of ``--shard-rows`` rows (the last one shorter): ``shard-00000.safetensors`` (or ``.npy``) holding
``activations`` (N, d) in float32 or bfloat16 and the row index (``doc_id``, ``window_index``, ``position``,
``token_id``), and ``manifest.json``: layer, width, dtype, rows, the mean activation norm (the usual SAE input
scaling: ``sqrt(d) / mean_norm``), the seed and each shard's rows. :func:`actlake.activations.iterate` streams it.

The shuffle is out of core, in two passes (Rao's bucket shuffle, which gives every order the same probability):
pass 1 streams the store and sends each row to one of B buckets drawn at random, appended to a file per bucket; pass
2 reads the buckets in turn, shuffles each in memory and writes the shards. B is chosen so that a bucket holds about
``--memory-mb`` (at most a tenth of the data); the process holds one bucket and one shard's worth besides, stated
when the export starts. The output is written into ``DIR.partial-*`` beside DIR and renamed to DIR when whole; an
existing DIR is refused (nothing is overwritten). One process reads the whole store (local or object storage); DIR
is a local folder.
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

from actlake.errors import ActlakeError, ConfigError

log = logging.getLogger("actlake.export")

INDEX = (("doc_id", np.int64), ("window_index", np.int32), ("position", np.int32), ("token_id", np.int32))
"""The row index kept beside each activation, and its dtypes."""
READ_ROWS = 65_536
"""Rows per record batch read from the store in pass 1."""
MANIFEST_VERSION = 1


def export_tokens(run_dir, layer: int, out_dir, shard_rows: int = 65_536, dtype: str = "float32",
                  file_format: str = "safetensors", seed: int = 0, memory_mb: float = 512) -> dict:
    """Write the export; returns its manifest."""
    out = Path(out_dir)
    _check_arguments(out, shard_rows, dtype, file_format, memory_mb)
    con, where, rows, d = _store(run_dir, layer)
    row_bytes = 4 * d + sum(np.dtype(t).itemsize for _, t in INDEX)
    buckets = max(10, math.ceil(rows * row_bytes / (memory_mb * 2**20)))
    log.info("exporting %s rows of hidden state %d (width %d) in %d buckets: about %.0f MiB in memory at once "
             "(a bucket, a read batch and a shard), %.0f MiB of buckets on disk", f"{rows:,}", layer, d, buckets,
             (rows / buckets * 1.2 + READ_ROWS + shard_rows) * row_bytes / 2**20, rows * row_bytes / 2**20)
    staging = out.parent / f"{out.name}.partial-{uuid.uuid4().hex[:8]}"
    (staging / "buckets").mkdir(parents=True)
    try:
        _pass_one(con.sql(f"SELECT doc_id, window_index, position, token_id, h {where}"), staging / "buckets",
                  buckets, d, seed)
        manifest = _pass_two(staging, buckets, d, shard_rows, dtype, file_format, seed)
        manifest.update(run=str(run_dir), layer=int(layer))
        shutil.rmtree(staging / "buckets")
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if manifest["rows"] != rows:
            raise ActlakeError(f"export: {manifest['rows']} rows written where the store holds {rows}")
        os.rename(staging, out)  # whole or not at all; an existing DIR makes this fail, not overwrite it
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _store(run_dir, layer: int):
    """(connection, FROM clause, rows, width) of hidden state ``layer`` in the run's activation store, or one line
    saying what is missing."""
    from actlake.storage.sql import open_run

    con = open_run(str(run_dir))
    if "activations" not in {r[0] for r in con.sql("SELECT table_name FROM information_schema.tables").fetchall()}:
        raise ConfigError(f"{run_dir}: the run has no activation store; run the job with activations.layers: [{layer}]")
    where = f"FROM activations WHERE layer = {int(layer)}"
    rows = con.sql(f"SELECT count(*) {where}").fetchall()[0][0]
    if not rows:
        layers = sorted(r[0] for r in con.sql("SELECT DISTINCT layer FROM activations").fetchall())
        raise ConfigError(f"--layer: the activation store has no rows for hidden state {layer} (it holds {layers})")
    return con, where, rows, con.sql(f"SELECT len(h) {where} LIMIT 1").fetchall()[0][0]


def export_saelens(run_dir, layer: int, out_dir, context_size: int | None = None, hook_name: str | None = None) -> dict:
    """SAELens's activation cache (``CacheActivationsRunner``'s format, read by ``ActivationsStore`` with
    ``cached_activations_path``): a Hugging Face ``datasets`` folder (``save_to_disk``) with one row per window of
    exactly ``context_size`` tokens (default: the store's longest), a column named by TransformerLens's hook (default
    ``blocks.L.hook_resid_pre``: hidden state L is the residual stream entering block L) of
    ``Array2D((context_size, d), float32)``, and ``token_ids``, ``Sequence(int32, length=context_size)``. Shorter
    windows (a document's end) are left out and counted. Rows in the store's order (SAELens shuffles as it
    reads). Returns what was written."""
    import datasets

    out = Path(out_dir)
    _check_arguments(out, 1, "float32", "safetensors", 1)
    con, where, _, d = _store(run_dir, layer)
    lengths = con.sql(f"SELECT count(*) AS n {where} GROUP BY doc_id, window_index").fetchall()
    T = context_size or max(n for (n,) in lengths)
    if T < 1:
        raise ConfigError(f"--context-size: must be at least 1, got {T}")
    full = sum(1 for (n,) in lengths if n == T)
    if not full:
        raise ConfigError(f"--context-size {T}: no stored window has exactly {T} tokens "
                          f"(the longest has {max(n for (n,) in lengths)})")
    hook = hook_name or f"blocks.{int(layer)}.hook_resid_pre"
    features = datasets.Features({hook: datasets.Array2D((T, d), "float32"),
                                  "token_ids": datasets.Sequence(datasets.Value("int32"), length=T)})
    sql = (f"SELECT doc_id, window_index, token_id, h {where} AND (doc_id, window_index) IN "
           f"(SELECT (doc_id, window_index) {where} GROUP BY doc_id, window_index HAVING count(*) = {T}) "
           f"ORDER BY doc_id, window_index, position")
    staging = out.parent / f"{out.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        ds = datasets.Dataset.from_generator(_windows, features=features, cache_dir=str(staging / "cache"),
                                             gen_kwargs={"run_dir": str(run_dir), "sql": sql, "T": T, "d": d, "hook": hook})
        ds.save_to_disk(str(staging / "dataset"))
        del ds
        os.rename(staging / "dataset", out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    left = len(lengths) - full
    log.info("wrote %d windows of %d tokens (%s), %d shorter window(s) left out", full, T, hook, left)
    return {"rows": full, "context_size": T, "d_model": d, "hook_name": hook, "left_out": left}


def _windows(run_dir: str, sql: str, T: int, d: int, hook: str):
    """Rows of the cache, one window at a time, from the store's rows in (doc, window, position) order (its own
    connection: ``datasets`` pickles a generator's arguments)."""
    from actlake.storage.sql import open_run

    h, ids, n = np.empty((T, d), np.float32), np.empty(T, np.int32), 0
    for batch in open_run(run_dir).sql(sql).to_arrow_reader(READ_ROWS):
        vec = batch.column("h").flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, d)
        tok = batch.column("token_id").to_numpy(zero_copy_only=False)
        for i in range(batch.num_rows):
            h[n], ids[n] = vec[i], tok[i]
            n += 1
            if n == T:
                yield {hook: h.copy(), "token_ids": ids.copy()}
                n = 0


def _check_arguments(out: Path, shard_rows: int, dtype: str, file_format: str, memory_mb: float) -> None:
    if "://" in str(out):
        raise ConfigError(f"-o: {out}: the export is written to a local folder (copy it to object storage after)")
    if os.path.lexists(out):
        raise ConfigError(f"-o: {out} exists; the export writes a new folder and overwrites nothing")
    if not out.parent.is_dir():
        raise ConfigError(f"-o: {out.parent} is not a folder")
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


def _pass_one(relation, folder: Path, buckets: int, d: int, seed: int) -> None:
    """Each row of the store to a random bucket: ``h-B.bin`` (float32 rows) and ``index-B.bin`` (INDEX records)."""
    rng = np.random.default_rng([seed, 1])
    index_dtype = np.dtype(list(INDEX))
    files = {}
    try:
        for batch in relation.to_arrow_reader(READ_ROWS):
            n = batch.num_rows
            h = batch.column("h").flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(n, d)
            index = np.empty(n, index_dtype)
            for name, _ in INDEX:
                index[name] = batch.column(name).to_numpy(zero_copy_only=False)
            to = rng.integers(0, buckets, n)
            order = np.argsort(to, kind="stable")
            bounds = np.searchsorted(to[order], np.arange(buckets + 1))
            for b in range(buckets):
                take = order[bounds[b]:bounds[b + 1]]
                if len(take):
                    if b not in files:
                        files[b] = (open(folder / f"h-{b}.bin", "wb"), open(folder / f"index-{b}.bin", "wb"))
                    files[b][0].write(h[take].tobytes())
                    files[b][1].write(index[take].tobytes())
    finally:
        for fh, fi in files.values():
            fh.close()
            fi.close()


def _pass_two(staging: Path, buckets: int, d: int, shard_rows: int, dtype: str, file_format: str,
              seed: int) -> dict:
    """The buckets in turn, each shuffled, cut into shards; the manifest."""
    index_dtype = np.dtype(list(INDEX))
    folder = staging / "buckets"
    pending_h, pending_i = np.empty((0, d), np.float32), np.empty(0, index_dtype)
    shards, norm_sum, rows = [], 0.0, 0
    for b in range(buckets):
        if not (folder / f"h-{b}.bin").exists():
            continue
        h = np.fromfile(folder / f"h-{b}.bin", np.float32).reshape(-1, d)
        index = np.fromfile(folder / f"index-{b}.bin", index_dtype)
        perm = np.random.default_rng([seed, 2, b]).permutation(len(h))
        pending_h, pending_i = np.concatenate([pending_h, h[perm]]), np.concatenate([pending_i, index[perm]])
        while len(pending_h) >= shard_rows:
            shards.append(_write_shard(staging, len(shards), pending_h[:shard_rows], pending_i[:shard_rows], dtype,
                                       file_format))
            pending_h, pending_i = pending_h[shard_rows:], pending_i[shard_rows:]
        norm_sum += float(np.linalg.norm(h.astype(np.float64), axis=1).sum())
        rows += len(h)
        (folder / f"h-{b}.bin").unlink()
        (folder / f"index-{b}.bin").unlink()
    if len(pending_h):
        shards.append(_write_shard(staging, len(shards), pending_h, pending_i, dtype, file_format))
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
