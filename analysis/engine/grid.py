"""Dense statistics arrays <-> long (one row per cell) Arrow tables, vectorised.

An axis is a name with either labels (strings, e.g. categories) or a length
(integer coordinates 0..n-1). Values are float64 arrays over a prefix of the axes (:func:`to_arrow`,
:func:`from_arrow`), or over any of them in any order, as :class:`Column` declares (:func:`table`, :func:`arrays`:
the default ``to_arrow`` / ``from_arrow`` of :class:`~actlake.analysis.protocol.OneTable`).
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Column:
    """One value column of a grid table: the attribute holding its array (dotted for a nested one:
    ``moments.mean``), the axes that array spans and the column's Arrow type.

    ``axes``: None for every axis, in the table's order; an int n for the first n; or the axes' names in the
    array's own order (transposed into the table's). Over an axis it does not span a value is repeated, or,
    for the axes named in ``first_only``, stands at that axis' first label or coordinate only (0 elsewhere).
    Read back, a value comes from that first label or coordinate."""

    field: str
    """The attribute holding the array: a tensor on any device, or an array."""
    axes: int | tuple | None = None
    """The axes the array spans: None (all), n (the first n) or their names in the array's order."""
    first_only: tuple = ()
    """Axes it does not span where it stands at the first label only (0 elsewhere) instead of repeated."""
    dtype: pa.DataType = pa.float64()
    """The column's Arrow type (the values are float64 until written)."""


def _key(name) -> str:
    """An axis' name as a grid column: a multi-column axis (a tuple of names, labels tuples) travels as one
    integer column of label indices."""
    return name if isinstance(name, str) else "\x1f".join(name)


def _spans(col: Column, names: list) -> list:
    if col.axes is None:
        return list(names)
    if isinstance(col.axes, int):
        return list(names[: col.axes])
    return list(col.axes)


def table(axes: list, columns: dict[str, Column], arrays: dict[str, np.ndarray]) -> pa.Table:
    """The long table of ``columns`` (column -> :class:`Column`) over ``axes``, from ``arrays`` (each column's
    field -> its array). An axis is (name, labels or length, 0 for the arrays'); a name that is a tuple of
    column names has tuples of labels, written as one string column each, where the axis stands."""
    names = [name for name, _ in axes]
    lengths: dict = {}
    for col in columns.values():
        for name, size in zip(_spans(col, names), np.shape(arrays[col.field])):
            lengths.setdefault(name, size)
    flat = [(_key(name), lengths[name] if spec == 0 else len(spec) if not isinstance(name, str) else spec)
            for name, spec in axes]
    shape = tuple(_size(s) for _, s in flat)
    values = {}
    for column, col in columns.items():
        span = _spans(col, names)
        a = np.asarray(arrays[col.field], dtype=np.float64).transpose([span.index(n) for n in names if n in span])
        a = a.reshape([_size(flat[i][1]) if n in span else 1 for i, n in enumerate(names)])
        if col.first_only:
            at = tuple(slice(0, 1) if n in col.first_only else slice(None) for n in names)
            full = np.zeros(tuple(1 if n not in span and n not in col.first_only else s
                                  for n, s in zip(names, shape)))
            full[at] = a
            a = full
        values[column] = a
    t = to_arrow(flat, values)
    for column, col in columns.items():
        if col.dtype != pa.float64():
            t = t.set_column(t.column_names.index(column), column, t[column].cast(col.dtype))
    for name, spec in axes:
        if not isinstance(name, str):
            at, ix = t.column_names.index(_key(name)), t[_key(name)]
            t = t.remove_column(at)
            for j, part in enumerate(name):
                t = t.add_column(at + j, part, pc.take(pa.array([label[j] for label in spec]), ix))
    return t


def arrays(table_: pa.Table, axes: list, columns: dict[str, Column]) -> dict[str, np.ndarray]:
    """The inverse of :func:`table`: each column's field -> its array, in the shape :func:`table` was given
    (an integer axis of length 0 takes its length from the table)."""
    names = [name for name, _ in axes]
    flat = []
    for name, spec in axes:
        if not isinstance(name, str):
            joined = pc.binary_join_element_wise(*(table_[part] for part in name), "\x1f")
            index = pc.index_in(joined, pa.array(["\x1f".join(label) for label in spec])).to_numpy()
            table_ = table_.append_column(_key(name), pa.array(index, pa.int32()))
            spec = len(spec)
        flat.append((_key(name), spec))
    full = from_arrow(table_, flat, {column: len(axes) for column in columns})
    out = {}
    for column, col in columns.items():
        span = _spans(col, names)
        a = full[column][tuple(slice(None) if n in span else 0 for n in names)]
        order = [n for n in names if n in span]
        out[col.field] = a.transpose([order.index(n) for n in span])
    return out
