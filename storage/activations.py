"""Reading the activation store (written by :class:`~actlake.analysis.activation_sample.ActivationSample`).

The store: sampled windows' hidden states as Parquet, one row per (token, layer).

Columns: doc_id, window_index, position, token_id, token, type8, source, surprisal, layer, and
``h``, a fixed-size float array of the hidden size (DuckDB reads it as ``FLOAT[d]``). Windows are
sampled by a hash of (seed, doc_id, window_index), so the sample does not depend on sharding.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from actlake.errors import ConfigError, StorageError
from actlake.fs import location
from actlake.storage.layout import RunLayout


def read_windows(con, layer: int, where: str = "") -> tuple:
    """Read one layer of a store through DuckDB: (h (N, T, d) float32, valid (N, T), meta rows per window).

    ``con`` is a connection from :func:`actlake.storage.sql.open_run`; windows are ordered by
    (doc_id, window_index) and padded to the longest.
    """
    tbl = con.sql(f"""
        SELECT doc_id, window_index, position, h, type8, source, surprisal FROM activations
        WHERE layer = {int(layer)} {('AND ' + where) if where else ''} ORDER BY doc_id, window_index, position""").to_arrow_table()
    if tbl.num_rows == 0:
        raise ConfigError(f"the activation store has no rows for layer {layer}")
    doc = tbl["doc_id"].to_numpy()
    win = tbl["window_index"].to_numpy()
    pos = tbl["position"].to_numpy()
    hcol = tbl["h"].combine_chunks()
    d = hcol.type.list_size
    vec = hcol.values.to_numpy(zero_copy_only=False).reshape(-1, d).astype(np.float32)
    starts = np.flatnonzero(np.r_[True, (doc[1:] != doc[:-1]) | (win[1:] != win[:-1])])
    lengths = np.diff(np.r_[starts, len(doc)])
    N, T = len(starts), int(lengths.max())
    h = np.zeros((N, T, d), np.float32)
    valid = np.zeros((N, T), bool)
    w_idx = np.repeat(np.arange(N), lengths)
    h[w_idx, pos] = vec
    valid[w_idx, pos] = True
    type8 = np.array(tbl["type8"].to_pylist(), dtype=object)
    surprisal = tbl["surprisal"].to_numpy(zero_copy_only=False)
    source = tbl["source"].to_pylist()
    meta = {"doc_id": doc[starts], "window_index": win[starts], "source": [source[s] for s in starts],
            "type8": np.full((N, T), None, dtype=object), "surprisal": np.full((N, T), np.nan, np.float32)}
    meta["type8"][w_idx, pos] = type8
    meta["surprisal"][w_idx, pos] = surprisal
    return h, valid, meta


# --------------------------------------------------------------------------- checks before training on a store


def verify_store(root) -> dict:
    """Check that every planned shard of the store at ``root`` is complete, as its commit records say.

    Returns ``{"fingerprint", "plan_hash", "files"}``: a hash of the plan and of every committed
    activation file's path, rows and bytes, and those files as ``(path, record entry)``. Raises
    StorageError naming the missing or changed shards and files."""
    from actlake.storage.manifest import read_run
    from actlake.storage.shards import committed

    layout = RunLayout(location(root))
    try:
        run = read_run(layout)  # a store of another run format: refused by name
        plan_hash, shard_ids = run["plan_hash"], [s["shard_id"] for s in run["shards"]]
    except (KeyError, TypeError) as e:
        raise StorageError(f"{layout.run_json}: not the run.json of an extraction ({type(e).__name__}: {e})") from None
    done = committed(layout, plan_hash)
    problems = [f"shard {sid:05d} is not committed" for sid in shard_ids if sid not in done.shards]
    problems += done.skipped
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise StorageError(f"the activation store {layout.root} is incomplete: {shown}; rerun `actlake run` with its "
                           "config to finish it")
    files = [(layout.root / m["path"], m) for sid in shard_ids
             for t, m in sorted(done.shards[sid]["files"].items()) if t == "activations"]
    listing = [[m["path"], m["rows"], m["bytes"]] for _, m in files]
    digest = hashlib.sha256(json.dumps({"plan_hash": plan_hash, "files": listing}).encode()).hexdigest()[:16]
    return {"fingerprint": digest, "plan_hash": plan_hash, "files": files}


def check_store_values(files: list, layers: list[int] | None = None, max_shown: int = 5) -> tuple[int, set]:
    """Verify every activation file (magic, size, rows, page checksums) and that its hidden states are finite.

    ``layers``: only these layers' rows must be finite (None: all). Returns the rows checked and the
    stored windows as ``{(doc_id, window_index)}``; raises StorageError naming the file, or the
    first rows with NaN/inf (file, row, doc_id/window/position/layer)."""
    import pyarrow.parquet as pq

    from actlake.storage.parquet_io import verify_parquet

    bad, n_bad, rows, windows = [], 0, 0, set()
    for path, meta in files:
        verify_parquet(path, rows=meta["rows"], size=meta["bytes"])
        offset = 0
        for batch in pq.ParquetFile(path).iter_batches(columns=["doc_id", "window_index", "position", "layer", "h"]):
            first = batch.column("position").to_numpy() == 0
            windows.update(zip(batch.column("doc_id").to_numpy()[first].tolist(),
                               batch.column("window_index").to_numpy()[first].tolist()))
            idx = _nonfinite_rows(batch, layers)
            n_bad += len(idx)
            bad += [(path, offset + i, batch.slice(i, 1).to_pylist()[0]) for i in idx[: max_shown - len(bad)]]
            offset += batch.num_rows
        rows += offset
    if n_bad:
        shown = "; ".join(f"{p.name} row {i} (doc_id {r['doc_id']}, window {r['window_index']}, position "
                          f"{r['position']}, layer {r['layer']})" for p, i, r in bad)
        raise StorageError(f"the activation store has non-finite hidden states (NaN or inf) in {n_bad} row(s): {shown} "
                           f"[in {bad[0][0].parent}]; re-extract it (e.g. with model.dtype float32) or choose other layers")
    return rows, windows


def _nonfinite_rows(batch, layers) -> np.ndarray:
    """Row indices of ``batch`` whose vector ``h`` has a NaN or inf (rows of other layers ignored)."""
    h = batch.column("h")
    if len(h) == 0:
        return np.zeros(0, np.int64)
    vec = h.flatten().to_numpy(zero_copy_only=False).reshape(len(h), -1)
    bad = ~np.isfinite(vec).all(axis=1)
    if layers is not None:
        bad &= np.isin(batch.column("layer").to_numpy(), list(layers))
    return np.flatnonzero(bad)
