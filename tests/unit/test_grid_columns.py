"""OneTable's default to_arrow / from_arrow, driven by AXES and COLUMNS (analysis/engine/grid.py): transposed and
partial spans, labels an instance holds, an axis of two label columns, first-label-only values, a column type."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pytest
import torch

from actlake.analysis.protocol import Column, LabelsOf, OneTable


@dataclass
class Toy(OneTable):
    AXES = [("layer", 0), (("kind", "sub"), (("a", "x"), ("b", "y"))),
            ("group", LabelsOf("groups", (("all",), ("all", "g")))), ("dim", 0)]
    COLUMNS = {"full": Column("full"), "swapped": Column("swapped", ("dim", "layer")),
               "first": Column("first", ("layer", "dim"), first_only=("group",)),
               "count": Column("count", 1, dtype=pa.int64())}

    full: torch.Tensor  # (L, K, G, d)
    swapped: torch.Tensor  # (d, L)
    first: torch.Tensor  # (L, d), group 'all' only
    count: torch.Tensor  # (L,)
    groups: tuple = ("all",)


def test_the_declared_table_has_its_schema_and_values_and_reads_back():
    L, K, G, d = 2, 2, 2, 3
    g = torch.Generator().manual_seed(0)
    toy = Toy(torch.rand(L, K, G, d, generator=g, dtype=torch.float64), torch.rand(d, L, generator=g, dtype=torch.float64),
              torch.rand(L, d, generator=g, dtype=torch.float64), torch.tensor([3.0, 4.0], dtype=torch.float64), ("all", "g"))
    t = toy.to_arrow()
    assert t.schema == pa.schema([("layer", pa.int16()), ("kind", pa.string()), ("sub", pa.string()),
                                  ("group", pa.string()), ("dim", pa.int32()), ("full", pa.float64()),
                                  ("swapped", pa.float64()), ("first", pa.float64()), ("count", pa.int64())])
    assert t.num_rows == L * K * G * d
    rows = t.to_pylist()
    r = rows[-1]  # the grid's last cell
    assert (r["layer"], r["kind"], r["sub"], r["group"], r["dim"]) == (1, "b", "y", "g", 2)
    assert r["full"] == toy.full[1, 1, 1, 2].item() and r["swapped"] == toy.swapped[2, 1].item()
    assert r["first"] == 0 and r["count"] == 4
    assert rows[0]["first"] == toy.first[0, 0].item()
    back = Toy.from_arrow(t)
    assert back.groups == ("all", "g")
    for f in ("full", "swapped", "first", "count"):
        np.testing.assert_array_equal(getattr(back, f), getattr(toy, f))
    with pytest.raises(ValueError, match="none of groups"):
        Toy.from_arrow(t.set_column(3, "group", pa.array(["h"] * t.num_rows)))


def test_a_one_table_analysis_without_columns_or_its_own_methods_says_so():
    class Bare(OneTable):
        pass

    with pytest.raises(NotImplementedError, match="Bare: declare AXES and COLUMNS, or write to_arrow"):
        Bare().to_arrow()
    with pytest.raises(NotImplementedError, match="Bare: declare AXES and COLUMNS, or write from_arrow"):
        Bare.from_arrow(pa.table({"x": [1]}))
