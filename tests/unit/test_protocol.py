"""Every registered producer honours the protocol: declared sites and products, tables that round-trip, merge of the
two halves of a batch equal to the whole (the reduce step relies on it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actlake.analysis.engine.moments import Moments
from actlake.analysis.protocol import PRODUCTS, SITES, Analysis, ModelSpec, ShardTable
from actlake.analysis.registry import builtin, builtin_tables, load_class
from actlake.config import parse_config
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
    assert issubclass(cls, Analysis) and cls.name == name and cls.tables and set(cls.sites) <= SITES
    assert set(cls.products) <= PRODUCTS and (not cls.products or "attention" in cls.sites)
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


def test_every_builtin_shard_table_declares_its_schema_and_writes_it_when_empty():
    cfg = parse_config({"name": "t", "activations": {"layers": [1]}})
    classes = builtin_tables(cfg)
    assert [c.name for c in classes] == ["documents", "rejects", "tokens", "residual_norms", "activations"]
    for cls in classes:
        assert issubclass(cls, ShardTable) and cls.per_token and cls.tables == (cls.name,)
        empty = cls.to_table([], **cls.options_from(cfg))
        assert empty.num_rows == 0 and (cls.schema is None or empty.schema == cls.schema)


def test_the_old_reads_attribute_still_works_with_a_warning_and_a_bad_name_in_it_is_refused(tmp_path, monkeypatch):
    """0.1.0's ``reads`` is split into ``sites`` and ``products`` with an ActlakeDeprecationWarning (CHANGELOG.md);
    a name that is neither is refused by the usual check, named."""
    from actlake.deprecation import ActlakeDeprecationWarning

    body = ("from actlake.analysis.stats import SumStats\n"
            "class Old(SumStats):\n    name, tables = 'old', ('old',)\n    reads = frozenset(READS)\n"
            "    @classmethod\n    def create(cls, spec, **o):\n        return cls()\n")
    (tmp_path / "old_style.py").write_text(body.replace("READS", "{'attention', 'mass'}"))
    (tmp_path / "old_bad.py").write_text(body.replace("READS", "{'attention', 'mas'}"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(ActlakeDeprecationWarning, match="Old.reads is deprecated: declare sites = {'attention'} and "
                                                       "products = {'mass'}"):
        cls = load_class("old_style:Old")
    assert cls.sites == {"attention"} and cls.products == {"mass"}
    with pytest.warns(ActlakeDeprecationWarning), pytest.raises(ConfigError, match=r"unknown: \['mas'\]"):
        load_class("old_bad:Old")


def test_two_producers_writing_one_table_are_refused_naming_both(tmp_path, monkeypatch):
    from actlake.analysis.registry import check_table_names

    (tmp_path / "clash.py").write_text(
        "import pyarrow as pa\nfrom actlake.analysis.protocol import ShardTable\n"
        "class MyTokens(ShardTable):\n    name, tables = 'my_tokens', ('tokens',)\n"
        "    schema = pa.schema([('x', pa.int64())])\n"
        "    @classmethod\n    def to_table(cls, parts, **o):\n        return cls.schema.empty_table()\n"
        "class Partial(MyTokens):\n    name, tables = 'partial', ('mass_partial',)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = parse_config({"name": "t", "analyses": {"custom": [{"analysis": "clash:MyTokens"}]}})
    with pytest.raises(ConfigError, match="'tokens' and 'my_tokens' both write a table 'tokens'"):
        check_table_names(cfg)
    cfg = parse_config({"name": "t", "analyses": {"tokens": False, "custom": [{"analysis": "clash:Partial"}]}})
    with pytest.raises(ConfigError, match="'partial' names a table 'mass_partial'"):
        check_table_names(cfg)
    check_table_names(parse_config({"name": "t", "analyses": {"tokens": False, "custom": [{"analysis": "clash:MyTokens"}]}}))


@pytest.mark.parametrize("name", sorted(builtin()))
def test_statistics_by_source_round_trip_and_their_total_is_the_merge_of_every_label(name):
    """analyses.by_source's accumulator (analysis/by_source.py): labelled rows read back label by label, the
    reduced tables' '*' rows are every label merged, and merging two of them merges label by label."""
    import pyarrow.compute as pc

    from actlake.analysis.by_source import ALL, BySource

    cls = builtin()[name]
    parts = {"code": _filled(cls, 3), "prose": _filled(cls, 4)}
    split = BySource(cls.create(SPEC), split=True, parts=parts)
    reduced = split.to_tables(with_total=True)
    assert set(reduced[cls.tables[0]].column("source").to_pylist()) == {"code", "prose", ALL}
    back = BySource.from_tables(cls, reduced)  # the '*' rows are left out: they are the labels' sum
    assert sorted(back.parts) == [("none", "code"), ("none", "prose")]  # (intervention, source): the clean pass
    whole = parts["code"].merge(parts["prose"])
    total = BySource.from_tables(cls, {t: d.filter(pc.equal(d.column("source"), ALL)) for t, d in reduced.items()})
    for key, value in _tensors(whole).items():
        torch.testing.assert_close(_tensors(total.parts["none", ALL])[key], value, rtol=1e-12, atol=1e-12, msg=key)
    more = back.merge(BySource(cls.create(SPEC), split=True, parts={"prose": _filled(cls, 5), "web": _filled(cls, 6)}))
    assert sorted(src for _, src in more.parts) == ["code", "prose", "web"]
    for key, value in _tensors(parts["prose"].merge(_filled(cls, 5))).items():
        torch.testing.assert_close(_tensors(more.parts["none", "prose"])[key], value, rtol=1e-12, atol=1e-12, msg=key)
    plain = BySource(cls.create(SPEC))  # without by_source: one label, '*', and no extra rows
    assert set(plain.to_tables(with_total=True)[cls.tables[0]].column("source").to_pylist()) == {ALL}
    with pytest.raises(ConfigError, match=r"analyses.max_sources: .* 3 source labels \(code, prose, web\)"):
        more.max_sources = 2
        more.add("code", _filled(cls, 7))
