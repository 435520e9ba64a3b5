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


def activation_table(rows: list, dtype: str = "float32") -> pa.Table:
    """rows: (window, token texts, type8 ids, surprisal list, {layer: (T, d) tensor}) per sampled window."""
    from actlake.categories import TYPE8

    cols = {k: [] for k in ("doc_id", "window_index", "position", "token_id", "token", "type8", "source",
                            "surprisal", "layer")}
    vecs = []
    for w, texts, t8s, surprisal, acts in rows:
        T = len(w.ids)
        for layer, h in sorted(acts.items()):
            cols["doc_id"] += [w.doc_id] * T
            cols["window_index"] += [w.window] * T
            cols["position"] += range(T)
            cols["token_id"] += w.ids
            cols["token"] += texts
            cols["type8"] += [TYPE8[t] for t in t8s]
            cols["source"] += [w.source] * T
            cols["surprisal"] += surprisal
            cols["layer"] += [layer] * T
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
