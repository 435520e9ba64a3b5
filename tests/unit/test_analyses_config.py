"""``analyses:`` entries are the registry's: each built-in producer by its name, true/false or a mapping of its own
options (a pydantic model on the class); unknown names, options and types are one line naming the key; the flat keys
of 0.1.0 still work with a deprecation warning."""

from __future__ import annotations

import pytest

from actlake.analysis.registry import builtin_tables, check_table_names, enabled
from actlake.config import parse_config
from actlake.errors import ConfigError


def _cfg(**analyses):
    return parse_config({"name": "t", "analyses": analyses})


def test_each_builtin_is_named_by_its_key_with_its_options():
    on = dict(enabled(_cfg(contributions={"weighted": False, "by_query_category": True}, geometry=False,
                           attention_peak=True)))
    names = {cls.name: options for cls, options in on.items()}
    assert names["contributions"] == {"weighted": False, "by_query_category": True}
    assert "geometry" not in names and names["attention_peak"] == {}  # off by default, on when named
    assert "attention_peak" not in {cls.name for cls, _ in enabled(_cfg())}
    assert {cls.name for cls, _ in enabled(_cfg())} == {"dim_moments", "attention_mass", "contributions", "geometry",
                                                          "attention_by_distance"}
    assert dict(enabled(_cfg()))[next(c for c in on if c.name == "contributions")] == {"weighted": True,
                                                                                        "by_query_category": False}
    assert [c.name for c in builtin_tables(_cfg(residual_norms=False))] == ["documents", "rejects", "tokens"]


@pytest.mark.parametrize("analyses,message", [
    ({"contribution": False}, "analyses.contribution: no built-in analysis or table of that name (did you mean "
                              "'contributions'?); your own go under analyses.custom"),
    ({"contributions": {"weigthed": False}}, "analyses.contributions.weigthed: contributions has no such option "
                                             "(its options: weighted, by_query_category)"),
    ({"geometry": {"x": 1}}, "analyses.geometry.x: geometry has no such option (it has none)"),
    ({"by_sourse": True}, "analyses.by_sourse: no built-in analysis or table of that name (did you mean 'by_source'?)"),
    ({"contributions": {"weighted": "no"}}, "analyses.contributions.weighted: input should be a valid boolean, got 'no'"),
    ({"attention_weights": "fused"}, "analyses.attention_weights: 'fused' computes no attention weights, which "
                                     "analyses.contributions needs (weighted_qsum)"),
])
def test_a_bad_entry_is_one_line_naming_the_key(analyses, message):
    with pytest.raises(ConfigError) as e:
        check_table_names(_cfg(**analyses))
    assert str(e.value).startswith(message), str(e.value)


def test_an_entry_that_is_neither_a_switch_nor_a_mapping_is_refused_when_read():
    with pytest.raises(ConfigError, match=r"analyses.geometry.*true, false or a mapping of its options, got 3"):
        _cfg(geometry=3)


def test_the_flat_keys_of_0_1_0_still_work_with_a_warning():
    with pytest.warns(DeprecationWarning, match="analyses.weighted_contributions is deprecated"):
        cfg = _cfg(weighted_contributions=False, contributions_by_query_category=True)
    assert cfg.analyses.entry("contributions") == {"weighted": False, "by_query_category": True}
    with pytest.warns(DeprecationWarning):
        assert _cfg(weighted_contributions=False, contributions=False).analyses.entry("contributions") is False
    with pytest.warns(DeprecationWarning):  # an explicit option wins over the flat key
        assert _cfg(weighted_contributions=True, contributions={"weighted": False}).analyses.entry("contributions") == \
            {"weighted": False}
