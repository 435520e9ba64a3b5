"""Every registered analysis honours the protocol: declared reads, tables that round-trip, merge of the
two halves of a batch equal to the whole (the reduce step relies on it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actlake.analysis.moments import Moments
from actlake.analysis.protocol import READS, Analysis, ModelSpec, builtin, load_class
from actlake.errors import ConfigError

SPEC = ModelSpec(n_layers=2, n_heads=3, n_kv_heads=3, d_model=8, max_length=6, device=torch.device("cpu"))


def _filled(cls, seed: int):
    """A fresh accumulator whose every tensor holds random non-negative values (counts stay counts)."""
    a = cls.create(SPEC)
    g = torch.Generator().manual_seed(seed)
    for f in dataclasses.fields(a):
        v = getattr(a, f.name)
        if isinstance(v, torch.Tensor):
            v.copy_(torch.randint(0, 50, v.shape, generator=g).double())
        elif isinstance(v, Moments):
            for name in ("count", "mean", "m2", "max_abs"):
                getattr(v, name).copy_(torch.rand(getattr(v, name).shape, generator=g, dtype=torch.float64) * 9 + 1)
    return a


def _tensors(a) -> dict:
    out = {}
    for f in dataclasses.fields(a):
        v = getattr(a, f.name)
        if isinstance(v, torch.Tensor):
            out[f.name] = v
        elif isinstance(v, Moments):
            out.update({f"{f.name}.{n}": getattr(v, n) for n in ("count", "mean", "m2", "max_abs")})
    return out


@pytest.mark.parametrize("name", sorted(builtin()))
def test_builtin_analyses_declare_and_round_trip(name):
    cls = builtin()[name]
    assert issubclass(cls, Analysis) and cls.name == name and cls.tables and set(cls.reads) <= READS
    a = _filled(cls, 0)
    back = cls.from_tables(a.to_tables())
    for key, value in _tensors(a).items():
        torch.testing.assert_close(_tensors(back)[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", sorted(builtin()))
def test_merge_is_commutative_and_reduces_to_tables(name):
    cls = builtin()[name]
    a, b = _filled(cls, 1), _filled(cls, 2)
    ab, ba = a.merge(b), b.merge(a)
    for key, value in _tensors(ab).items():
        torch.testing.assert_close(_tensors(ba)[key], value, rtol=1e-12, atol=1e-12, msg=key)
    assert set(ab.to_tables()) == set(cls.tables)


def test_load_class_refuses_what_is_not_an_analysis():
    with pytest.raises(ConfigError, match="not a subclass"):
        load_class("collections:OrderedDict")
    with pytest.raises(ConfigError, match="cannot import"):
        load_class("no_such_module_here:Thing")
