"""The activation store: sampled windows' hidden states as Parquet, one row per (token, layer).

Columns: doc_id, window_index, position, token_id, token, type8, source, surprisal, layer, and
``h``, a fixed-size float array of the hidden size (DuckDB reads it as ``FLOAT[d]``). Windows are
sampled by a hash of (seed, doc_id, window_index), so the sample does not depend on sharding.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from actlake.errors import ConfigError
from actlake.hashing import unit_hash

META_BYTES = 48
"""Approximate bytes per row besides the vector (ids, token text, labels; before compression)."""


def resolve_layers(layers: list[int], n_layers: int) -> list[int]:
    """Config layer numbers (negative from the end) -> hidden-state indices 0..n_layers."""
    out = []
    for i, layer in enumerate(layers):
        idx = layer if layer >= 0 else n_layers + 1 + layer
        if not 0 <= idx <= n_layers:
            raise ConfigError(f"activations.layers[{i}]: layer {layer} out of range for a model with {n_layers} "
                              f"layers (hidden states 0..{n_layers})")
        out.append(idx)
    return sorted(set(out))


def window_sampled(cfg, doc_id: int, window: int) -> bool:
    """Deterministic Bernoulli(fraction) draw for one window."""
    if cfg is None or cfg.fraction >= 1.0:
        return True
    return unit_hash(f"{cfg.seed}:{doc_id}:{window}") < cfg.fraction


def bytes_per_token(n_layers_stored: int, d: int, dtype: str) -> int:
    return n_layers_stored * (d * (2 if dtype == "float16" else 4) + META_BYTES)


def add_token_columns(cols: dict, w, texts: list, t8s: list, surprisal: list) -> None:
    """Append one window's per-token columns (those of ``cols``' keys that a window gives) to ``cols``."""
    from actlake.categories import TYPE8

    T = len(w.ids)
    cols["doc_id"] += [w.doc_id] * T
    cols["window_index"] += [w.window] * T
    cols["position"] += range(T)
    cols["token_id"] += w.ids
    cols["token"] += texts
    cols["type8"] += [TYPE8[t] for t in t8s]
    cols["source"] += [w.source] * T
    cols["surprisal"] += surprisal


def activation_table(rows: list, dtype: str = "float32") -> pa.Table:
    """rows: (window, token texts, type8 ids, surprisal list, {layer: (T, d) tensor}) per sampled window."""
    cols = {k: [] for k in ("doc_id", "window_index", "position", "token_id", "token", "type8", "source",
                            "surprisal", "layer")}
    vecs = []
    for w, texts, t8s, surprisal, acts in rows:
        for layer, h in sorted(acts.items()):
            add_token_columns(cols, w, texts, t8s, surprisal)
            cols["layer"] += [layer] * len(w.ids)
            vecs.append(h.float().numpy())
    np_dtype, pa_dtype = (np.float16, pa.float16()) if dtype == "float16" else (np.float32, pa.float32())
    d = vecs[0].shape[1] if vecs else 0
    flat = np.concatenate(vecs).astype(np_dtype).ravel() if vecs else np.zeros(0, np_dtype)
    h = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa_dtype), d) if vecs else pa.array([], pa.list_(pa_dtype, 1))
    schema = pa.schema([("doc_id", pa.int64()), ("window_index", pa.int32()), ("position", pa.int32()),
                        ("token_id", pa.int32()), ("token", pa.string()), ("type8", pa.string()),
                        ("source", pa.string()), ("surprisal", pa.float32()), ("layer", pa.int16())])
    base = pa.table(cols, schema=schema)
    return base.append_column("h", h)


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
    import hashlib
    import json

    from actlake.errors import StorageError
    from actlake.fs import location
    from actlake.storage.layout import RunLayout
    from actlake.storage.shards import committed

    layout = RunLayout(location(root))
    try:
        run = json.loads(layout.run_json.read_text())
        plan_hash, shard_ids = run["plan_hash"], [s["shard_id"] for s in run["shards"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
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

    from actlake.errors import StorageError
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
