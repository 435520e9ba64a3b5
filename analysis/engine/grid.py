"""Dense statistics arrays <-> long (one row per cell) Arrow tables, vectorised.

An axis is a name with either labels (strings, e.g. categories) or a length
(integer coordinates 0..n-1). Values are float64 arrays over a prefix of the axes.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

Axis = tuple[str, Union[int, Sequence[str]]]
INT_TYPES = {"layer": pa.int16(), "head": pa.int16()}


def _size(spec) -> int:
    return spec if isinstance(spec, int) else len(spec)


def to_arrow(axes: list[Axis], values: dict[str, np.ndarray]) -> pa.Table:
    """One row per cell of the full grid; a value over fewer axes is broadcast. Integer axes may be given
    as 0 to take their length from the values (as :func:`from_arrow` takes it from the table)."""
    values = {name: np.asarray(v, dtype=np.float64) for name, v in values.items()}
    axes = [(name, max(v.shape[i] for v in values.values() if v.ndim > i) if spec == 0 else spec)
            for i, (name, spec) in enumerate(axes)]
    shape = tuple(_size(s) for _, s in axes)
    idx = np.indices(shape).reshape(len(shape), -1)
    cols = {}
    for (name, spec), ix in zip(axes, idx):
        if isinstance(spec, int):
            cols[name] = pa.array(ix, INT_TYPES.get(name, pa.int32()))
        else:
            cols[name] = pa.DictionaryArray.from_arrays(pa.array(ix, pa.int32()), pa.array(list(spec))).cast(pa.string())
    for name, v in values.items():
        v = v.reshape(v.shape + (1,) * (len(shape) - v.ndim))
        cols[name] = pa.array(np.broadcast_to(v, shape).ravel(), pa.float64())
    return pa.table(cols)


def from_arrow(table: pa.Table, axes: list[Axis], values: dict[str, int]) -> dict[str, np.ndarray]:
    """Inverse of :func:`to_arrow`; ``values`` maps a column to how many leading axes it spans.

    Integer axes may be given as 0 to take their length from the table.
    """
    resolved = []
    for name, spec in axes:
        if spec == 0:
            spec = int(pc.max(table[name]).as_py()) + 1
        resolved.append((name, spec))
    shape = tuple(_size(s) for _, s in resolved)
    flat = np.zeros(len(table), dtype=np.int64)
    for name, spec in resolved:
        col = table[name]
        if isinstance(spec, int):
            ix = col.to_numpy()
        else:
            lookup = {label: i for i, label in enumerate(spec)}
            ix = np.array([lookup[s] for s in pc.unique(col).to_pylist()], dtype=np.int64)
            ix = ix[pc.index_in(col, pc.unique(col)).to_numpy()]
        flat = flat * _size(spec) + ix
    out = {}
    for name, n_axes in values.items():
        full = np.zeros(int(np.prod(shape)))
        full[flat] = table[name].to_numpy()
        out[name] = full.reshape(shape)[(slice(None),) * n_axes + (0,) * (len(shape) - n_axes)]
    return out
